"""Keep a CPU decoder's freed buffers in the process instead of handing them back to the OS.

A decode step on a CPU allocates the same temporaries every step: a batch of 64 rows of a model
with a 49,152-token vocabulary makes 12.6 MB of logits, as much again of sampling noise, and the
layers' activations. glibc's malloc serves blocks above its mmap threshold (128 KiB to start,
rising with what is freed) with fresh mappings, and returns freed memory at the top of the heap
above its trim threshold to the OS: either way the next step touches new pages, and the kernel
faults and zeroes each 4 KiB page again. SmolLM2-135M, 64 GSM8K prompts x 96 new tokens, one
engine on 2 threads of an Intel Xeon with AMX (2 vCPUs, docs/engines.md): 1.21-1.48 million page faults a
run (about 5 GiB zeroed); with these settings and the prefill's MLP in blocks of tokens
(`SlotDecoder.PREFILL_BLOCK`, whose products were otherwise 80 MB, above any threshold), about
175,000 on a process's first run and 655-8,245 on the next. Tokens/s moved from 191-213 to
198-228, alternating in one sitting on a noisy host (docs/engines.md).

The cost: memory a step freed stays with the process (up to what one step holds at once; it is
reused by the next step rather than grown), so a worker's resident size stays near its peak.
SWARMRL_MALLOC_TUNING=0 leaves malloc's defaults alone.
"""

from __future__ import annotations

import ctypes
import functools
import os

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
#: Blocks below this come from the heap, which keeps them (glibc's largest allowed value on 64-bit:
#: half of HEAP_MAX_SIZE). The largest decode temporaries (logits, noise) are below it.
MMAP_THRESHOLD = 32 * 1024 * 1024
#: Free memory at the top of the heap is returned to the OS only above this.
TRIM_THRESHOLD = 1024 * 1024 * 1024
#: What the heap grows by beyond a request, so growing a step's buffers is rare.
TOP_PAD = 64 * 1024 * 1024


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's malloc to reuse freed memory (see the module); once per process. False where
    it was not done: not glibc (musl, macOS, Windows), or SWARMRL_MALLOC_TUNING=0."""
    if os.environ.get("SWARMRL_MALLOC_TUNING", "1") == "0":
        return False
    try:
        # The process's own symbols (the C library it runs on), with no lookup by name: that
        # would run `ldconfig`.
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (and mallopt's parameters)
        mallopt = libc.mallopt
    except (OSError, TypeError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt answers 1 on success; setting the mmap threshold also stops its dynamic rise.
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    return all(mallopt(param, value) == 1 for param, value in settings)
