"""The built-in rollout engine: continuous batching over `SlotDecoder`'s fixed KV cache.

Each completion is a `Job` (prompt, seed, limits). The engine holds up to ``max_batch`` jobs in
cache slots and advances them together, one token per `step()`:

1. admit: waiting jobs take free slots. Identical prompts (a GRPO group's completions) are
   prefilled once and their cached keys/values copied to the other slots.
2. sample: every active row picks its token t with the seeded Gumbel-max rule keyed by
   (seed, t) (`inference/seeded.py`) and records its logprob under softmax(logits / T), the
   final-layer hidden state behind it, and its top logprobs when asked.
3. retire: rows that stopped leave; the last active row moves into the hole, so active rows
   always fill slots 0..n-1 and a decode step touches nothing else.
4. decode: one forward step for the active rows.

A finished row's slot is refilled at the next step from the waiting queue: a job submitted
while others generate starts without waiting for them to end (serving relies on this), and a
worker's lease keeps the batch full until its tail.

The conventions the validator relies on are the same as the generic sampler's
(`inference/sampler.py`): token t is chosen from the logits at the position before it, hidden[t]
is the final-layer hidden state at that position, noise is keyed by (seed, t); and a job's
tokens do not depend on which other jobs share its steps (a row's arithmetic only touches its
own slot; batch size changes rounding in the last bits at most, which the validator's
tolerances cover and `tests/unit/test_engine.py` checks).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from swarmrl.inference import native
from swarmrl.inference.decoder import SlotDecoder
from swarmrl.inference.malloc import keep_freed_memory
from swarmrl.inference.sampler import Completion, check_rows
from swarmrl.inference.seeded import gumbel_noise, seeded_choice, stream_keys, vocab_term_u32


@dataclass(eq=False)
class Job:
    """One completion to generate, and what it has produced so far."""

    prompt: list[int]
    seed: int
    max_new_tokens: int
    temperature: float = 1.0
    top_logprobs: int = 0
    return_hidden: bool = False
    # Called after each token with (t, token id); returning True ends the job now, as if it had
    # stopped (serving: stop strings, streaming).
    on_token: Callable[[int, int], bool] | None = None
    # Called once when the job ends (from the thread running `step`).
    on_done: Callable[[Job], None] | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    hidden: list[Tensor] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    length: int = 0  # tokens in this job's cache slot

    def completion(self) -> Completion:
        return Completion(
            token_ids=self.tokens,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason or "length",
            hidden=torch.stack(self.hidden) if self.return_hidden else None,
            top_logprobs=self.tops if self.top_logprobs else None,
        )


class BatchEngine:
    """The "builtin" engine (see `inference/engine.py`) for models `SlotDecoder` supports."""

    provides_hidden = True
    seeded = True
    continuous = True  # refills finished rows: give it every prompt at once

    def __init__(
        self, model, *, stop_token_ids: list[int], pad_token_id: int, max_batch: int = 64, capacity: int | None = None
    ):
        if not stop_token_ids:
            raise ValueError("the engine needs at least one stop token id (the tokenizer's eos)")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._model = model
        self.stop_token_ids = list(stop_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch = max_batch
        # The longest prompt + completion a job may have (0: no limit). The cache starts at what
        # the first jobs need and grows (doubling) when longer ones come.
        self.capacity = capacity or 0
        self.decoder: SlotDecoder | None = None
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":  # each step's temporaries reused, not faulted in again
            keep_freed_memory()
        # The C kernels (the seeded choice in one pass, the decoder's attention) where they build.
        self._kernels = native.decode_attention_lib() if self.device.type == "cpu" else None
        self._stop = torch.tensor(self.stop_token_ids, device=self.device)
        self._waiting: deque[Job] = deque()
        self._lock = threading.Lock()
        self.active: list[Job] = []  # job in slot i is active[i]
        self._hidden: Tensor | None = None  # [len(active), H]: behind each active row's next token
        self.stats = {"steps": 0, "prefills": 0, "prefilled_prompts": 0, "shared_prompts": 0, "tokens": 0}

    @property
    def model(self):
        return self._model

    @model.setter
    def model(self, model) -> None:
        """Swap the policy (the next jobs run on it; the cache is rebuilt for it)."""
        if self.active:
            raise RuntimeError("cannot swap the model while jobs are running")
        self._model, self.decoder = model, None
        self.device = next(model.parameters()).device
        self._stop = self._stop.to(self.device)

    # -- queue -------------------------------------------------------------------------------

    def submit(self, job: Job) -> Job:
        """Queue a job (any thread); `step()` admits it when a slot is free."""
        if not job.prompt:
            raise ValueError("empty prompt: every prompt needs at least one token")
        if job.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {job.max_new_tokens}")
        if self.capacity and len(job.prompt) + job.max_new_tokens > self.capacity:
            raise ValueError(
                f"prompt ({len(job.prompt)} tokens) + max_new_tokens ({job.max_new_tokens}) is over "
                f"the engine's cache of {self.capacity} tokens"
            )
        with self._lock:
            self._waiting.append(job)
        return job

    def pending(self) -> int:
        """Jobs not finished yet (active or waiting)."""
        with self._lock:
            return len(self.active) + len(self._waiting)

    # -- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Job]:
        """Advance every active job by one token (admitting waiting jobs first); returns the
        jobs that ended in this step."""
        self._admit()
        if not self.active:
            return []
        self.stats["steps"] += 1
        finished = self._sample()
        self._retire(finished)
        if self.active:
            tokens = torch.tensor([job.tokens[-1] for job in self.active], device=self.device)
            lengths = [job.length for job in self.active]
            self._hidden = self.decoder.decode(tokens, torch.tensor(lengths, device=self.device), max(lengths) + 1)
            for job in self.active:
                job.length += 1
        else:
            self._hidden = None
        for job in finished:
            if job.on_done is not None:
                job.on_done(job)
        return finished

    def _admit(self) -> None:
        with self._lock:
            free = self.max_batch - len(self.active)
            new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        if not new:
            return
        # Shortest prompts first (stable: a group's rows stay together): neighbouring slots then
        # hold similar lengths, and the decoder's attention reads each range of rows only as far
        # as that range's longest (SlotDecoder._row_chunks). Which slot a row has never changes
        # its tokens.
        new.sort(key=lambda j: len(j.prompt))
        need = max(len(j.prompt) + j.max_new_tokens for j in new)
        if self.decoder is None:
            self.decoder = SlotDecoder(self.model, slots=self.max_batch, capacity=need)
        else:
            self.decoder.refresh()
            if need > self.decoder.capacity:  # grow (amortised doubling), keeping running rows' caches
                grown = max(need, 2 * self.decoder.capacity)
                self.decoder.grow(min(grown, self.capacity) if self.capacity else grown)
        first = len(self.active)
        slots = torch.arange(first, first + len(new), device=self.device)
        # One prefill per distinct prompt; its cache is copied to the other slots that share it.
        unique: dict[tuple[int, ...], list[int]] = {}
        for i, job in enumerate(new):
            unique.setdefault(tuple(job.prompt), []).append(i)
        heads = [rows[0] for rows in unique.values()]
        hidden_u = self.decoder.prefill([new[i].prompt for i in heads], slots[heads])
        index = torch.empty(len(new), dtype=torch.long, device=self.device)
        for u, rows in enumerate(unique.values()):
            index[rows] = u
            if len(rows) > 1:
                src = slots[[rows[0]] * (len(rows) - 1)]
                self.decoder.copy_slots(src, slots[rows[1:]], len(new[rows[0]].prompt))
        self.stats["prefills"] += 1
        self.stats["prefilled_prompts"] += len(heads)
        self.stats["shared_prompts"] += len(new) - len(heads)
        for job in new:
            job.length = len(job.prompt)
        hidden_new = hidden_u[index]
        self._hidden = hidden_new if self._hidden is None else torch.cat([self._hidden, hidden_new])
        self.active.extend(new)

    def _sample(self) -> list[Job]:
        jobs = self.active
        hidden = self._hidden
        logits = self.decoder.logits(hidden).float()  # [B, V]
        seeds = torch.tensor([j.seed for j in jobs], dtype=torch.int64, device=self.device)
        steps = torch.tensor([len(j.tokens) for j in jobs], dtype=torch.int64, device=self.device)
        temps = {j.temperature for j in jobs}
        k = max(j.top_logprobs for j in jobs)
        temp = next(iter(temps))
        if len(temps) == 1 and temp > 0 and self._kernels is not None and not k:
            # The same rule in one C pass (native.py), which also sums the row's softmax: the
            # chosen logprob without a log-softmax over the whole vocabulary.
            keys, term = stream_keys(seeds, steps), vocab_term_u32(logits.shape[-1])
            tok, lse = native.seeded_argmax(self._kernels, logits.contiguous(), keys, term, temp, with_lse=True)
            chosen = logits.gather(-1, tok[:, None])[:, 0]
            logp = (chosen / temp if temp != 1.0 else chosen) - lse
        else:
            if len(temps) == 1:
                if temp > 0 and self._kernels is not None:
                    keys, term = stream_keys(seeds, steps), vocab_term_u32(logits.shape[-1])
                    tok = native.seeded_argmax(self._kernels, logits.contiguous(), keys, term, temp)
                else:
                    tok = seeded_choice(logits, seeds, steps, temp)
                scaled = logits / temp if temp > 0 and temp != 1.0 else logits
            else:  # rows at different temperatures (serving): the same rule row by row
                t = torch.tensor([j.temperature for j in jobs], dtype=torch.float32, device=self.device)
                safe = torch.where(t > 0, t, torch.ones_like(t))[:, None]
                scaled = logits / safe
                noisy = (scaled + gumbel_noise(seeds, steps, logits.shape[-1])).argmax(-1)
                tok = torch.where(t > 0, noisy, logits.argmax(-1))
            all_logp = scaled.log_softmax(-1)
            logp = all_logp.gather(-1, tok[:, None])[:, 0]
            if k:
                top = all_logp.topk(k, -1)
                top_ids, top_vals = top.indices.tolist(), top.values.tolist()
        is_stop = torch.isin(tok, self._stop).tolist()
        tok_l, logp_l = tok.tolist(), logp.tolist()
        hidden_cpu = hidden.to("cpu") if any(j.return_hidden for j in jobs) else None
        finished = []
        for i, job in enumerate(jobs):
            t_i = len(job.tokens)
            job.tokens.append(tok_l[i])
            job.logprobs.append(logp_l[i])
            if job.return_hidden:
                job.hidden.append(hidden_cpu[i].clone())
            if job.top_logprobs:
                job.tops.append(list(zip(top_ids[i][: job.top_logprobs], top_vals[i][: job.top_logprobs])))
            if is_stop[i]:
                job.finish_reason = "stop"
            elif len(job.tokens) >= job.max_new_tokens:
                job.finish_reason = "length"
            if job.on_token is not None and job.on_token(t_i, tok_l[i]) and job.finish_reason is None:
                job.finish_reason = "stop"
            if job.finish_reason is not None:
                finished.append(job)
        self.stats["tokens"] += len(jobs)
        return finished

    def _retire(self, finished: list[Job]) -> None:
        """Remove finished rows, moving the last active row into each hole (slots stay 0..n-1)."""
        if not finished:
            return
        gone = {id(j) for j in finished}
        keep = [i for i, j in enumerate(self.active) if id(j) not in gone]
        n = len(keep)
        # Rows already in 0..n-1 stay; rows beyond move into the holes below n.
        holes = [i for i in range(n) if id(self.active[i]) in gone]
        movers = [i for i in keep if i >= n]
        order = list(range(len(self.active)))
        if movers:
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            span = max(self.active[i].length for i in movers)
            self.decoder.copy_slots(src, dst, span)
            for h, m in zip(holes, movers):
                order[h] = m
        self.active = [self.active[i] for i in order[:n]]
        self._hidden = None  # the decode step that follows computes the new rows' states

    # -- the engine protocol -----------------------------------------------------------------

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
        """Sample one completion per prompt; all of them share this engine's slots, refilled as
        rows finish. ``on_step`` is the generic sampler's batch-wide hook: here use `Job.on_token`
        through `submit` instead."""
        if on_step is not None:
            raise TypeError("BatchEngine has per-job hooks (Job.on_token), not on_step")
        if not check_rows(prompts, seeds):
            return []
        if self.active or self._waiting:
            raise RuntimeError("generate() needs an idle engine; use submit()/step() to share it")
        need = max(len(p) for p in prompts) + max_new_tokens
        if self.decoder is not None and self.decoder.capacity < need:
            self.decoder.grow(need)
        jobs = [
            self.submit(Job(list(p), int(s), max_new_tokens, temperature, top_logprobs, return_hidden))
            for p, s in zip(prompts, seeds)
        ]
        while self.active or self._waiting:
            self.step()
        return [job.completion() for job in jobs]
