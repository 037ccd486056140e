"""Where a run's problems come from, and how a task prompt becomes model input."""

from __future__ import annotations

from swarmrl.config import Config
from swarmrl.data.loading import load_tasks
from swarmrl.rewards import registry
from swarmrl.rewards.length import with_length_target
from swarmrl.tasks import arithmetic


def task_rows(cfg: Config, *, log=print) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) as dicts in the task schema."""
    t = cfg.tasks
    if t.source == "arithmetic":
        train = arithmetic.generate(
            t.train_size, digits=t.digits, ops=t.ops, split="train", seed=t.seed, **arithmetic.options(t)
        )
        held = arithmetic.generate(
            t.eval_size, digits=t.digits, ops=t.ops, split="test", seed=t.seed, **arithmetic.options(t)
        )
        return train, held
    result = load_tasks(
        t.source, solve_rate_column=t.solve_rate_column, solve_rate_range=t.solve_rate_range, checks=registry.checks()
    )
    log(result.summary())
    train = [r.model_dump() for r in result.rows]
    if not train:
        raise ValueError(f"no usable tasks in {t.source}: {result.summary()}")
    if t.eval_source:
        held = [r.model_dump() for r in load_tasks(t.eval_source, checks=registry.checks()).rows][: t.eval_size]
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
