"""Supervised warm start on worked traces (`swarmrl sft`).

RL can only sharpen what a policy already does sometimes, so the default run starts from a
model that solves a fair share (the seed run filtered for 10-80% solve rate) but not all of
held-out problems. This trains the tiny Qwen2 from scratch on `<think>` traces of the built-in
arithmetic task for a fixed, short budget, and caches the result as an HF folder.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmrl.config import Config
from swarmrl.envs.builtin import GUESS
from swarmrl.envs.episode import chat_framing
from swarmrl.model.checkpoint import build_tiny_policy, save_policy
from swarmrl.model.hub import resolve
from swarmrl.tasks import arithmetic, episodes
from swarmrl.tasks.source import model_input


def encode_example(
    tokenizer, prompt: str, completion: str, target_length: int | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of prompt + completion + eos, and a 0/1 mask marking what is learned."""
    _, p = model_input(tokenizer, prompt, target_length)  # exactly what the sampler sees in RL
    c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p + c, [0] * len(p) + [1] * len(c)


def encode_episode_example(tokenizer, prompt: str, turns: list[str], observations: list[str]):
    """An episode as the sampler would produce it: prompt, then each model turn + eos and the
    observation after it framed by the chat template (`chat_framing`); only the turns are learned."""
    _, ids = model_input(tokenizer, prompt, None)
    mask = [0] * len(ids)
    frame = chat_framing(tokenizer)
    for k, turn in enumerate(turns):
        t = tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, mask = ids + t, mask + [1] * len(t)
        if k < len(observations):
            o = frame(observations[k])
            ids, mask = ids + o, mask + [0] * len(o)
    return ids, mask


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.bool)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (x, m) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
        attn[i, : len(x)] = 1
    return ids, mask, attn


def micro_batches(batch: list[tuple[list[int], list[int]]], parts: int) -> list[list]:
    """The batch as `parts` micro-batches of consecutive lengths (sorted, stably), so each is
    padded to its own longest trace. One part: the batch as drawn."""
    if parts == 1:
        return [batch]
    ordered = sorted(batch, key=lambda example: len(example[0]))
    size = -(-len(ordered) // parts)
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def _accumulate(model, batch: list[tuple[list[int], list[int]]], parts: int, pad_id: int) -> torch.Tensor:
    """Forward and backward of the mean token loss over the whole batch, in `parts` passes.
    Returns the loss (detached). Each pass adds its tokens' summed loss / the batch's token count,
    so the accumulated gradient is the one-pass gradient."""
    # One part takes the mean directly: bit for bit the loop of bases built before micro-batches.
    total = None if parts == 1 else sum(sum(m[1:]) for _, m in batch)  # learned tokens (not position 0)
    loss = torch.zeros(())
    for part in micro_batches(batch, parts):
        ids, mask, attn = _batch(part, pad_id)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # [n, T-1, V]
        targets, tmask = ids[:, 1:], mask[:, 1:]  # [n, T-1]
        if total is None:
            part_loss = torch.nn.functional.cross_entropy(logits[tmask], targets[tmask])
        else:
            part_loss = torch.nn.functional.cross_entropy(logits[tmask], targets[tmask], reduction="sum") / total
        part_loss.backward()
        loss += part_loss.detach()
    return loss


def _calculator_examples(cfg: Config, tokenizer) -> list[tuple[list[int], list[int]]]:
    """The calculator's warm start (`tasks.source = "calculator"`): worked episodes of training
    problems, `sft.tool_rate` of them calling the tool (tasks/episodes.py `calculator_traces`)."""
    rows = episodes.calculator_rows(
        cfg.sft.examples,
        digits=cfg.tasks.digits,
        split="train",
        held_out_fraction=cfg.tasks.held_out_fraction,
        seed=cfg.sft.seed + 1000,
    )
    traces = episodes.calculator_traces(rows, tool_rate=cfg.sft.tool_rate, seed=cfg.sft.seed)
    return [encode_episode_example(tokenizer, r["prompt"], r["turns"], r["observations"]) for r in traces]


def _guess_examples(cfg: Config, tokenizer) -> list[tuple[list[int], list[int]]]:
    """The guessing game's warm start (`tasks.source = "guess"`): games played by bisection."""
    max_turns = min(GUESS.max_turns, cfg.tasks.max_turns or GUESS.max_turns)
    games = episodes.guess_traces(cfg.sft.examples, high=cfg.tasks.guess_high, max_turns=max_turns, seed=cfg.sft.seed)
    return [encode_episode_example(tokenizer, g["prompt"], g["turns"], g["observations"]) for g in games]


def _arithmetic_examples(cfg: Config, tokenizer) -> list[tuple[list[int], list[int]]]:
    """Worked arithmetic traces (every other source's warm start: the base's one skill)."""
    rows = arithmetic.generate(
        cfg.sft.examples,
        digits=cfg.tasks.digits,
        ops=cfg.tasks.ops,
        split="train",
        seed=cfg.sft.seed + 1000,
        with_trace=True,
        slip_rate=cfg.sft.slip_rate,
        verbosity=tuple(cfg.sft.verbosity),
    )
    # With length control, each prompt names a target drawn independently of how verbose its
    # trace is: the base sees the instruction but does not follow it (RL's job to learn).
    # `sft.target_match` of them name the target nearest the trace's own length instead.
    target_rng = random.Random(cfg.sft.seed + 2000)
    lengths = [_sft_target(tokenizer, r["trace"], cfg, target_rng) for r in rows]
    return [encode_example(tokenizer, r["prompt"], r["trace"], n) for r, n in zip(rows, lengths)]


@dataclass(frozen=True)
class WarmStart:
    """How the built-in tiny base is warm started for a run's task source: its examples, what its
    cache key adds to the arithmetic key, and the name its metadata records."""

    task: str
    examples: Callable[[Config, Any], list[tuple[list[int], list[int]]]]
    key: Callable[[Config, str], str]
    uses_tool: bool = False


ARITHMETIC_WARM_START = WarmStart("arithmetic", _arithmetic_examples, lambda cfg, key: key)
WARM_STARTS = {
    "calculator": WarmStart(
        "calculator", _calculator_examples, lambda cfg, key: f"calc-{key}-tool{cfg.sft.tool_rate:g}", uses_tool=True
    ),
    "guess": WarmStart(
        "guess", _guess_examples, lambda cfg, key: f"guess{cfg.tasks.guess_high}-t{cfg.tasks.max_turns or 0}-{key}"
    ),
}
"""Warm starts by task source; any other source (a plug-in's too) starts from the arithmetic one."""


def warm_start(cfg: Config) -> WarmStart:
    return WARM_STARTS.get(cfg.tasks.source, ARITHMETIC_WARM_START)


def _sft_target(tokenizer, trace: str, cfg: Config, rng: random.Random) -> int | None:
    """The length target a training prompt names (None without length control)."""
    if not cfg.length.enabled:
        return None
    drawn = rng.choice(cfg.length.targets)
    # No extra draw at 0, so bases built before this field existed are rebuilt bit for bit.
    if not cfg.sft.target_match or rng.random() >= cfg.sft.target_match:
        return drawn
    n = len(tokenizer(trace, add_special_tokens=False)["input_ids"]) + 1  # + eos, as RL counts
    return min(cfg.length.targets, key=lambda target: abs(target - n))


def base_cache_key(cfg: Config) -> str:
    """The cached base is reused only when everything that shaped it is the same."""
    s, t = cfg.sft, cfg.tasks
    key = f"d{t.digits}-{t.ops.replace('+', 'p').replace('-', 'm')}-s{s.steps}-b{s.batch_size}-lr{s.lr:g}-n{s.examples}-slip{s.slip_rate:g}-seed{s.seed}"  # noqa: E501
    # Suffixes only for non-default settings, so bases cached before these fields existed stay valid.
    if s.dtype != "float32":
        key += f"-{s.dtype}"
    if s.threads is not None:
        key += f"-t{s.threads}"
    if s.micro_batches != 1:
        key += f"-mb{s.micro_batches}"
    if s.verbosity != [0]:
        key += "-v" + "".join(str(level) for level in s.verbosity)
    key = warm_start(cfg).key(cfg, key)
    if cfg.length.enabled:
        key += "-len" + "-".join(str(n) for n in cfg.length.targets)
        if s.target_match:
            key += f"-match{s.target_match:g}"
    return key


def train_sft(
    cfg: Config,
    out_dir: str | Path,
    *,
    log=print,
    on_step: Callable[[int, torch.nn.Module, torch.Tensor], None] | None = None,
) -> Path:
    """Train the tiny base from scratch on arithmetic traces and save it to `out_dir`.
    `on_step(step, model, loss)` runs after each optimizer step (1-based), e.g. to score the
    model mid-way (benchmarks/study_sft_curve.py); it must leave the model in train mode."""
    if cfg.sft.threads is not None:
        torch.set_num_threads(cfg.sft.threads)
    torch.manual_seed(cfg.sft.seed)
    model, tokenizer = build_tiny_policy(seed=cfg.sft.seed)
    # Initialised in float32 (the same starting weights), then trained in the chosen precision.
    model = model.to(getattr(torch, cfg.sft.dtype))
    model.train()
    recipe = warm_start(cfg)
    examples = recipe.examples(cfg, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr, betas=(0.9, 0.99), weight_decay=0.01)
    warmup = max(1, cfg.sft.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, cfg.sft.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng = random.Random(cfg.sft.seed)
    t0 = time.time()
    for step in range(cfg.sft.steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(cfg.sft.batch_size)]
        opt.zero_grad(set_to_none=True)
        loss = _accumulate(model, batch, cfg.sft.micro_batches, tokenizer.pad_token_id)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == cfg.sft.steps - 1:
            log(f"sft step {step + 1}/{cfg.sft.steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
        if on_step is not None:
            on_step(step + 1, model, loss)
    model = model.float().eval()
    meta = {
        "dtype": cfg.sft.dtype,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "sft_steps": cfg.sft.steps,
        "micro_batches": cfg.sft.micro_batches,
        "slip_rate": cfg.sft.slip_rate,
        "verbosity": cfg.sft.verbosity,
        "length_targets": cfg.length.targets if cfg.length.enabled else None,
        "target_match": cfg.sft.target_match if cfg.length.enabled else None,
        "digits": cfg.tasks.digits,
        "ops": cfg.tasks.ops,
        "task": recipe.task,
        "tool_rate": cfg.sft.tool_rate if recipe.uses_tool else None,
        "seconds": round(time.time() - t0, 1),
    }
    return save_policy(model, tokenizer, out_dir, extra_files={"swarmrl_sft.json": json.dumps(meta, indent=1)})


def ensure_base_model(cfg: Config, *, log=print) -> Path:
    """`model.path` if set, else the cached built-in base (trained here on first use)."""
    if cfg.model.path:
        return resolve(cfg.model.path, cfg.model.revision).folder  # a folder, or a Hub id's snapshot
    path = Path(cfg.model.base_cache_dir) / base_cache_key(cfg)
    if (path / "config.json").exists():
        return path
    log(f"building the built-in base model (first use; cached at {path})")
    return train_sft(cfg, path, log=log)
