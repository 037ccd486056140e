"""`swarmrl score`: grade completions in a JSONL file (math answers, code in a sandbox, length control)."""

from __future__ import annotations

import json
import os
import sys
from typing import Literal

from swarmrl.config import Config
from swarmrl.entrypoints.common import fail
from swarmrl.entrypoints.flags import RoleSettings

HELP = "Score completions in a JSONL file (math answers, code run against tests in a sandbox; length control)."
EPILOG = (
    "Code rows (task_type prime_rl_code) run in bubblewrap; set its fields as --sandbox.FIELD "
    "VALUE, e.g. --sandbox.workers 4 --sandbox.partial_credit true. See docs/sandbox.md."
)
RUN_CONFIG = "flags"
CONFIG_HELP = "TOML config file; its [sandbox] section sets how code rows run"
OVERRIDE_SECTIONS = ("sandbox", "tasks")


class Settings(RoleSettings):
    input: str
    """JSONL rows: task fields + completion (+ target_length), or IFEval-format rows (key, prompt,
    instruction_id_list, kwargs) + completion"""
    output: str
    """JSONL output: input fields + task_reward, length_penalty, reward, error; for IFEval rows the strict and
    loose verdict of each instruction and of the row (follow_instruction_list_strict, ..._loose,
    follow_all_instructions_strict, ..._loose) + error"""
    tokenizer: str | None = None
    """HF folder whose tokenizer counts completion tokens (default: the built-in one)"""
    length_mode: Literal["exact", "max", "clip"] = "max"
    """rows with a target_length: exact (every token off target costs --length-coef), max (a soft ceiling: half
    the reward at the target) or clip (nothing past the target)"""
    length_coef: float = 0.001
    """the length shaping's coefficient (per token off target)"""
    workers: int = 2
    """grading processes"""
    timeout: float = 5.0
    """hard per-row math grading timeout in seconds"""
    allow_errors: bool = False
    """exit 0 even when some rows could not be scored (by default that exits 1; the output file is written
    either way, each such row with its `error`)"""


def _peek_task_types(path: str) -> list[dict]:
    """``{"task_type": ...}`` of each parseable line, to know whether a sandbox is needed."""
    found = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                found.append({"task_type": row.get("task_type")})
    return found


def _token_counter(tokenizer: str | None):
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    else:
        from swarmrl.model.tokenizer import build_char_tokenizer

        tok = build_char_tokenizer()
    return lambda s: len(tok(s, add_special_tokens=False)["input_ids"])


def main(settings: Settings, cfg: Config) -> None:
    from swarmrl.rewards.instructions import INSTRUCTION_FOLLOWING
    from swarmrl.rewards.pool import DEFAULT_PRELOAD, VerifierPool
    from swarmrl.rewards.registry import open_graders, preload_for
    from swarmrl.rewards.scoring import score_file

    if not os.path.exists(settings.input):
        fail(f"--input {settings.input} does not exist")
    if _is_instruction_file(settings.input):
        from swarmrl.rewards.scoring import score_instruction_file

        # The checkers' language and sentence models load once per process at start, not inside
        # the first answer's timeout (rewards/instructions/preload.py).
        preload = (*DEFAULT_PRELOAD, *preload_for([{"task_type": INSTRUCTION_FOLLOWING}]))
        with VerifierPool(settings.workers, settings.timeout, preload=preload) as pool:
            counts = score_instruction_file(settings.input, settings.output, pool=pool)
        _report(counts, settings)
        return
    count_tokens = _token_counter(settings.tokenizer)
    graders = open_graders(_peek_task_types(settings.input), cfg.sandbox)  # SandboxUnavailable: cli.main says it
    try:
        preload = (*DEFAULT_PRELOAD, *preload_for(_peek_task_types(settings.input)))
        with VerifierPool(settings.workers, settings.timeout, preload=preload) as pool:
            counts = score_file(
                settings.input,
                settings.output,
                pool=pool,
                count_tokens=count_tokens,
                length_mode=settings.length_mode,
                length_coef=settings.length_coef,
                graders=graders,
            )
    finally:
        graders.close()
    _report(counts, settings)


def _is_instruction_file(path: str) -> bool:
    """Whether the first parseable row is in IFEval's format (instruction_id_list, no task_type)."""
    from swarmrl.rewards.scoring import is_instruction_row

    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                return is_instruction_row(json.loads(line))
            except json.JSONDecodeError:
                continue
    return False


def _report(counts: dict, settings: Settings) -> None:
    print(json.dumps(counts))
    if counts["errors"] and not settings.allow_errors:
        first = "; ".join(f"line {e['line']}: {e['error']}" for e in counts["first_errors"][:2])
        print(
            f"swarmrl score: {counts['errors']} of {counts['rows']} rows could not be scored ({first}); each has "
            f"its `error` in {settings.output}. The summary's means average the {counts['scored']} "
            "scored rows (mean_reward_all_rows counts the others as 0). Fix the rows, or pass --allow-errors "
            "to exit 0.",
            file=sys.stderr,
        )
        raise SystemExit(1)
