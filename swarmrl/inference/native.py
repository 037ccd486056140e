"""Small C kernels for the CPU decoder, compiled on the machine that runs them.

Why compile here: the kernels are plain C (`csrc/`), built with `-O3 -march=native` for the CPU
at hand (AVX2 on one machine kind, AVX-512 on another), so a wheel cannot carry them, and torch's
extension builder would compile its headers for a minute. A C compiler builds one of these in
under a second; the library is cached under `~/.cache/swarmrl/native/` (`SWARMRL_NATIVE_CACHE`),
keyed by the source, the flags, the compiler and the CPU, and loaded with ctypes.

The kernel runs on torch's own OpenMP threads: linked against libgomp.so.1, it binds to the copy
torch loaded first. Where the process ends up with two OpenMP runtimes mapped (a torch build whose
runtime has another name), the kernel runs on the calling thread only.

Nothing depends on it: where there is no compiler, the build fails, or `SWARMRL_NATIVE=0`, the
decoder keeps its torch path (the same results to float32 rounding). The library is compiled by
whichever process first needs it (atomically: a temporary name, then a rename), so concurrent
engines share one build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
NATIVE_ENV = "SWARMRL_NATIVE"
CACHE_ENV = "SWARMRL_NATIVE_CACHE"
# -ffast-math lets the compiler vectorise expf (glibc's libmvec) and reorder the sums. It is
# given to the compile step only: linking a shared library with it would add crtfastmath.o on
# GCC < 13, which turns on flush-to-zero for the whole process (torch's arithmetic included).
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=c11"]
# -fopenmp links libgomp.so.1: torch's own copy, already loaded by the time this library is (see
# csrc/decode_attention.c; `_one_openmp` checks it).
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]


def compile_flags() -> list[str]:
    """`COMPILE_FLAGS`, with -march=native replaced by the x86-64-v3 level (AVX2 + FMA, what the
    AMD EPYC kind without AVX-512 has) where torch's kernels are forced to AVX2
    (`ATEN_CPU_CAPABILITY=avx2`): a machine of one kind then runs every kernel of the other's,
    ours included, so that honest work and the validator's limits can be measured across kinds
    on one machine (docs/validation.md)."""
    if os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() == "avx2" and platform.machine() == "x86_64":
        return ["-march=x86-64-v3" if f == "-march=native" else f for f in COMPILE_FLAGS]
    return list(COMPILE_FLAGS)


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and flags (a cache shared by machines of
    different kinds must not hand one of them the other's library)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        fields = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
        return "\n".join(fields)
    except OSError:
        return platform.processor() or platform.machine()


def _build(source: Path, cache: Path) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc or gcc; set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join([source.read_text(), *compile_flags(), *LINK_FLAGS, version, _cpu_id()]).encode()
    ).hexdigest()[:16]
    lib = cache / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        obj, out = Path(tmp) / "k.o", Path(tmp) / "k.so"
        for cmd in (
            [cc, *compile_flags(), "-c", str(source), "-o", str(obj)],
            [cc, str(obj), *LINK_FLAGS, "-o", str(out)],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-400:]}")
        os.replace(out, lib)  # atomic: a concurrent builder either finds it whole or not at all
    return lib


def _one_openmp() -> bool:
    """Whether exactly one OpenMP runtime (libgomp or libiomp) is mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line or "libiomp" in line}
    return len(paths) == 1


@functools.cache
def decode_attention_lib() -> Kernels | None:
    """The loaded kernels, or None where they cannot be built or are turned off."""
    if os.environ.get(NATIVE_ENV, "1").strip() in ("0", "false", "no", "off"):
        return None
    if platform.system() != "Linux":
        return None
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "swarmrl" / "native").expanduser()
    try:
        return load(_build(SOURCE, cache))
    except Exception as exc:  # no compiler, a failed build, a refused subprocess (unit tests)
        log.info("the C decode attention is not available (%s); the decoder uses torch's kernels", exc)
        return None


class Kernels(NamedTuple):
    seeded_argmax: ctypes._CFuncPtr  # swarmrl_seeded_argmax
    rope_attention: ctypes._CFuncPtr  # swarmrl_decode_rope_attention
    rms_norm: ctypes._CFuncPtr  # swarmrl_rms_norm
    silu_mul: ctypes._CFuncPtr  # swarmrl_silu_mul
    rope: ctypes._CFuncPtr  # swarmrl_rope
    threaded: bool  # whether they may use torch's threads (one OpenMP runtime in the process)


def load(library: Path) -> Kernels:
    """The kernels of a built library."""
    lib = ctypes.CDLL(str(library))
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    argmax, rope, rms = lib.swarmrl_seeded_argmax, lib.swarmrl_decode_rope_attention, lib.swarmrl_rms_norm
    silu, rotate = lib.swarmrl_silu_mul, lib.swarmrl_rope
    for fn in (argmax, rope, rms, silu, rotate):
        fn.restype = ctypes.c_int
    argmax.argtypes = [ptr, i64, i64, ptr, ptr, f32, ptr, ptr, i64]
    rope.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, i64]
    rms.argtypes = [ptr, ptr, ptr, i64, i64, f32, i64]
    silu.argtypes = [ptr, ptr, i64, i64, i64]
    rotate.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    threaded = _one_openmp()
    if not threaded:
        log.warning("two OpenMP runtimes are loaded: the C kernels run on one thread")
    return Kernels(argmax, rope, rms, silu, rotate, threaded)


def supported(group: int, dim: int) -> bool:
    """Shapes the kernel takes (see csrc/decode_attention.c)."""
    return 1 <= group <= 16 and dim % 8 == 0 and 8 <= dim <= 256


def _threads(lib: Kernels) -> int:
    return torch.get_num_threads() if lib.threaded else 1


def decode_rope_attention(
    lib: Kernels,
    qk: Tensor,
    v_new: Tensor,
    cos: Tensor,
    sin: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    out: Tensor,
    scale: float,
) -> None:
    """One decode step's rotary embedding, cache writes and attention (csrc/decode_attention.c):
    ``qk`` [B, heads + KV, D] the step's unrotated queries then keys and ``v_new`` [B, KV, D] its
    values (each row contiguous; rows may be strided, e.g. views of one fused q/k/v product),
    ``cos``/``sin`` [capacity, D] the rotary tables; row i's key and value go to position
    lengths[i] of slot i of ``k``/``v`` [slots, KV, capacity, D], then its queries attend to
    positions 0..lengths[i], into ``out`` [B, heads, D] (contiguous). float32; ``lengths`` int64."""
    b, _, dim = qk.shape
    kv = k.shape[1]
    if qk.stride(1) != dim or qk.stride(2) != 1 or v_new.stride(1) != dim or v_new.stride(2) != 1:
        raise ValueError("decode_rope_attention needs each row's heads contiguous")
    code = lib.rope_attention(
        qk.data_ptr(), qk.stride(0), v_new.data_ptr(), v_new.stride(0), cos.data_ptr(), sin.data_ptr(),
        k.data_ptr(), v.data_ptr(), lengths.data_ptr(), out.data_ptr(),
        b, kv, (qk.shape[1] - kv) // kv, dim, k.shape[2], scale, _threads(lib),
    )  # fmt: skip
    if code:
        raise RuntimeError(f"decode rope attention kernel refused its arguments (code {code})")


def rope(lib: Kernels, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` [T, heads, D] (each row's heads contiguous; rows may be strided) rotated at
    ``positions`` [T] (int64) by the rotary tables ``cos``/``sin`` [P, D]: [T, heads, D] contiguous."""
    t, heads, dim = x.shape
    if x.stride(1) != dim or x.stride(2) != 1:
        raise ValueError("rope needs each row's heads contiguous")
    positions = positions.to(torch.int64).contiguous()
    out = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    code = lib.rope(
        x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
        t, heads, dim, cos.shape[0], _threads(lib),
    )  # fmt: skip
    if code:
        raise RuntimeError(f"rope kernel refused its arguments (code {code})")
    return out


def rms_norm(lib: Kernels, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's RMSNorm of contiguous float32 rows ``x`` [B, n] with ``weight`` [n]."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    if lib.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps, _threads(lib)):
        raise RuntimeError("rms_norm kernel refused its arguments")
    return out


def silu_mul(lib: Kernels, gate_up: Tensor) -> Tensor:
    """silu(gate) * up for contiguous float32 rows ``gate_up`` [B, 2n] holding [gate, up]."""
    gate_up = gate_up.contiguous()
    b, n = gate_up.shape[0], gate_up.shape[-1] // 2
    out = torch.empty((b, n), dtype=gate_up.dtype, device=gate_up.device)
    if lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), b, n, _threads(lib)):
        raise RuntimeError("silu_mul kernel refused its arguments")
    return out


def seeded_argmax(
    lib: Kernels, logits: Tensor, keys: Tensor, term: Tensor, temperature: float, *, with_lse: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """`seeded.seeded_choice` for float32 ``logits`` [B, V] (finite), temperature > 0, in one pass
    on torch's threads: ``keys`` [B] int64 are the rows' stream keys, ``term`` [V] uint32 the
    vocabulary term (`seeded.vocab_term_u32`). The same tokens except where two scores tie to
    ~1e-7 (its logf is not torch's; csrc/decode_attention.c). With ``with_lse`` also each row's
    log-sum-exp of logits / temperature [B] (float32, from the same pass), so the chosen token's
    logprob is its scaled logit minus it."""
    b, vocab = logits.shape
    out = torch.empty(b, dtype=torch.int64)
    lse = torch.empty(b, dtype=torch.float32) if with_lse else None
    code = lib.seeded_argmax(
        logits.data_ptr(), b, vocab, keys.data_ptr(), term.data_ptr(), temperature, out.data_ptr(),
        lse.data_ptr() if lse is not None else None, _threads(lib),
    )  # fmt: skip
    if code:
        raise RuntimeError(f"seeded argmax kernel refused its arguments (code {code})")
    return (out, lse) if lse is not None else out
