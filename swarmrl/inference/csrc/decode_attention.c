/* The CPU decoder's small kernels (float32): a decode step's grouped-query attention over a
 * per-slot KV cache with its rotary embedding and cache writes, the RMS norm, the gated MLP's
 * activation, the prefill's rotary embedding, and the seeded choice of the next token. Torch runs
 * the four products of each layer; these replace the ~20 small torch kernels around them.
 *
 * Why attention here: at a decode step attention reads every cached key and value of every row,
 * and on a CPU that read is the cost (SmolLM2-135M, 64 rows of ~200 tokens: 590 MB a step).
 * torch's batched products write the scores out, softmax them in another kernel and read the
 * values in a third. Here each (row, key head) pair reads its keys once for all the query heads
 * that share them (grouped-query attention), keeps the scores in a small buffer, and reads its
 * values once.
 *
 * Cache layout (what inference/decoder.py keeps):
 *   k, v [slots, kv_heads, capacity, dim]      row r uses slot r and attends to 0..len[r]
 * The rows x kv_heads pairs are split over `threads` OpenMP threads. The library is linked
 * against libgomp.so.1, and torch has loaded its own libgomp.so.1 before this one is, so the
 * dynamic linker binds both to torch's copy: one thread team, whose threads are already spinning
 * after torch's last kernel (a second runtime, or threads of our own, would fight them for the
 * cores: 172 ms a step against 138 with torch's attention, measured). inference/native.py checks
 * that only one libgomp is mapped and otherwise runs on one thread.
 *
 * Written with GCC's vector extensions (8 floats, one AVX register; the compiler maps them to
 * what -march=native offers), dim a multiple of 8 up to MAX_DIM, group up to MAX_GROUP.
 * Numerics: float32, the row maximum subtracted before exp as torch's softmax does; the sums
 * run in another order than torch's kernels (float32 rounding: ~1e-7 relative).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256
#define W 8

typedef float v8 __attribute__((vector_size(W * sizeof(float))));
typedef int32_t i8 __attribute__((vector_size(W * sizeof(int32_t))));

static inline v8 load(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof(x));
    return x;
}

static inline void store(float *p, v8 x) { memcpy(p, &x, sizeof(x)); }

/* The eight horizontal sums of a[0..7], as one vector (sum i in lane i). */
static inline v8 sum8x8(const v8 a[W]) {
    const i8 even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const i8 lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const i8 lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8 b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) + __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
    /* c[0] lanes: sums of a0,a1,a2,a3 over lanes 0-3, then over lanes 4-7; c[1] the same for a4-a7 */
    return __builtin_shuffle(c[0], c[1], lo4) + __builtin_shuffle(c[0], c[1], hi4);
}

/* The kernel for dim = nv * W; inlined with nv a constant for the common head sizes, so the
   query and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_pair(const float *qs, const float *kp, const float *vp,
                                                              const int64_t n, float *os, int64_t group,
                                                              const int64_t nv, int64_t capacity, float scale,
                                                              float *scratch) {
    const int64_t dim = nv * W;
    for (int64_t g = 0; g < group; g++) {
        const float *qp = qs + g * nv * W;
        float *s = scratch + g * capacity;
        v8 qv[MAX_DIM / W];
        for (int64_t b = 0; b < nv; b++) qv[b] = load(qp + b * W) * scale;
        /* scores, eight keys at a time: eight vector dot products, then their sums at once (a
           key row is re-read from L2 for each query head of the group; reading the eight rows
           once for all the heads measured slower, the queries then leaving the registers) */
        int64_t t = 0;
        for (; t + W <= n; t += W) {
            v8 acc[W];
            for (int i = 0; i < W; i++) {
                const float *kt = kp + (t + i) * dim;
                v8 a = qv[0] * load(kt);
                for (int64_t b = 1; b < nv; b++) a += qv[b] * load(kt + b * W);
                acc[i] = a;
            }
            store(s + t, sum8x8(acc));
        }
        for (; t < n; t++) {
            const float *kt = kp + t * dim;
            v8 a = qv[0] * load(kt);
            for (int64_t b = 1; b < nv; b++) a += qv[b] * load(kt + b * W);
            float x = 0.0f;
            for (int i = 0; i < W; i++) x += a[i];
            s[t] = x;
        }
        float m = s[0];
        for (t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (t = 0; t < n; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        /* the values weighted by the probabilities */
        v8 acc[MAX_DIM / W];
        for (int64_t b = 0; b < nv; b++) acc[b] = (v8){0};
        for (t = 0; t < n; t++) {
            const float *vt = vp + t * dim;
            const float p = s[t];
            for (int64_t b = 0; b < nv; b++) acc[b] += p * load(vt + b * W);
        }
        const float inv = 1.0f / sum;
        float *op = os + g * nv * W;
        for (int64_t b = 0; b < nv; b++) store(op + b * W, acc[b] * inv);
    }
}

/* attend_pair with nv a literal for the common head sizes, so the inlined kernel keeps the query
   and the accumulators in registers (a parallel region's body is a function of its own, where a
   variable nv would not be a constant). */
static void attend(const float *qs, const float *kp, const float *vp, int64_t n, float *os, int64_t group, int64_t nv,
                   int64_t capacity, float scale, float *scratch) {
    switch (nv) {
        case 8: /* head_dim 64: SmolLM2, Qwen2.5-0.5B..7B */
            attend_pair(qs, kp, vp, n, os, group, 8, capacity, scale, scratch);
            break;
        case 16: /* head_dim 128: Qwen3, Llama 3 */
            attend_pair(qs, kp, vp, n, os, group, 16, capacity, scale, scratch);
            break;
        default:
            attend_pair(qs, kp, vp, n, os, group, nv, capacity, scale, scratch);
    }
}

/* The rotary embedding of a decode step, its cache writes and its attention, in one pass per
 * (row, key head) pair (what inference/decoder.py did as ~10 small torch kernels per layer):
 *   qk    row r at qk + r * qk_stride: the step's [heads + kv_heads, dim] queries then keys, not
 *         yet rotated (after Qwen3's per-head norm where the model has one)
 *   vnew  row r at vnew + r * v_stride: the step's [kv_heads, dim] values
 *   cos, sin [capacity, dim]: the rotary tables by position (Hugging Face's rotate_half form)
 * Row r's key and value are written at position len[r] of slot r, then its queries attend to
 * positions 0..len[r]. Each pair writes and reads only its own slot's head, so pairs run in any
 * order. The rotation is x * cos + rotate_half(x) * sin as torch computes it, to one rounding
 * (the compiler may fuse a multiply and an add). */
int swarmrl_decode_rope_attention(const float *qk, int64_t qk_stride, const float *vnew, int64_t v_stride,
                                  const float *cos, const float *sin, float *k, float *v, const int64_t *len,
                                  float *out, int64_t rows, int64_t kv_heads, int64_t group, int64_t dim,
                                  int64_t capacity, float scale, int64_t threads) {
    if (group < 1 || group > MAX_GROUP || dim < W || dim > MAX_DIM || dim % W || threads < 1) return 1;
    const int64_t heads = kv_heads * group, half = dim / 2;
    if (qk_stride < (heads + kv_heads) * dim || v_stride < kv_heads * dim) return 1;
    for (int64_t r = 0; r < rows; r++)
        if (len[r] < 0 || len[r] >= capacity) return 2;
    const int64_t nv = dim / W;
    int failed = 0;
#pragma omp parallel num_threads((int)threads)
    {
        float *scratch = malloc(sizeof(float) * group * capacity);
        float qs[MAX_GROUP * MAX_DIM];
        if (!scratch) {
#pragma omp atomic write
            failed = 3;
        }
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < rows * kv_heads; pair++) {
            if (!scratch) continue;
            const int64_t row = pair / kv_heads, head = pair % kv_heads, pos = len[row];
            const float *c = cos + pos * dim, *s = sin + pos * dim, *x = qk + row * qk_stride;
            float *kp = k + pair * capacity * dim, *vp = v + pair * capacity * dim;
            for (int64_t g = 0; g <= group; g++) {
                /* the group's query heads into qs, then the key head into the cache */
                const float *xh = x + (g < group ? head * group + g : heads + head) * dim;
                float *o = g < group ? qs + g * dim : kp + pos * dim;
                for (int64_t i = 0; i < half; i++) {
                    o[i] = xh[i] * c[i] + -xh[i + half] * s[i];
                    o[i + half] = xh[i + half] * c[i + half] + xh[i] * s[i + half];
                }
            }
            memcpy(vp + pos * dim, vnew + row * v_stride + head * dim, sizeof(float) * dim);
            attend(qs, kp, vp, pos + 1, out + pair * group * dim, group, nv, capacity, scale, scratch);
        }
        free(scratch);
    }
    return failed;
}

/* The rotary embedding of a prefill's tokens: x row t at x + t * row_stride holds [heads, dim]
 * (each head contiguous), rotated at position pos[t] by the [*, dim] tables into out [tokens,
 * heads, dim] (contiguous), as swarmrl_decode_rope_attention rotates. */
int swarmrl_rope(const float *x, int64_t row_stride, const int64_t *pos, const float *cos, const float *sin,
                 float *out, int64_t tokens, int64_t heads, int64_t dim, int64_t table, int64_t threads) {
    if (tokens < 0 || heads < 1 || dim < 2 || dim % 2 || row_stride < heads * dim || threads < 1) return 1;
    for (int64_t t = 0; t < tokens; t++)
        if (pos[t] < 0 || pos[t] >= table) return 2;
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + pos[t] * dim, *s = sin + pos[t] * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * row_stride + h * dim;
            float *o = out + (t * heads + h) * dim;
            for (int64_t i = 0; i < half; i++) {
                o[i] = xh[i] * c[i] + -xh[i + half] * s[i];
                o[i + half] = xh[i + half] * c[i + half] + xh[i] * s[i + half];
            }
        }
    }
    return 0;
}

/* Hugging Face's RMSNorm in float32 for rows of n values: x * (1 / sqrt(mean(x^2) + eps)) * w. The
 * sum of squares runs in another order than torch's (float32 rounding). */
int swarmrl_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t n, float eps,
                     int64_t threads) {
    if (rows < 0 || n < 1 || threads < 1) return 1;
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n, ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = (xr[i] * inv) * w[i];
    }
    return 0;
}

/* The gated MLP's activation: gate_up rows of [gate (n), up (n)] -> silu(gate) * up, silu(g) =
 * g / (1 + exp(-g)) as torch computes it (exp is the compiler's vectorised one: last-bit
 * differences). */
int swarmrl_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t n, int64_t threads) {
    if (rows < 0 || n < 1 || threads < 1) return 1;
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            /* exp's argument capped below float's overflow: -ffast-math assumes no infinities,
               and g / inf came out NaN (silu(-200) is -0 to float precision either way) */
            const float e = expf(-g[i] < 88.0f ? -g[i] : 88.0f);
            o[i] = g[i] / (1.0f + e) * u[i];
        }
    }
    return 0;
}

/* The seeded Gumbel-max choice of inference/seeded.py for rows of float32 logits, in one pass:
 * per entry the hash of (key, vocabulary term), the uniform value, the Gumbel noise and the
 * score, with the row's first maximal index kept. The integers are the hash's exactly; the noise
 * comes from this compiler's vectorised logf where torch uses its own, which can differ in the
 * last bit (a relative 1e-7: a choice flips only where two scores tie that closely, and the
 * validator's sampling check has a tolerance far above it). Logits must be finite.
 *   logits [rows, vocab], keys [rows] (the stream keys, < 2**32), term [vocab] (uint32),
 *   out [rows]: the chosen index. temperature > 0 (1 leaves the logits as they are).
 *   lse [rows] or NULL: log(sum(exp(logits / temperature))) of each row, from the same pass, so
 *   the chosen token's logprob needs no log-softmax over the vocabulary (one more 12 MB pass at
 *   64 rows of 49,152). */
static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

#define BLOCK 512

int swarmrl_seeded_argmax(const float *logits, int64_t rows, int64_t vocab, const int64_t *keys,
                          const uint32_t *term, float temperature, int64_t *out, float *lse, int64_t threads) {
    if (rows < 0 || vocab < 1 || !(temperature > 0.0f) || threads < 1) return 1;
    const float u_max = 1.0f - 0x1p-24f, inv_2_24 = 0x1p-24f;
    const int unit = temperature == 1.0f;
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t key = (uint32_t)keys[r];
        const float *x = logits + r * vocab;
        float score[BLOCK], based[BLOCK];
        float best = -INFINITY, run_max = 0.0f, run_sum = 0.0f;
        int64_t best_i = 0;
        for (int64_t v0 = 0; v0 < vocab; v0 += BLOCK) {
            const int64_t m = vocab - v0 < BLOCK ? vocab - v0 : BLOCK;
            float block_max = -INFINITY, base_max = x[v0];
#pragma omp simd reduction(max : block_max, base_max)
            for (int64_t i = 0; i < m; i++) {
                const uint32_t h = fmix32(fmix32(key ^ term[v0 + i]) ^ 0x5BD1E995u) >> 8;
                float u = ((float)h + 0.5f) * inv_2_24;
                u = u < u_max ? u : u_max;
                const float base = unit ? x[v0 + i] : x[v0 + i] / temperature;
                const float s = base + -logf(-logf(u));
                based[i] = base;
                score[i] = s;
                block_max = s > block_max ? s : block_max;
                base_max = base > base_max ? base : base_max;
            }
            if (block_max > best) { /* the first index of the new maximum, in this block */
                for (int64_t i = 0; i < m; i++)
                    if (score[i] == block_max) {
                        best = block_max, best_i = v0 + i;
                        break;
                    }
            }
            if (lse) { /* log-sum-exp of the scaled logits, online: rescaled when the maximum grows */
                if (v0 == 0 || base_max > run_max) {
                    run_sum = v0 == 0 ? 0.0f : run_sum * expf(run_max - base_max);
                    run_max = base_max;
                }
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t i = 0; i < m; i++) acc += expf(based[i] - run_max);
                run_sum += acc;
            }
        }
        if (lse) lse[r] = run_max + logf(run_sum);
        out[r] = best_i;
    }
    return 0;
}
