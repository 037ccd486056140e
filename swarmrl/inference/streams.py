"""Several decoding streams on a multi-core CPU: one built-in engine per core, each in its own process.

At the sizes a CPU worker decodes (a ~1M-parameter model, batches of 64), a decode step is
~150 small kernels, their dispatch and the Python between them, not arithmetic: splitting each
kernel over two cores (torch's intra-op threads) shortens a step by ~10%, because the cores wait
on each other at every kernel and the Python runs on one of them. Independent streams, each a
`BatchEngine` over its own share of the rows with one intra-op thread, keep every core busy with
whole steps. They must be processes: streams in threads of one process measured no faster than
one engine on two threads (the GIL serialises the Python between ops; docs/benchmarks.md).

Nothing the validator relies on changes: a job's tokens do not depend on which other jobs share
its steps (`inference/batch.py`), so which stream a row runs in is invisible; rows of one prompt
(a GRPO group) stay in one stream, so its prefill is still shared.

The model is handed to the streams through shared memory (torch.multiprocessing moves the
parameters' storage there, without copying; the caller's model keeps working on it). A stream
sees the weights it was given: after changing them in place, assign `engine.model` again. CPU
only: on a GPU one engine fills the device. Each stream is a process with its own torch (RSS
figures in docs/engines.md); as with any spawned process, a script that builds streams keeps its
work under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import os
import queue
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.multiprocessing as mp

from swarmrl.inference.batch import BatchEngine
from swarmrl.inference.sampler import Completion, check_rows

#: Exception types a stream's error is raised as in the caller (anything else: RuntimeError).
_ERRORS = {e.__name__: e for e in (ValueError, TypeError, RuntimeError, MemoryError)}


def default_streams(device: str, threads: int | None = None) -> int:
    """Streams when the user names none: one per CPU this process may run on, for a CPU model
    whose torch threads the user did not choose either (their choice means one engine on that
    many threads). 1 anywhere else (a GPU, or threads given)."""
    if not device.startswith("cpu") or threads is not None:
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def shard_rows(prompts: list[list[int]], streams: int) -> list[list[int]]:
    """Row indices per stream: rows with the same prompt together (their prefill is shared),
    distinct prompts dealt to the stream with the fewest rows so far (ties: the lowest index).
    Deterministic, so the same call always runs the same rows side by side."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    shards: list[list[int]] = [[] for _ in range(streams)]
    for rows in groups.values():
        min(shards, key=len).extend(rows)
    return shards


def _stream_main(inbox, outbox, parent: int, core: int | None = None) -> None:
    """One stream: a BatchEngine on one thread, fed by `inbox` until told to stop (None) or
    orphaned (its parent gone: a killed worker leaves no decoding processes behind). ``core``:
    the CPU this process keeps to (`StreamedEngine`'s pin_cores)."""
    torch.set_num_threads(1)
    if core is not None:
        try:
            os.sched_setaffinity(0, {core})
        except OSError:  # a core taken away since (a cgroup change): run wherever the OS says
            pass
    engine = None
    while True:
        try:
            msg = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if msg is None:
            return
        kind, payload = msg
        try:
            if kind == "model":
                model, kw = payload
                engine = BatchEngine(model.eval(), **kw)
                outbox.put(("ok", None, None))
            else:
                prompts, seeds, kw = payload
                before = dict(engine.stats)
                outs = engine.generate(prompts, seeds, **kw)
                outbox.put(("ok", outs, {k: v - before.get(k, 0) for k, v in engine.stats.items()}))
        except Exception as e:  # reported to the caller, who raises it; the stream lives on
            outbox.put(("error", type(e).__name__, str(e)))


def stream_cores(streams: int) -> list[int | None]:
    """A core of this process's CPU set for each stream, distinct, or None for all where the set
    has fewer cores than streams (the OS then places them).

    Why pin: a stream is one thread that touches its share of the weights every step. Left to
    the scheduler, two streams on two cores migrate and collide; pinned, each keeps its core and
    its caches. SmolLM2-135M, 64 GSM8K prompts x 96 tokens, 2 streams on 2 Zen 4 vCPUs: 181 and
    191 tokens/s free, 207 and 208 pinned (docs/engines.md)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < streams:
        return [None] * streams
    return cores[:streams]


def _stop(procs, inboxes) -> None:
    for box in inboxes:
        try:
            box.put(None)
        except (OSError, ValueError):
            pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()


class StreamedEngine:
    """The "builtin" engine run as ``streams`` single-threaded processes (see the module
    docstring). The same protocol as `BatchEngine.generate` (`inference/engine.py`)."""

    provides_hidden = True
    seeded = True
    continuous = True

    def __init__(
        self,
        model,
        *,
        stop_token_ids: list[int],
        pad_token_id: int,
        streams: int = 2,
        max_batch: int = 64,
        capacity: int | None = None,
        start_timeout_s: float = 120.0,
        pin_cores: bool = True,
    ):
        if streams < 2:
            raise ValueError(f"streams must be at least 2 (use BatchEngine for one), got {streams}")
        if not stop_token_ids:
            raise ValueError("the engine needs at least one stop token id (the tokenizer's eos)")
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("decoding streams are for CPUs; on a GPU use one engine (streams = 1)")
        self.stop_token_ids = list(stop_token_ids)
        self.pad_token_id = pad_token_id
        self.timeout_s = start_timeout_s
        self._kw = dict(
            stop_token_ids=self.stop_token_ids,
            pad_token_id=pad_token_id,
            max_batch=max(1, -(-max_batch // streams)),
            capacity=capacity,
        )
        # spawn, not fork: a forked child of a process whose OpenMP pool has started can hang.
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(streams)]
        self._outboxes = [ctx.Queue() for _ in range(streams)]
        self.cores = stream_cores(streams) if pin_cores else [None] * streams
        self._procs = [
            ctx.Process(target=_stream_main, args=(i, o, os.getpid(), core), name=f"swarmrl-stream-{k}", daemon=True)
            for k, (i, o, core) in enumerate(zip(self._inboxes, self._outboxes, self.cores))
        ]
        for p in self._procs:
            p.start()
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._inboxes)
        self.stats: dict[str, int] = {}
        self._model = None
        try:
            self.model = model
        except RuntimeError as e:
            self.close()
            raise RuntimeError(
                f"{e}. A stream could not start: a process that builds streams re-runs its main "
                "script in each stream (Python's spawn), so the script must keep its work under "
                "`if __name__ == '__main__':` and cannot come from stdin"
            ) from None

    @property
    def model(self):
        return self._model

    @model.setter
    def model(self, model) -> None:
        """Hand a policy to every stream (the next calls run on it)."""
        for box in self._inboxes:
            box.put(("model", (model, self._kw)))
        self._collect(range(len(self._procs)), self.timeout_s)
        self._model = model

    def close(self) -> None:
        """Stop the stream processes (also done when the engine is garbage-collected)."""
        self._finalizer()

    def _collect(self, streams, timeout_s: float | None = None) -> list:
        """Each stream's reply, in order; a stream's error is raised here, after every stream
        has answered (so none is left with a reply the next call would read)."""
        replies, error = [], None
        for k in streams:
            while True:
                try:
                    reply = self._outboxes[k].get(timeout=1.0)
                    break
                except queue.Empty:
                    if not self._procs[k].is_alive():
                        raise RuntimeError(
                            f"decoding stream {k} died (exit code {self._procs[k].exitcode}); build a new engine"
                        ) from None
                    if timeout_s is not None:
                        timeout_s -= 1.0
                        if timeout_s <= 0:
                            raise RuntimeError(f"decoding stream {k} did not answer in time") from None
            if reply[0] == "error":
                error = error or _ERRORS.get(reply[1], RuntimeError)(reply[2])
            replies.append(reply)
        if error is not None:
            raise error
        return replies

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        return_hidden: bool = False,
        top_logprobs: int = 0,
        on_step: Callable[[int, list[int]], Sequence[bool] | None] | None = None,
    ) -> list[Completion]:
        if on_step is not None:
            raise TypeError("StreamedEngine has no batch-wide on_step hook; use BatchEngine's Job.on_token")
        if not check_rows(prompts, seeds):
            return []
        if not self._finalizer.alive:
            raise RuntimeError("this engine is closed; build a new one")
        kw = dict(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            return_hidden=return_hidden,
            top_logprobs=top_logprobs,
        )
        shards = shard_rows(prompts, len(self._procs))
        busy = [k for k, rows in enumerate(shards) if rows]
        for k in busy:
            rows = shards[k]
            self._inboxes[k].put(("generate", ([prompts[i] for i in rows], [seeds[i] for i in rows], kw)))
        results: list[Completion | None] = [None] * len(prompts)
        for k, (_, outs, stats) in zip(busy, self._collect(busy)):
            for i, out in zip(shards[k], outs):
                results[i] = out
            for name, v in stats.items():
                self.stats[name] = self.stats.get(name, 0) + v
        return results  # type: ignore[return-value]
