"""A small process pool with a hard per-call timeout, for running verifiers.

Why not ``multiprocessing.Pool`` or ``concurrent.futures``: neither can stop
a call that is stuck (a sympy simplification that never ends, a regex that
backtracks forever). Here every worker is a long-lived process with its own
pipe; when a call overruns ``timeout_s`` its worker is SIGKILLed and replaced,
and only that call is reported as timed out.

The answers graded here come from strangers, and one answer (a tall power
tower, a huge fraction) can ask sympy for gigabytes. So each worker also runs
under an address-space limit (RLIMIT_AS, ``memory_bytes``) and, for each call,
a CPU-time limit a little above ``timeout_s`` (RLIMIT_CPU: it also stops a
worker whose parent died mid-call, which no one would kill otherwise). A call
that hits either limit ends as an error Outcome (a score of 0 for the row) and
its worker is replaced; the other calls and the pool go on.

Workers are started with the ``spawn`` method so the pool is safe to create
from a parent that has imported torch (forking a process with live torch
threads can deadlock), or forked from a fork server (``forkserver``, also
safe) that imported ``preload`` once: a worker replaced after a timeout is
then ready in ~0.1 s instead of seconds. As with any spawn-based pool, a
script that creates one must guard its entry point with
``if __name__ == "__main__":``.

The pool is not thread-safe: call ``map`` from one thread at a time.
"""

from __future__ import annotations

import collections
import importlib
import math
import multiprocessing
import pickle
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

# Modules every worker imports before it reports ready, so their import cost
# is paid once at startup rather than inside the first call's time budget.
DEFAULT_PRELOAD = ("swarmrl.rewards.math",)

_STARTING, _IDLE, _BUSY, _DEAD = "starting", "idle", "busy", "dead"

# Address space of one worker: math_verify and sympy need ~100 MB; an answer needing more than
# this is not one a grader should compute.
DEFAULT_MEMORY_BYTES = 1 << 30
# Seconds of CPU a call may use beyond its timeout before the kernel stops it (SIGXCPU).
CPU_MARGIN_S = 1


_SENDABLE: dict[Any, bool] = {}


def sendable(fn: Callable) -> bool:
    """Whether `fn` pickles by reference (a module-level function), so `VerifierPool.map` can run it
    in a worker; a closure or a lambda cannot be sent and must run in the caller's process."""
    if fn not in _SENDABLE:
        try:
            pickle.dumps(fn)
            _SENDABLE[fn] = True
        except Exception:  # noqa: BLE001 - any pickling failure means the same: not sendable
            _SENDABLE[fn] = False
    return _SENDABLE[fn]


@dataclass(frozen=True)
class Outcome:
    """Result of one call: ``value`` when it succeeded, otherwise ``error``.

    ``seconds`` is the wall time from dispatch to result, as seen by the
    parent (so it includes pickling and pipe transfer).
    """

    value: Any | None
    error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None


def _describe(exc: BaseException) -> str:
    """``"Type: message"``: enough to act on, without leaking a traceback."""
    return f"{type(exc).__name__}: {exc}"


def _set_soft_limit(which: int, soft: int) -> None:
    """Lower (or move) a soft limit, never above the hard limit someone set for us."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(which, (soft, hard))


def _cpu_seconds_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _worker_main(
    conn: Connection, preload: Sequence[str], memory_bytes: int | None = None, cpu_s: int | None = None
) -> None:
    """Worker loop: receive ``(fn, args)``, send back ``("ok", value)`` or ``("error", text)``.

    The call is unpickled inside the try block so that a function the worker
    cannot import is reported as that call's error instead of killing the
    worker. SIGINT is ignored: the parent decides when workers stop. The
    memory limit is set before the preload, so a limit too small for it fails
    at startup rather than in every call.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _set_soft_limit(resource.RLIMIT_CORE, 0)  # a worker killed at a limit must not write gigabytes of core
        if memory_bytes is not None:
            _set_soft_limit(resource.RLIMIT_AS, memory_bytes)
        for name in preload:
            importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - report any startup failure to the parent
        conn.send(("startup_error", _describe(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the parent is gone
        try:
            message = pickle.loads(payload)
            if message is None:
                return
            fn, args = message
            if cpu_s is not None:
                # RLIMIT_CPU counts the process's whole life, so each call's budget starts from now.
                _set_soft_limit(resource.RLIMIT_CPU, math.ceil(_cpu_seconds_used()) + cpu_s)
            reply = ("ok", fn(*args))
        except MemoryError:
            # The heap may be left fragmented or half-built: report, and let the parent replace us.
            limit = f" of {memory_bytes >> 20} MiB" if memory_bytes is not None else ""
            try:
                conn.send(
                    ("error_restart", f"out of memory: the call needed more than the grading process's limit{limit}")
                )
            except Exception:  # noqa: BLE001 - the parent sees the death instead
                pass
            return
        except Exception as exc:  # noqa: BLE001 - any failure of the call is its result
            reply = ("error", _describe(exc))
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send(("error", f"the result could not be sent back: {_describe(exc)}"))


@dataclass(eq=False)
class _Worker:
    """Parent-side bookkeeping for one worker process."""

    process: multiprocessing.process.BaseProcess
    conn: Connection
    state: str
    deadline: float
    call_index: int = -1
    dispatched_at: float = 0.0


class VerifierPool:
    """``num_workers`` long-lived processes that run picklable functions with a hard timeout.

    Use as a context manager, or call :meth:`close`. Startup waits until every
    worker has imported ``preload`` and is ready, and raises RuntimeError if
    one cannot start within ``start_timeout_s``. ``memory_bytes`` is each
    worker's address-space limit (None: none); each call may use ``timeout_s``
    rounded up plus ``CPU_MARGIN_S`` seconds of CPU (``limit_cpu=False``: no limit).
    """

    def __init__(
        self,
        num_workers: int = 1,
        timeout_s: float = 5.0,
        *,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        start_timeout_s: float = 60.0,
        start_method: str = "spawn",
        memory_bytes: int | None = DEFAULT_MEMORY_BYTES,
        limit_cpu: bool = True,
    ) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"start_method must be 'spawn' or 'forkserver', got {start_method!r}; "
                "'fork' is unsafe once torch has started threads"
            )
        if memory_bytes is not None and (
            isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < (64 << 20)
        ):
            raise ValueError(
                f"memory_bytes must be None (no limit) or an int of at least 64 MiB (the "
                f"interpreter alone needs that much), got {memory_bytes!r}"
            )
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.memory_bytes = memory_bytes
        self.cpu_s = math.ceil(self.timeout_s) + CPU_MARGIN_S if limit_cpu else None
        self._preload = tuple(preload)
        self._start_timeout_s = float(start_timeout_s)
        self._context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # The fork server imports the grader once and every worker is forked from it, so a
            # worker replaced after a timeout is ready in ~0.05 s instead of re-importing sympy
            # for seconds (docs/security.md, "Grading"). A child also runs its parent's main
            # module again (multiprocessing does, to unpickle what it defines): preloaded too when
            # the parent was started with -m, or that costs ~0.5 s of imports per restart. The
            # server is shared by the process: one already running keeps the modules it has, and
            # workers import the rest themselves.
            main = getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", None)
            extra = [main] if main and not main.endswith("__main__") and main not in self._preload else []
            self._context.set_forkserver_preload([*self._preload, *extra])  # type: ignore[attr-defined]
        self._closed = False
        self._workers: list[_Worker] = []
        started = time.monotonic()
        try:
            for slot in range(num_workers):
                self._workers.append(self._start_worker(slot))
            while any(worker.state == _STARTING for worker in self._workers):
                self._wait_and_collect([])
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.monotonic() - started

    # -- lifecycle -----------------------------------------------------------

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop all workers: idle ones are asked to exit, busy or stuck ones are killed."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            if worker.state == _IDLE:
                try:
                    worker.conn.send(None)
                except (OSError, ValueError):
                    pass
        grace_deadline = time.monotonic() + 2.0
        for worker in self._workers:
            if worker.state == _IDLE:
                worker.process.join(max(0.0, grace_deadline - time.monotonic()))
            self._kill(worker)

    def _start_worker(self, slot: int) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_main,
            args=(child_conn, self._preload, self.memory_bytes, self.cpu_s),
            name=f"swarmrl-verifier-{slot}",
            daemon=True,
        )
        process.start()
        child_conn.close()
        return _Worker(
            process=process,
            conn=parent_conn,
            state=_STARTING,
            deadline=time.monotonic() + self._start_timeout_s,
        )

    @staticmethod
    def _kill(worker: _Worker) -> None:
        """SIGKILL the worker (a no-op if it already exited) and release its resources."""
        if worker.process.exitcode is None:
            worker.process.kill()
            worker.process.join(5.0)
        worker.conn.close()
        worker.state = _DEAD

    def _replace(self, worker: _Worker) -> None:
        self._kill(worker)
        slot = self._workers.index(worker)
        self._workers[slot] = self._start_worker(slot)

    # -- running calls -------------------------------------------------------

    def map(self, fn: Callable[..., Any], calls: Sequence[tuple]) -> list[Outcome]:
        """Run ``fn(*args)`` for each tuple in ``calls``; one Outcome per call, in order.

        A call that raises gets ``error="Type: message"``; one that overruns
        ``timeout_s`` gets ``error="timed out after X s"`` and its worker is
        replaced; one whose worker dies gets an error with the exit code.
        ``fn`` must be picklable by reference (a module-level function).
        A worker replaced during the map has started again when it returns, so the
        restart is paid by the calls that caused it, not by the next caller's.
        """
        if self._closed:
            raise RuntimeError("this VerifierPool is closed; create a new one")
        calls = list(calls)
        for index, args in enumerate(calls):
            if not isinstance(args, tuple):
                raise TypeError(
                    f"map expects a list of argument tuples such as [(x,), (y,)]; "
                    f"item {index} is a {type(args).__name__}"
                )
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = collections.deque(range(len(calls)))
        try:
            while pending or any(worker.state in (_BUSY, _STARTING) for worker in self._workers):
                self._dispatch(fn, calls, pending, outcomes)
                self._wait_and_collect(outcomes)
        except BaseException:
            # Never leave a call running behind our back: its late reply would
            # be taken as the result of the next map's call.
            for worker in list(self._workers):
                if worker.state == _BUSY:
                    self._replace(worker)
            raise
        return outcomes  # type: ignore[return-value]

    def _dispatch(
        self,
        fn: Callable[..., Any],
        calls: list[tuple],
        pending: collections.deque[int],
        outcomes: list[Outcome | None],
    ) -> None:
        """Hand pending calls to idle workers."""
        for worker in list(self._workers):
            if not pending:
                return
            if worker.state != _IDLE:
                continue
            if not worker.process.is_alive():
                self._replace(worker)
                continue
            index = pending.popleft()
            try:
                worker.conn.send((fn, calls[index]))
            except OSError:
                # The worker died while idle: retry the call on its replacement.
                pending.appendleft(index)
                self._replace(worker)
                continue
            except Exception as exc:  # noqa: BLE001 - pickling fails before anything is written
                error = f"the call could not be sent to a worker: {_describe(exc)}"
                outcomes[index] = Outcome(None, error, 0.0)
                continue
            now = time.monotonic()
            worker.state = _BUSY
            worker.call_index = index
            worker.dispatched_at = now
            worker.deadline = now + self.timeout_s

    def _wait_and_collect(self, outcomes: list[Outcome | None]) -> None:
        """Block until a worker replies or the nearest deadline passes, then handle both."""
        active = [worker for worker in self._workers if worker.state in (_STARTING, _BUSY)]
        if not active:
            return
        nearest = min(worker.deadline for worker in active)
        handles = [worker.conn for worker in active] + [worker.process.sentinel for worker in active]
        ready = set(wait(handles, timeout=max(0.0, nearest - time.monotonic())))
        for worker in active:
            if worker.conn in ready or worker.process.sentinel in ready:
                self._collect(worker, outcomes)
        now = time.monotonic()
        for worker in active:
            if worker.state in (_STARTING, _BUSY) and now >= worker.deadline:
                self._expire(worker, outcomes)

    def _collect(self, worker: _Worker, outcomes: list[Outcome | None]) -> None:
        """Read a worker's reply, or notice that it died."""
        message = None
        if worker.conn.poll():
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                message = None
        if message is None:
            if worker.process.is_alive():
                return  # woken without a complete reply; keep waiting
            self._on_death(worker, outcomes)
            return
        kind, payload = message
        if worker.state == _STARTING:
            if kind != "ready":
                self._kill(worker)
                hint = ""
                if self.memory_bytes is not None and str(payload).startswith("MemoryError"):
                    hint = f" (under the {self.memory_bytes >> 20} MiB memory limit: raise memory_bytes)"
                raise RuntimeError(
                    f"a verifier worker failed to start: {payload}{hint}; "
                    f"check that the preload modules {self._preload} import cleanly"
                )
            worker.state = _IDLE
            return
        elapsed = time.monotonic() - worker.dispatched_at
        if kind == "ok":
            outcomes[worker.call_index] = Outcome(payload, None, elapsed)
        else:
            outcomes[worker.call_index] = Outcome(None, payload, elapsed)
        worker.state = _IDLE
        if kind == "error_restart":
            self._replace(worker)

    def _on_death(self, worker: _Worker, outcomes: list[Outcome | None]) -> None:
        worker.process.join(5.0)
        code = worker.process.exitcode
        if worker.state == _STARTING:
            self._kill(worker)
            raise RuntimeError(
                f"a verifier worker exited during startup (exit code {code}); "
                f"check that the preload modules {self._preload} import cleanly"
            )
        elapsed = time.monotonic() - worker.dispatched_at
        if code == -signal.SIGXCPU:
            error = f"used more than its {self.cpu_s} s of CPU time and was stopped"
        else:
            error = f"the worker died unexpectedly (exit code {code}) while running this call"
            if code == -signal.SIGKILL and self.memory_bytes is not None:
                error += " (killed: out of memory?)"
        outcomes[worker.call_index] = Outcome(None, error, elapsed)
        self._replace(worker)

    def _expire(self, worker: _Worker, outcomes: list[Outcome | None]) -> None:
        if worker.state == _STARTING:
            self._kill(worker)
            raise RuntimeError(
                f"a verifier worker did not start within {self._start_timeout_s:g} s; "
                "the machine may be overloaded, or raise start_timeout_s"
            )
        elapsed = time.monotonic() - worker.dispatched_at
        outcomes[worker.call_index] = Outcome(None, f"timed out after {self.timeout_s:g} s", elapsed)
        self._replace(worker)
