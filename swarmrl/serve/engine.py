"""The generation engine behind `swarmrl serve`: one thread owns the model and batches requests.

Requests arriving within ``batch_window_s`` of each other (and sharing a temperature, which the
sampler applies per batch) run as one batch of the project's seeded sampler, up to
``max_batch_rows`` completions. This is static batching: a request that arrives while a batch
is generating waits for the next one. Each completion keeps its own token limit, stop strings
and seed, so batching never changes what a request gets: completion j of a request with
``seed`` s is sampled with seed s + j, exactly as `swarmrl eval --model` samples it.

Text is the completion's tokens decoded with special tokens kept (``</think>`` decides where
an answer may be), without the final end-of-turn token, and cut before a stop string.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

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

    @property
    def n(self) -> int:
        return len(self.seeds)


class _Row:
    """Per-completion state while its batch generates."""

    def __init__(self, request: GenRequest, index: int):
        self.request, self.index = request, index
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters already streamed
        self.decoded = 0  # tokens already in `text`
        self.finish: str | None = None
        self.cut: int | None = None  # text length once a stop string was found


class Engine:
    def __init__(self, model, tokenizer, *, max_batch_rows: int = 32, batch_window_s: float = 0.005):
        self.tokenizer = tokenizer
        self.stop_token_ids = [tokenizer.eos_token_id]
        self.sampler = build_engine(model, tokenizer, stop_token_ids=self.stop_token_ids)
        self.max_batch_rows = max_batch_rows
        self.batch_window_s = batch_window_s
        self.stats = {"requests": 0, "batches": 0, "max_batch_rows": 0, "generated_tokens": 0}
        self._queue: queue.Queue[GenRequest | None] = queue.Queue()
        self._held: list[GenRequest] = []
        self._thread = threading.Thread(target=self._loop, name="swarmrl-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenRequest) -> Future:
        self._queue.put(request)
        return request.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    # -- batching --------------------------------------------------------------------------

    def _next_batch(self) -> list[GenRequest] | None:
        first = self._held.pop(0) if self._held else self._queue.get()
        if first is None:
            return None
        batch, rows = [first], first.n
        deadline = time.monotonic() + self.batch_window_s
        while rows < self.max_batch_rows:
            left = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=max(left, 0)) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)  # stop after this batch
                break
            if item.temperature != first.temperature or rows + item.n > self.max_batch_rows:
                self._held.append(item)
                continue
            batch.append(item)
            rows += item.n
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            # A request whose client went away (its future cancelled) is dropped; the others
            # are marked running, so a disconnect from now on cannot cancel them under us.
            batch = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                self._run(batch)
            except Exception as exc:  # noqa: BLE001 - a failed batch fails its requests, not the server
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(exc)
                    if request.on_delta is not None:  # let waiting streams end
                        for index in range(request.n):
                            request.on_delta(index, None, None)

    # -- one batch -------------------------------------------------------------------------

    def _run(self, batch: list[GenRequest]) -> None:
        rows = [_Row(request, j) for request in batch for j in range(request.n)]
        prompts = [row.request.prompt_ids for row in rows]
        seeds = [row.request.seeds[row.index] for row in rows]
        max_new = max(request.max_tokens for request in batch)
        top = max(request.top_logprobs for request in batch)
        self.stats["batches"] += 1
        self.stats["requests"] += len(batch)
        self.stats["max_batch_rows"] = max(self.stats["max_batch_rows"], len(rows))
        needs_text = [bool(row.request.stop or row.request.on_delta) for row in rows]

        def on_step(t: int, tokens: list[int]) -> list[bool]:
            ended = [False] * len(rows)
            for i, row in enumerate(rows):
                if row.finish is not None:
                    continue
                tok = tokens[i]
                row.ids.append(tok)
                if tok in self.stop_token_ids:
                    row.finish = "stop"
                elif len(row.ids) >= row.request.max_tokens:
                    row.finish = "length"
                if needs_text[i]:
                    self._update_text(row)
                if row.finish is not None:
                    ended[i] = True
                    self._flush(row, final=True)
                elif row.request.on_delta is not None:
                    self._flush(row, final=False)
            return ended

        outs = self.sampler.generate(prompts, seeds, max_new_tokens=max_new,
                                     temperature=batch[0].temperature, top_logprobs=top, on_step=on_step)
        results: dict[int, list[Choice]] = {id(request): [] for request in batch}
        for i, (row, out) in enumerate(zip(rows, outs)):
            n = len(row.ids)
            text = row.text if needs_text[i] else decode_completion(self.tokenizer, row.ids, self.stop_token_ids)
            k = row.request.top_logprobs
            tops = [entry[:k] for entry in out.top_logprobs[:n]] if k and out.top_logprobs else None
            results[id(row.request)].append(Choice(row.ids, text, out.logprobs[:n], tops, row.finish))
            self.stats["generated_tokens"] += n
        for request in batch:
            request.future.set_result(results[id(request)])

    def _update_text(self, row: _Row) -> None:
        """Extend the row's text with its new token and end it at the first stop string.

        Decoding is incremental (only the tokens not yet in the text), so a long completion
        costs O(length), not O(length^2). Tokens are held back while they decode to an
        incomplete UTF-8 character (a byte-level token can end mid-character).
        """
        if row.cut is not None:
            return
        tail = row.ids[row.decoded:]
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
