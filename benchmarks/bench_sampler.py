"""Throughput of the rollout engines against Hugging Face `model.generate`, side by side.

    python benchmarks/bench_sampler.py                          # CPU, 2 threads, default model
    python benchmarks/bench_sampler.py --model 30m --batch-sizes 64
    python benchmarks/bench_sampler.py --group 8                # GRPO groups: 8 rows per prompt
    python benchmarks/bench_sampler.py --device cuda --out bench.json

Three sides, one process, the same model object and prompts, interleaved runs:
- HF: `model.generate` (do_sample=True, top_k=0, top_p=1.0: full-vocabulary sampling).
- generic: the project's "hf" engine (`inference/sampler.py`, the engine before issue 16): the
  model's own forward with a growing `DynamicCache`, static batches.
- builtin: the project's "builtin" engine (`inference/batch.py`): pre-allocated per-slot KV
  cache, fused projections, one prefill per distinct prompt, continuous batching.
- streams (CPU, --streams S > 1; S = --threads by default): the same engine as S independent
  streams, each over its share of the rows on one intra-op thread (`inference/streams.py`),
  where the other sides split each kernel over the --threads cores.

How the comparison is kept fair:
- Exactly the same number of new tokens per row on every side, checked after every run: HF gets
  min_new_tokens = max_new_tokens = N; ours get a stop id no model can emit (`vocab_size`).
- Ours do extra work HF does not: the seeded Gumbel noise (a hash over the vocabulary) and the
  logprob of every token. Hidden states are not returned.
- `--group G` repeats each prompt G times (a GRPO group, what a worker generates); HF and the
  generic engine prefill every copy, the built-in engine once per distinct prompt. G = 1 (the
  default) gives distinct prompts, where sharing cannot help.
- One untimed warm-up call per side, then the median of --runs timed calls. On CUDA the timer
  brackets torch.cuda.synchronize().
tok/s counts new tokens only: batch * N / seconds. "matmul share" is the builtin side's useful
FLOPs (2 x non-embedding parameters per token, plus attention and the output layer) against a
large float32 matmul's rate measured in the same process: how close to the machine's limit it is.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmrl.inference.batch import BatchEngine  # noqa: E402
from swarmrl.inference.sampler import Sampler  # noqa: E402
from swarmrl.inference.streams import StreamedEngine  # noqa: E402
from swarmrl.model.checkpoint import build_tiny_policy  # noqa: E402

MODELS = {
    "default": {},  # the project's ~1M-parameter tiny Qwen2
    "30m": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=2048),
}


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int, group: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    distinct = max(1, batch // group)
    lengths = torch.randint(max(1, prompt_len - 4), prompt_len + 5, (distinct,), generator=g)
    base = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lengths]
    return [base[i // group] for i in range(batch)]


def matmul_gflops(device: torch.device, size: int = 1024, reps: int = 20) -> float:
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * size**3 * reps / (time.perf_counter() - t0) / 1e9


def flops_per_token(model, context: float) -> float:
    """Forward FLOPs of one decoded token: 2 per weight (embedding lookup excluded, the output
    layer included) plus attention over ``context`` cached positions."""
    cfg = model.config
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if cfg.tie_word_embeddings:
        weights += cfg.vocab_size * cfg.hidden_size
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * context
    return 2 * weights + attention


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, object]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (CPU)")
    ap.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="default",
        help="default: the ~1M tiny Qwen2; 30m: a 512-wide, 8-layer Qwen2 (~31.6M)",
    )
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--group", type=int, default=1, help="rows per distinct prompt (8: a GRPO group)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument(
        "--streams",
        type=int,
        default=None,
        help="decoding streams of the 'streams' side (default: --threads on a CPU, none on CUDA; 1: no such side)",
    )
    ap.add_argument("--runs", type=int, default=3, help="timed runs per point (median reported)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.temperature <= 0:
        ap.error("--temperature must be > 0 (HF do_sample needs a positive temperature)")
    if args.group < 1:
        ap.error("--group must be at least 1")

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    streams = args.streams if args.streams is not None else (args.threads if device.type == "cpu" else 1)
    model, tok = build_tiny_policy(**MODELS[args.model])
    model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    N = args.new_tokens

    # No id >= vocab_size can be sampled, so this stop id forces exactly N tokens per row.
    engines = {
        "generic": Sampler(model, stop_token_ids=[vocab], pad_token_id=tok.pad_token_id),
        "builtin": BatchEngine(
            model, stop_token_ids=[vocab], pad_token_id=tok.pad_token_id, max_batch=max(args.batch_sizes)
        ),
    }
    if streams > 1:
        engines["streams"] = StreamedEngine(
            model,
            stop_token_ids=[vocab],
            pad_token_id=tok.pad_token_id,
            streams=streams,
            max_batch=max(args.batch_sizes),
        )

    def run_engine(name, prompts, call):
        seeds = [call * 1_000_003 + i for i in range(len(prompts))]
        out = engines[name].generate(prompts, seeds, max_new_tokens=N, temperature=args.temperature)
        assert all(len(c.token_ids) == N and c.finish_reason == "length" for c in out)
        return out

    def run_hf(ids, mask, call):
        torch.manual_seed(call)
        with torch.inference_mode():
            seq = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=args.temperature,
                top_k=0,
                top_p=1.0,
                min_new_tokens=N,
                max_new_tokens=N,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        assert seq.shape[1] - ids.shape[1] == N
        assert not (seq[:, ids.shape[1] :] == tok.eos_token_id).any()
        return seq

    peak = matmul_gflops(device)
    rows = []
    print(
        f"model: Qwen2 '{args.model}', {n_params / 1e6:.2f}M params, {args.dtype}, vocab {vocab}; device {device}; "
        f"threads {torch.get_num_threads()}; {N} new tokens; prompts ~{args.prompt_len} tokens, {args.group} rows "
        f"per prompt; T={args.temperature}; median of {args.runs} after a warm-up; float32 matmul "
        f"{peak:.0f} GFLOP/s",
        flush=True,
    )
    for B in args.batch_sizes:
        prompts = make_prompts(B, args.prompt_len, vocab, seed=B, group=args.group)
        ids, mask = left_pad(prompts, tok.pad_token_id, device)
        sides = {
            "hf": partial(run_hf, ids, mask),
            "generic": partial(run_engine, "generic", prompts),
            "builtin": partial(run_engine, "builtin", prompts),
        }
        if "streams" in engines:
            sides["streams"] = partial(run_engine, "streams", prompts)
        for run in sides.values():  # warm-up
            run(0)
        times = {name: [] for name in sides}
        for r in range(1, args.runs + 1):  # interleave so drift hits every side alike
            for name, run in sides.items():
                times[name].append(timed(partial(run, r), device)[0])
        med = {name: statistics.median(t) for name, t in times.items()}
        context = args.prompt_len + N / 2
        useful = B * N * flops_per_token(model, context) / med["builtin"] / 1e9
        row = {
            "batch": B,
            **{f"{name}_tok_s": B * N / m for name, m in med.items()},
            "builtin_vs_hf": med["hf"] / med["builtin"],
            "builtin_vs_generic": med["generic"] / med["builtin"],
            "generic_vs_hf": med["hf"] / med["generic"],
            "builtin_gflops": useful,
            "matmul_share": useful / peak,
            "seconds": times,
        }
        if "streams" in med:
            row["streams_vs_hf"] = med["hf"] / med["streams"]
            row["streams_matmul_share"] = useful * med["builtin"] / med["streams"] / peak
        rows.append(row)
        print(
            f"  batch {B}: HF {row['hf_tok_s']:.0f}, generic {row['generic_tok_s']:.0f}, "
            f"builtin {row['builtin_tok_s']:.0f}"
            + (f", streams x{streams} {row['streams_tok_s']:.0f}" if "streams" in med else "")
            + " tok/s",
            flush=True,
        )

    print()
    print(
        f"{'batch':>5} | {'HF tok/s':>9} | {'generic':>9} | {'builtin':>9} | {'builtin/HF':>10} | "
        f"{'builtin/generic':>15} | {'matmul share':>12}"
    )
    print("-" * 88)
    for row in rows:
        print(
            f"{row['batch']:>5} | {row['hf_tok_s']:>9.0f} | {row['generic_tok_s']:>9.0f} | {row['builtin_tok_s']:>9.0f} | "  # noqa: E501
            f"{row['builtin_vs_hf']:>10.2f} | {row['builtin_vs_generic']:>15.2f} | {row['matmul_share']:>11.1%}"
        )
    if streams > 1:
        print(f"\n{'batch':>5} | streams x{streams} tok/s | streams/HF | streams/builtin | matmul share")
        for row in rows:
            print(
                f"{row['batch']:>5} | {row['streams_tok_s']:>17.0f} | {row['streams_vs_hf']:>10.2f} | "
                f"{row['streams_tok_s'] / row['builtin_tok_s']:>15.2f} | {row['streams_matmul_share']:>11.1%}"
            )

    if args.out:
        import transformers

        report = {
            "config": {
                "device": str(device),
                "threads": torch.get_num_threads(),
                "streams": streams,
                "new_tokens": N,
                "prompt_len": args.prompt_len,
                "group": args.group,
                "temperature": args.temperature,
                "runs": args.runs,
                "model": args.model,
                "dtype": args.dtype,
                "model_params": n_params,
                "vocab_size": vocab,
                "matmul_gflops": peak,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
                "machine": platform.machine(),
                "cpu": platform.processor() or platform.machine(),
            },
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
