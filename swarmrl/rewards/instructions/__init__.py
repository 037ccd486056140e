"""Instruction following (IFEval, IFBench): does a response keep to checkable constraints
("no commas", "exactly 3 bullet points", "end with this phrase")?

A row's ``verification_info`` is ``{"instruction_id_list": [...], "kwargs": [...]}``: IFEval's row
format, one kwargs object per instruction (``swarmrl.eval.formats`` turns IFEval and IFBench files
into such rows). Each instruction is graded twice, as the references do:

* strict: the response as written;
* loose: also the response without its first line, without its last line, without both, and each
  of those four without ``*`` characters (markdown emphasis); followed if any of the eight is.

The response graded is the completion's answer region (after the last ``</think>``, stripped);
a completion that opens ``<think>`` and never closes it follows nothing. A response longer than
``MAX_RESPONSE_CHARS`` is refused (follows nothing) rather than graded: every check here runs in
linear time, but language detection and nltk's tokenizers cost about a millisecond per thousand
characters, times eight loose variants, and a stranger's completion must not buy more grading time
than its sender is charged for (docs/instructions.md, docs/security.md).

The checks are this project's own code (the reference implementations fetch nltk data over the
network at run time); docs/instructions.md gives their agreement with the references and every
type where they differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarmrl.rewards.answer import THINK_CLOSE, answer_region
from swarmrl.rewards.instructions import ifbench, ifeval
from swarmrl.rewards.instructions.spec import Instruction, parse_args

INSTRUCTION_FOLLOWING = "instruction_following"

# Longest answer graded, in characters: ~10k tokens of English, past any IFEval or IFBench
# response a model means to give (their longest asks are ~1,000 words); all 83 checks on hostile text of
# that length take ~6 s on one core, a row (1 to 6 of them) well under one (tests/unit/test_instruction_checkers.py).
MAX_RESPONSE_CHARS = 40_000

INSTRUCTIONS: dict[str, Instruction] = {i.id: i for i in [*ifeval.INSTRUCTIONS, *ifbench.INSTRUCTIONS]}
IFEVAL_IDS = tuple(i.id for i in ifeval.INSTRUCTIONS)
IFBENCH_IDS = tuple(i.id for i in ifbench.INSTRUCTIONS)

_EXAMPLE = '{"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}'


def known_ids() -> str:
    return ", ".join(sorted(INSTRUCTIONS))


@dataclass(frozen=True)
class Graded:
    """One response against one row's instructions: ``strict[i]`` and ``loose[i]`` say whether
    instruction i was followed; ``refused`` says why nothing was graded (None when it was)."""

    instruction_ids: tuple[str, ...]
    strict: tuple[bool, ...]
    loose: tuple[bool, ...]
    refused: str | None = None

    @property
    def all_strict(self) -> bool:
        return all(self.strict)

    @property
    def all_loose(self) -> bool:
        return all(self.loose)


def parse_instructions(verification_info: Any) -> list[tuple[Instruction, dict]]:
    """The row's instructions with their validated arguments; ValueError naming the field
    (``instruction_id_list[i]``, ``kwargs[i]``), the problem and, for an unknown id, the known ones."""
    if not isinstance(verification_info, dict):
        raise ValueError(f"verification_info must be an object such as {_EXAMPLE}")
    ids = verification_info.get("instruction_id_list")
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"'instruction_id_list' must be a non-empty list of instruction ids, got {ids!r}")
    kwargs = verification_info.get("kwargs")
    if kwargs is None:
        kwargs = [{} for _ in ids]
    if not isinstance(kwargs, list) or len(kwargs) != len(ids):
        raise ValueError(
            f"'kwargs' must be a list with one object of arguments per instruction ({len(ids)}), got {kwargs!r}"
        )
    parsed = []
    for index, (instruction_id, arguments) in enumerate(zip(ids, kwargs)):
        instruction = INSTRUCTIONS.get(instruction_id) if isinstance(instruction_id, str) else None
        if instruction is None:
            raise ValueError(
                f"'instruction_id_list[{index}]' is {instruction_id!r}, not a known instruction id; "
                f"known ids: {known_ids()}"
            )
        try:
            parsed.append((instruction, parse_args(instruction, arguments)))
        except ValueError as e:
            raise ValueError(f"'kwargs[{index}]': {e}") from None
    return parsed


# How a row's reward counts its instructions: its optional "reward" key. "all": 1.0 when every
# one is followed (IFEval's prompt-level strict); "fraction": the share followed (instruction-level
# strict). A run's training rows carry its `rewards.instruction_reward` (swarmrl/tasks/source.py).
REWARD_MODES = ("all", "fraction")


def check_instructions(verification_info: dict) -> str | None:
    """None if ``verification_info`` can be graded, else what is wrong (the registry's check)."""
    try:
        parse_instructions(verification_info)
    except ValueError as e:
        return str(e)
    mode = verification_info.get("reward", "all")
    if mode not in REWARD_MODES:
        return f"'reward' must be one of {list(REWARD_MODES)} (all or the share of instructions followed), got {mode!r}"
    return None


def loose_variants(response: str) -> list[str]:
    """The eight responses loose grading tries, the response itself first."""
    lines = response.split("\n")
    trimmed = [response, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return [*trimmed[:1], trimmed[0].replace("*", ""), *trimmed[1:], *(t.replace("*", "") for t in trimmed[1:])]


def graded_response(completion: str) -> tuple[str, str | None]:
    """The text graded for ``completion`` and, when nothing may be graded, why."""
    region = answer_region(completion)
    if region is None:
        return "", "the completion opens <think> and never closes it"
    if THINK_CLOSE in completion:
        region = region.strip()
    if len(region) > MAX_RESPONSE_CHARS:
        return "", (
            f"the response has {len(region)} characters; responses over {MAX_RESPONSE_CHARS} are not graded "
            "(swarmrl.rewards.instructions.MAX_RESPONSE_CHARS)"
        )
    return region, None


def grade_instructions(verification_info: dict, completion: str) -> Graded:
    """Strict and loose verdicts for each of the row's instructions (ValueError for a bad row)."""
    parsed = parse_instructions(verification_info)
    ids = tuple(instruction.id for instruction, _ in parsed)
    response, refused = graded_response(completion)
    if refused is not None:
        nothing = (False,) * len(parsed)
        return Graded(ids, nothing, nothing, refused)
    others = [v for v in loose_variants(response)[1:] if v.strip()]
    strict, loose = [], []
    for instruction, args in parsed:
        followed = bool(response.strip()) and instruction.check(response, **args)
        strict.append(followed)
        loose.append(followed or any(instruction.check(v, **args) for v in others))
    return Graded(ids, tuple(strict), tuple(loose))


def instructions_task_reward(verification_info: dict, completion: str) -> tuple[float, str | None]:
    """Reward for an ``instruction_following`` row: 1.0 when every instruction is followed
    (strict, IFEval's prompt-level measure), or with ``"reward": "fraction"`` in the row the share
    followed (strict); the reason names those that were not."""
    graded = grade_instructions(verification_info, completion)
    if graded.refused is not None:
        return 0.0, graded.refused
    missed = [i for i, ok in zip(graded.instruction_ids, graded.strict) if not ok]
    if missed:
        reward = 0.0
        if verification_info.get("reward") == "fraction":
            reward = sum(graded.strict) / len(graded.strict)
        return reward, f"not followed (strict): {', '.join(missed)}"
    return 1.0, None


def instructions_detail(verification_info: dict, completion: str) -> dict:
    """``grade_instructions`` as plain data, for a grading pool to send back: the reference's
    field names (``follow_instruction_list_strict`` ...) plus ``refused``."""
    graded = grade_instructions(verification_info, completion)
    return {
        "instruction_id_list": list(graded.instruction_ids),
        "follow_instruction_list_strict": list(graded.strict),
        "follow_instruction_list_loose": list(graded.loose),
        "follow_all_instructions_strict": graded.all_strict,
        "follow_all_instructions_loose": graded.all_loose,
        "refused": graded.refused,
    }
