"""Where a run's problems come from, and how a task prompt becomes model input."""

from __future__ import annotations

import json
from pathlib import Path

from swarmrl.config import Config
from swarmrl.config.task import MIX
from swarmrl.data.loading import load_tasks
from swarmrl.envs import registry as envs
from swarmrl.rewards import registry
from swarmrl.rewards.instructions import INSTRUCTION_FOLLOWING
from swarmrl.rewards.length import with_length_target
from swarmrl.tasks import registry as sources


def mix_sizes(weights: dict[str, float], total: int) -> dict[str, int]:
    """`total` problems shared by weight (normalised), each source at least one: largest
    remainders, so the sizes add up to `total` whenever it covers one per source."""
    norm = sum(weights.values())
    exact = {name: total * w / norm for name, w in weights.items()}
    sizes = {name: max(1, int(x)) for name, x in exact.items()}
    by_remainder = sorted(weights, key=lambda name: exact[name] - int(exact[name]), reverse=True)
    for name in by_remainder[: max(0, total - sum(sizes.values()))]:
        sizes[name] += 1
    return sizes


def with_instruction_reward(rows: list[dict], mode: str) -> list[dict]:
    """Training rows of instruction following graded as `rewards.instruction_reward` says: the
    mode goes into their verification_info (its "reward" key), the one thing the grading pool
    sees of a row. "all" is the graders' default and leaves rows as they are."""
    if mode == "all":
        return rows
    out = []
    for row in rows:
        if row.get("task_type") == INSTRUCTION_FOLLOWING:
            info = json.loads(row["verification_info"])
            row = {**row, "verification_info": json.dumps({**info, "reward": mode})}
        out.append(row)
    return out


def row_checks() -> dict:
    """The checks of each task type's verification_info: the registered task types' and, for
    "env:NAME", the environment's own."""
    return {**registry.checks(), **{envs.task_type(name): envs.get(name).check for name in envs.names()}}


def task_rows(cfg: Config, *, log=print) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) as dicts in the task schema. Training rows of instruction
    following carry the run's `rewards.instruction_reward`; held-out rows are always graded
    all-or-nothing (prompt-level strict). In a mix every row names its `source`."""
    train, held = _task_rows(cfg, log)
    return with_instruction_reward(train, cfg.rewards.instruction_reward), held


def check_source(tasks, *, files: bool = True) -> None:
    """Fail now, naming the problem, for a `tasks.source` (or mix) that names no registered source
    and no file, a source that cannot be mixed, or options its source's model refuses. `files`
    False leaves a file source unchecked (a config checked on another machine than its data's,
    as `--dry-run` does: the rows are read when the run is prepared)."""
    if tasks.source == MIX:
        for name in tasks.mix:
            source = sources.get(name)
            if not source.mixable:
                mixable = [n for n in sources.names() if sources.get(n).mixable]
                raise ValueError(f"tasks.mix: {name!r} runs alone, not in a mix; mix any of: {', '.join(mixable)}")
            sources.options_of(source, tasks.options.get(name, {}))
        return
    if (source := sources.find(tasks.source)) is not None:
        sources.options_of(source, tasks.options)
        return
    if files and not Path(tasks.source).exists():
        raise ValueError(
            f"tasks.source {tasks.source!r} is neither a registered task source ({', '.join(sources.names())}, "
            "or one a plug-in registers: docs/plugins.md) nor a file or dataset folder that exists"
        )
    if tasks.options:
        raise ValueError("tasks.options is for a registered task source, not for a file: remove it")


def _task_rows(cfg: Config, log) -> tuple[list[dict], list[dict]]:
    t = cfg.tasks
    check_source(t)
    if t.source == MIX:
        train, held = [], []
        for name, n in mix_sizes(t.mix, t.train_size).items():
            # Each source's held-out set is the one a run of that source alone evaluates on, so
            # a mixed run's eval/accuracy/arithmetic compares with an arithmetic run's accuracy.
            train += [{**row, "source": name} for row in sources.source_rows(t, name, n, "train")]
            held += [{**row, "source": name} for row in sources.source_rows(t, name, t.eval_size, "test")]
        return train, held
    if sources.find(t.source) is not None:
        return sources.source_rows(t, t.source, t.train_size, "train"), sources.source_rows(
            t, t.source, t.eval_size, "test"
        )
    result = load_tasks(
        t.source, solve_rate_column=t.solve_rate_column, solve_rate_range=t.solve_rate_range, checks=row_checks()
    )
    log(result.summary())
    train = [r.model_dump() for r in result.rows]
    if not train:
        raise ValueError(f"no usable tasks in {t.source}: {result.summary()}")
    if t.eval_source:
        held = [r.model_dump() for r in load_tasks(t.eval_source, checks=row_checks()).rows][: t.eval_size]
    else:
        # No separate held-out file: hold out the tail of the file (deterministic) and say so.
        n = min(t.eval_size, max(1, len(train) // 10))
        train, held = train[:-n], train[-n:]
        log(f"tasks.eval_source not set: holding out the last {n} rows of {t.source} for evaluation")
    return train, held


def model_input(tokenizer, prompt: str, target_length: int | None) -> tuple[str, list[int]]:
    """The prompt as the policy sees it (length instruction appended) and its token ids."""
    if target_length is not None:
        prompt = with_length_target(prompt, target_length)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return prompt, tokenizer(text, add_special_tokens=False)["input_ids"]


def episode_spec(cfg: Config, row: dict, seeds: list[int]) -> dict | None:
    """What a lease says of a row that is an episode (messages.EpisodeSpec), None for a
    single-turn row. The environment's seed is the group's first completion seed, so every
    episode of the group plays the same game (GRPO compares them)."""
    env = envs.for_task_type(row.get("task_type"))
    if env is None:
        return None
    task = json.loads(row["verification_info"])
    return {
        "name": env.name,
        "task": env.visible(task),
        "seed": seeds[0],
        "max_turns": min(env.max_turns, cfg.tasks.max_turns or env.max_turns),
        "max_tokens": cfg.sampling.max_new_tokens,
    }
