"""One small thread pool per process for the CPU engine's work outside torch (the seeded hash in
numpy, the C decode attention): both release the GIL, so their parts run on torch's other cores."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)
_LOCK = threading.Lock()


def worker_pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of at least ``workers`` threads (grown, never shrunk). A forked child
    gets a pool of its own: the parent's threads do not exist there, and work handed to their
    queue would wait forever."""
    global _POOL
    with _LOCK:
        if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] < workers:
            _POOL = (os.getpid(), workers, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="swarmrl-cpu"))
        return _POOL[2]
