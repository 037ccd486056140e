"""The generation engine behind `swarmrl serve`: one thread owns the model and runs every request
on the project's continuous-batching engine (`inference/batch.py`).

Each completion of a request is one engine job. Jobs join the running batch at the next token
step when a slot is free (up to ``max_batch_rows`` at once), so a request arriving while others
generate starts within one step instead of waiting for them to end, and a finished row's slot
goes straight to the next waiting job. Each completion keeps its own token limit, stop strings,
temperature and seed, so batching never changes what a request gets: completion j of a request
with ``seed`` s is sampled with seed s + j, exactly as `swarmrl eval --model` samples it.

Models the built-in decoder cannot run fall back to the generic sampler (`inference/sampler.py`),
which runs the waiting jobs in static batches: same results, no joining mid-batch.

Requests wait in the engine's own queue, one line per client address, and are handed to the
sampler round-robin between addresses only when it has a free row for them: a client that
queued many requests delays another's next one by at most one request of its own, and a request
whose client went away (`GenRequest.cancel`) is dropped there before any of it runs. A cancelled
request already generating stops at the next token step (see `_start`).

Text is the completion's tokens decoded with special tokens kept (``</think>`` decides where
an answer may be), without the final end-of-turn token, and cut before a stop string.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from swarmrl.inference.batch import Job
from swarmrl.inference.engine import build_engine
from swarmrl.model.tokenizer import decode_completion


@dataclass
class Choice:
    """One finished completion of a request."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str  # "stop" (end token or stop string) or "length"


@dataclass
class GenRequest:
    """What one API request asks for; ``n`` completions with seeds ``seeds``."""

    prompt_ids: list[int]
    seeds: list[int]
    max_tokens: int
    temperature: float
    stop: list[str] = field(default_factory=list)
    top_logprobs: int = 0
    # Streaming: called from the engine thread with (choice index, text delta, token index or
    # None) as text becomes final, and (choice index, None, None) when a choice ends.
    on_delta: Callable[[int, str | None, int | None], None] | None = None
    future: Future = field(default_factory=Future)
    # The client address it counts against (`transport.connlimit.source_of`): waiting requests
    # are taken round-robin between addresses.
    client: str = ""
    # Set (from any thread) when the client went away: see `cancel`.
    cancelled: bool = False

    @property
    def n(self) -> int:
        return len(self.seeds)

    def cancel(self) -> None:
        """The client went away: drop the request if it has not started, else stop its completions
        at the next token step. Its future then ends (cancelled, or with the partial choices)."""
        self.cancelled = True
        self.future.cancel()  # succeeds only while it waits; a running request ends in `_start`'s hook


class _Row:
    """Per-completion state while it generates."""

    def __init__(self, request: GenRequest, index: int):
        self.request, self.index = request, index
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters already streamed
        self.decoded = 0  # tokens already in `text`
        self.finish: str | None = None
        self.cut: int | None = None  # text length once a stop string was found
        self.job: Job | None = None


class Engine:
    def __init__(
        self, model, tokenizer, *, max_batch_rows: int = 32, batch_window_s: float = 0.005, kind: str = "builtin"
    ):
        self.tokenizer = tokenizer
        self.stop_token_ids = [tokenizer.eos_token_id]
        self.kind = kind
        self.sampler = build_engine(
            model, tokenizer, kind=kind, stop_token_ids=self.stop_token_ids, max_batch=max_batch_rows
        )
        self.continuous = self.sampler.continuous
        self.max_batch_rows = max_batch_rows
        # Static fallback only: how long a batch waits for more requests before it starts.
        self.batch_window_s = batch_window_s
        self.stats = {
            "requests": 0,
            "steps": 0,
            "max_batch_rows": 0,
            "generated_tokens": 0,
            "continuous_batching": self.continuous,
            # Requests whose client went away: dropped before they ran, and stopped while running
            # (their tokens so far count in generated_tokens).
            "cancelled_waiting": 0,
            "cancelled_running": 0,
        }
        self._queue: queue.Queue[GenRequest | None] = queue.Queue()
        # Requests taken from `_queue` but not started, per client address in round-robin order
        # (engine thread only).
        self._waiting: OrderedDict[str, deque[GenRequest]] = OrderedDict()
        self._thread = threading.Thread(target=self._loop, name="swarmrl-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenRequest) -> Future:
        self._queue.put(request)
        return request.future

    def close(self) -> None:
        """Finish what was submitted, then stop the engine thread."""
        self._queue.put(None)
        self._thread.join(timeout=60)

    # -- the engine thread -----------------------------------------------------------------

    def _loop(self) -> None:
        jobs: list[Job] = []  # submitted to the engine, not finished
        closing = False
        while True:
            # Take every request that has arrived; block only when there is nothing to run.
            while True:
                try:
                    item = self._queue.get(block=not jobs and not self._waiting and not closing)
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    continue
                self._wait(item)
            jobs += self._feed(len(jobs))
            if not self.continuous and jobs:  # static batches: let a few more requests join first
                jobs += self._gather(len(jobs))
            if not jobs:
                if closing and not self._waiting:
                    return
                continue
            try:
                if self.continuous:
                    self.sampler.step()
                    self.stats["steps"] += 1
                    self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], len(self.sampler.active))
                else:
                    self._run_static(jobs)
            except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the server
                self._fail([job.request for job in jobs], exc)
                if self.continuous:  # a fresh engine: nothing half-done stays in its slots
                    self.sampler = build_engine(
                        self.sampler.model,
                        self.tokenizer,
                        kind=self.kind,
                        stop_token_ids=self.stop_token_ids,
                        max_batch=self.max_batch_rows,
                    )
                jobs = []
                continue
            jobs = [job for job in jobs if job.finish_reason is None]

    def _wait(self, request: GenRequest) -> None:
        line = self._waiting.get(request.client)
        if line is None:
            line = self._waiting[request.client] = deque()
        line.append(request)

    def _feed(self, busy: int) -> list[Job]:
        """Start waiting requests while the sampler has rows free (`busy` are taken), one per
        client address in turn. Requests are held here rather than in the sampler's own queue so
        that one whose client left is dropped before it costs a prefill, and so that a newcomer's
        request is next in line rather than behind every request already queued."""
        jobs: list[Job] = []
        while self._waiting and busy + len(jobs) < self.max_batch_rows:
            client, line = next(iter(self._waiting.items()))
            request = line.popleft()
            if line:
                self._waiting.move_to_end(client)  # its next request waits for the others' turns
            else:
                del self._waiting[client]
            jobs += self._start(request)
        return jobs

    def _start(self, request: GenRequest) -> list[Job]:
        """The request's completions as engine jobs (none if its client already went away)."""
        # A request whose client went away (its future cancelled) is dropped; the others are
        # marked running, so a disconnect from now on cannot cancel the future under us: the
        # token hook below ends its rows instead.
        if request.cancelled or not request.future.set_running_or_notify_cancel():
            self.stats["cancelled_waiting"] += 1
            if not request.future.done():  # cancelled between the two checks: end it all the same
                request.future.cancel()
            return []
        self.stats["requests"] += 1
        rows = [_Row(request, j) for j in range(request.n)]
        done: list[_Row] = []
        needs_text = bool(request.stop or request.on_delta)

        def on_token(row: _Row) -> Callable[[int, int], bool]:
            def hook(_t: int, tok: int) -> bool:
                row.ids.append(tok)
                if request.cancelled and row.finish is None:
                    # The client went away. This hook runs between token steps: one step is a
                    # single forward pass over every row in the batch, which cannot be interrupted
                    # for one row without losing the others' work, so a row leaves here, at the
                    # first step boundary after the disconnect (returning True retires it). A
                    # static batch (--engine hf) drops the row the same way, and its other rows
                    # go on.
                    if not any(r.finish == "cancelled" for r in rows):
                        self.stats["cancelled_running"] += 1
                    row.finish = "cancelled"
                    return True
                if tok in self.stop_token_ids:
                    row.finish = "stop"
                elif len(row.ids) >= request.max_tokens:
                    row.finish = "length"
                if needs_text:
                    self._update_text(row)
                if row.finish is not None:
                    self._flush(row, final=True)
                elif request.on_delta is not None:
                    self._flush(row, final=False)
                return row.finish is not None

            return hook

        def on_done(job: Job, row: _Row) -> None:
            row.job = job
            done.append(row)
            if len(done) == len(rows):
                self._finish(request, rows, needs_text)

        jobs = []
        for row in rows:
            job = Job(
                request.prompt_ids,
                request.seeds[row.index],
                request.max_tokens,
                request.temperature,
                request.top_logprobs,
                on_token=on_token(row),
            )
            job.on_done = lambda job, row=row: on_done(job, row)
            jobs.append(job)
            if self.continuous:
                self.sampler.submit(job)
        return jobs

    def _finish(self, request: GenRequest, rows: list[_Row], needs_text: bool) -> None:
        if request.cancelled:  # nobody is waiting for the text: count the tokens, decode nothing
            self.stats["generated_tokens"] += sum(len(row.ids) for row in rows)
            if not request.future.done():
                request.future.set_result([])
            return
        choices = []
        for row in rows:
            n = len(row.ids)
            text = row.text if needs_text else decode_completion(self.tokenizer, row.ids, self.stop_token_ids)
            k = request.top_logprobs
            tops = [entry[:k] for entry in row.job.tops[:n]] if k else None
            choices.append(Choice(row.ids, text, row.job.logprobs[:n], tops, row.finish or row.job.finish_reason))
            self.stats["generated_tokens"] += n
        if not request.future.done():
            request.future.set_result(choices)

    def _fail(self, requests: list[GenRequest], exc: BaseException) -> None:
        for request in {id(r): r for r in requests}.values():
            if not request.future.done():
                request.future.set_exception(exc)
            if request.on_delta is not None:  # let waiting streams end
                for index in range(request.n):
                    request.on_delta(index, None, None)

    # -- static fallback (models the built-in decoder does not run) -------------------------

    def _gather(self, busy: int) -> list[Job]:
        """Static batches: wait up to the batch window for more requests to join."""
        jobs: list[Job] = []
        deadline = time.monotonic() + self.batch_window_s
        while busy + len(jobs) < self.max_batch_rows:
            left = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                return jobs
            if item is None:
                self._queue.put(None)
                return jobs
            self._wait(item)
            jobs += self._feed(busy + len(jobs))
        return jobs

    def _run_static(self, jobs: list[Job]) -> None:
        """Run waiting jobs through the generic sampler, one static batch per temperature."""
        batch = [j for j in jobs if j.temperature == jobs[0].temperature][: self.max_batch_rows]
        self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], len(batch))

        def on_step(t: int, tokens: list[int]) -> list[bool]:
            ended = [False] * len(batch)
            for i, job in enumerate(batch):
                if job.finish_reason is not None:
                    continue
                job.tokens.append(tokens[i])
                if job.on_token(t, tokens[i]):
                    job.finish_reason = "stop"
                    ended[i] = True
            return ended

        outs = self.sampler.generate(
            [j.prompt for j in batch],
            [j.seed for j in batch],
            max_new_tokens=max(j.max_new_tokens for j in batch),
            temperature=batch[0].temperature,
            top_logprobs=max(j.top_logprobs for j in batch),
            on_step=on_step,
        )
        self.stats["steps"] += 1
        for job, out in zip(batch, outs):
            job.logprobs = out.logprobs
            job.tops = out.top_logprobs or []
            job.finish_reason = job.finish_reason or out.finish_reason
            job.on_done(job)

    def _update_text(self, row: _Row) -> None:
        """Extend the row's text with its new token and end it at the first stop string.

        Decoding is incremental (only the tokens not yet in the text), so a long completion
        costs O(length), not O(length^2). Tokens are held back while they decode to an
        incomplete UTF-8 character (a byte-level token can end mid-character).
        """
        if row.cut is not None:
            return
        tail = row.ids[row.decoded :]
        if tail and tail[-1] in self.stop_token_ids:
            tail = tail[:-1]
        piece = self.tokenizer.decode(tail, skip_special_tokens=False)
        if piece.endswith("\ufffd") and row.finish is None:
            return
        before = len(row.text)
        row.text += piece
        row.decoded = len(row.ids)
        for stop in row.request.stop:  # only where the new piece could complete a match
            at = row.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0 and (row.cut is None or at < row.cut):
                row.cut = at
        if row.cut is not None:
            row.text = row.text[: row.cut]
            row.finish = "stop"

    def _flush(self, row: _Row, *, final: bool) -> None:
        """Stream the part of the text that can no longer change (a stop string may still be
        forming at its end, and a byte-level token may end mid-character)."""
        callback = row.request.on_delta
        if callback is None:
            return
        hold = 0 if final else max((len(s) - 1 for s in row.request.stop), default=0)
        text = row.text
        upto = max(row.sent, len(text) - hold)
        if upto > row.sent:
            callback(row.index, text[row.sent : upto], len(row.ids) - 1)
            row.sent = upto
        if final:
            callback(row.index, None, None)
