"""Procedural instruction following: plain requests with checkable constraints, for RL.

A prompt is one everyday request from `REQUESTS` ("Describe a bicycle.") followed by one to
`max_constraints` constraints, each written from a template over one of IFEval's instruction
types with its arguments drawn from a range ("Answer in fewer than 60 words."). The row carries
the constraints in `verification_info` in IFEval's form (`instruction_id_list` plus one `kwargs`
object each), so the `instruction_following` task type (swarmrl/rewards/instructions) grades it
with the same checkers as IFEval and IFBench.

The requests are this project's own, and none is an IFEval or IFBench prompt
(tests/unit/test_instruction_tasks.py checks them against IFBench's test file). The held-out
split is decided by a hash of the request, never by generation order: a held-out row asks for
something no training row asks for, under constraints drawn the same way, so held-out accuracy
measures following constraints on unseen requests, not remembering answers.

Templates that cannot hold together in one response (all lowercase and all capitals, JSON and
bullet points, two endings) share a group, and a prompt takes at most one template per group.

This module imports nothing from the graders: generating rows must stay cheap for every process
that lists a run's tasks.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

TASK_TYPE = "instruction_following"  # swarmrl.rewards.instructions.INSTRUCTION_FOLLOWING

LESS_THAN, AT_LEAST = "less than", "at least"  # IFEval's relations (swarmrl.rewards.instructions.spec)

# Everyday requests a short answer can serve. Written for this project; none has a comma, so
# "repeat the request" and "no commas" never contradict each other.
REQUESTS = (
    "Write a note to a neighbour about a parcel you took in for them.",
    "Describe a bicycle to someone who has never seen one.",
    "Explain how to boil an egg.",
    "Write a short thank-you message to a teacher.",
    "Suggest a name for a small bakery and say why it fits.",
    "Describe the view from a kitchen window in the morning.",
    "Give advice to someone starting their first job.",
    "Write a reminder for a weekly team meeting.",
    "Explain why the sky looks blue.",
    "Describe a rainy afternoon in a small town.",
    "Write a short invitation to a garden party.",
    "Explain how to plant a tomato seedling.",
    "Describe your ideal weekend.",
    "Write a message asking a friend to return a borrowed book.",
    "Explain what a library card is for.",
    "Describe a cat waking up from a nap.",
    "Give tips for packing a suitcase.",
    "Write a short review of a neighbourhood cafe.",
    "Explain how a compass works.",
    "Describe the sound of the sea.",
    "Write an apology for missing a friend's birthday.",
    "Suggest three things to do on a snowy day.",
    "Explain how to make a cup of tea.",
    "Describe an old wooden chair.",
    "Write a note to a colleague who is leaving the company.",
    "Explain why people keep houseplants.",
    "Describe a busy train station.",
    "Give advice on learning to ride a bike as an adult.",
    "Write a short welcome message for new members of a chess club.",
    "Explain what a rainbow is.",
    "Describe a walk through a pine forest.",
    "Write a message to a landlord about a leaking tap.",
    "Explain how to fold a paper aeroplane.",
    "Describe the smell of fresh bread.",
    "Give tips for a good night's sleep.",
    "Write a postcard from a seaside holiday.",
    "Explain why bees matter to farmers.",
    "Describe a lighthouse at night.",
    "Write a short speech for a friend's wedding.",
    "Explain how to read a bus timetable.",
    "Describe a market on a Saturday morning.",
    "Write a note to leave for a house sitter.",
    "Explain what makes a good password.",
    "Describe a child's first day at school.",
    "Give advice on keeping a small vegetable garden.",
    "Write a message congratulating someone on a new baby.",
    "Explain how clouds form.",
    "Describe an umbrella to a visitor from a dry country.",
    "Write a short letter to your future self.",
    "Explain how to wash a wool jumper.",
    "Describe the first warm day of spring.",
    "Suggest a simple dinner for two.",
    "Write a notice asking people to keep a shared fridge tidy.",
    "Explain why we have seasons.",
    "Describe a dog playing in the snow.",
    "Give tips for a job interview.",
    "Write a message to a plumber asking for a quote.",
    "Explain how to change a light bulb.",
    "Describe an empty playground at dusk.",
    "Write a thank-you note for a birthday present.",
    "Explain what a map legend shows.",
    "Describe a pot of soup simmering on the stove.",
    "Give advice on saving money for a holiday.",
    "Write a short story about a lost key.",
    "Explain how a kettle heats water.",
    "Describe a street after a storm.",
    "Write a message cancelling a dentist appointment.",
    "Explain why leaves change colour in autumn.",
    "Describe a favourite mug.",
    "Give tips for keeping a room cool in summer.",
    "Write a short note to welcome a new neighbour.",
    "Explain how to care for a goldfish.",
    "Describe a river seen from a bridge.",
    "Write a poem about a red kite in the wind.",
    "Explain what a recipe is.",
    "Describe the inside of a greenhouse.",
    "Give advice to a student before an exam.",
    "Write a message to a friend recommending a film.",
    "Explain how to sharpen a pencil with a knife.",
    "Describe a hot air balloon taking off.",
    "Write a short announcement about a school concert.",
    "Explain why it is wise to drink water during exercise.",
    "Describe a bookshop on a quiet afternoon.",
    "Suggest a plan for cleaning a messy garage.",
    "Write a note to a coworker asking to swap shifts.",
    "Explain how to make toast without a toaster.",
    "Describe the moon on a clear night.",
    "Give tips for walking a dog in the city.",
    "Write a message thanking a bus driver.",
    "Explain what recycling means.",
    "Describe a picnic by a lake.",
    "Write a short description of a hiking trail for a club newsletter.",
    "Explain how to tie a shoelace.",
    "Describe a village fair.",
    "Give advice on choosing a first guitar.",
    "Write a message inviting a colleague to lunch.",
    "Explain why snow is white.",
    "Describe an owl in a barn.",
    "Write a short note explaining why you were late.",
    "Explain how to keep bread fresh.",
    "Describe a sunflower field.",
    "Give tips for moving to a new city.",
    "Write a message welcoming guests to a holiday cottage.",
    "Explain how a seed becomes a tree.",
    "Describe a fishing boat coming back to harbour.",
    "Write a short complaint about a noisy street.",
    "Explain what a museum does.",
    "Describe a winter coat.",
    "Suggest a way to spend a free hour.",
    "Write a note asking a neighbour to water your plants.",
    "Explain how to clean a window without streaks.",
    "Describe a family dinner.",
    "Give advice on writing a birthday card.",
    "Write a message to a club about a change of meeting room.",
    "Explain why we need sleep.",
    "Describe a paper lantern festival.",
    "Write a short guide to a town's best bench.",
    "Explain how to brew coffee in a pot.",
    "Describe a grandparent's garden shed.",
    "Give tips for a long car journey with children.",
)

# Words the keyword templates draw from: `_KEYWORDS` must appear, `_FORBIDDEN` must not. The two
# lists share no word, so one prompt never asks for and forbids the same word.
_KEYWORDS = (
    "garden", "window", "morning", "river", "promise", "lantern", "music", "orange",
    "meadow", "kitchen", "weather", "friendship", "silver", "breakfast", "candle", "harbour",
)  # fmt: skip
_FORBIDDEN = ("very", "really", "just", "thing", "good", "nice", "great", "also", "important", "always")
# Letters for the letter-count template: common ones to use often, rare ones to avoid (no keyword
# above holds a rare one).
_COMMON_LETTERS = ("e", "a", "o", "t", "s")
_RARE_LETTERS = ("z", "q", "x", "j")
_END_PHRASES = (
    "That is all for now.", "Thanks for reading.", "Hope this helps.", "Have a lovely day.", "See you soon.",
)  # fmt: skip


@dataclass(frozen=True)
class Template:
    """One constraint: an IFEval instruction id, the groups it cannot share a prompt with another
    template of, and `draw(rng, request) -> (kwargs, text)`: arguments drawn from their range and
    the sentence that asks for them."""

    id: str
    groups: frozenset[str]
    draw: Callable[[random.Random, str], tuple[dict, str]]


def _fixed(text: str) -> Callable[[random.Random, str], tuple[dict, str]]:
    return lambda rng, request: ({}, text)


def _words(rng: random.Random, request: str) -> tuple[dict, str]:
    if rng.random() < 0.5:
        n = rng.choice((30, 40, 50, 60, 80))
        return {"num_words": n, "relation": LESS_THAN}, f"Answer in fewer than {n} words."
    n = rng.choice((15, 20, 25, 30, 40))
    return {"num_words": n, "relation": AT_LEAST}, f"Use at least {n} words."


def _sentences(rng: random.Random, request: str) -> tuple[dict, str]:
    if rng.random() < 0.5:
        n = rng.randint(2, 5)
        return {"num_sentences": n, "relation": LESS_THAN}, f"Write fewer than {n} sentences."
    n = rng.randint(2, 4)
    return {"num_sentences": n, "relation": AT_LEAST}, f"Write at least {n} sentences."


def _paragraphs(rng: random.Random, request: str) -> tuple[dict, str]:
    n = rng.randint(2, 3)
    return {"num_paragraphs": n}, f"Write exactly {n} paragraphs, with the markdown divider *** between them."


def _keywords(rng: random.Random, request: str) -> tuple[dict, str]:
    words = rng.sample(_KEYWORDS, rng.randint(1, 2))
    quoted = " and ".join(f"'{w}'" for w in words)
    return {"keywords": words}, f"Include the word{'s' if len(words) > 1 else ''} {quoted} in your answer."


def _keyword_count(rng: random.Random, request: str) -> tuple[dict, str]:
    word, n = rng.choice(_KEYWORDS), rng.randint(2, 3)
    return {"keyword": word, "frequency": n, "relation": AT_LEAST}, f"Use the word '{word}' at least {n} times."


def _forbidden(rng: random.Random, request: str) -> tuple[dict, str]:
    # Never a word of the request itself: "repeat the request" would then break the rule.
    said = set(re.findall(r"\w+", request.lower()))
    words = rng.sample([w for w in _FORBIDDEN if w not in said], rng.randint(1, 3))
    return {"forbidden_words": words}, f"Do not use these words: {', '.join(words)}."


def _letters(rng: random.Random, request: str) -> tuple[dict, str]:
    if rng.random() < 0.5:
        letter, n = rng.choice(_COMMON_LETTERS), rng.choice((10, 15, 20))
        args = {"letter": letter, "let_frequency": n, "let_relation": AT_LEAST}
        return args, f"The letter '{letter}' should appear at least {n} times."
    # A rare letter the request lacks, so that repeating the request cannot break the rule.
    letter, n = rng.choice([c for c in _RARE_LETTERS if c not in request.lower()]), rng.randint(1, 3)
    args = {"letter": letter, "let_frequency": n, "let_relation": LESS_THAN}
    if n == 1:
        return args, f"Do not use the letter '{letter}' at all."
    return args, f"The letter '{letter}' should appear fewer than {n} times."


def _capital_words(rng: random.Random, request: str) -> tuple[dict, str]:
    n = rng.randint(2, 4)
    if rng.random() < 0.5:
        args = {"capital_frequency": n, "capital_relation": AT_LEAST}
        return args, f"Write at least {n} words in all capital letters."
    args = {"capital_frequency": n, "capital_relation": LESS_THAN}
    return args, f"Write fewer than {n} words in all capital letters."


def _postscript(rng: random.Random, request: str) -> tuple[dict, str]:
    marker = rng.choice(("P.S.", "P.P.S"))
    return {"postscript_marker": marker}, f"End with a postscript that starts with {marker.rstrip('.')}."


def _placeholders(rng: random.Random, request: str) -> tuple[dict, str]:
    n = rng.randint(1, 2)
    what = "a placeholder" if n == 1 else f"at least {n} placeholders"
    return {"num_placeholders": n}, f"Include {what} in square brackets, like [name]."


def _bullets(rng: random.Random, request: str) -> tuple[dict, str]:
    n = rng.randint(2, 4)
    return {"num_bullets": n}, f"Give exactly {n} bullet points, each on its own line starting with '* '."


def _highlights(rng: random.Random, request: str) -> tuple[dict, str]:
    n = rng.randint(1, 2)
    what = "one part" if n == 1 else f"at least {n} parts"
    return {"num_highlights": n}, f"Highlight {what} of your answer with markdown, like *this*."


def _sections(rng: random.Random, request: str) -> tuple[dict, str]:
    splitter, n = rng.choice(("Section", "Part")), rng.randint(2, 3)
    text = f"Split your answer into {n} sections, each starting with '{splitter} X' ({splitter} 1, {splitter} 2...)."
    return {"section_spliter": splitter, "num_sections": n}, text


def _end_phrase(rng: random.Random, request: str) -> tuple[dict, str]:
    phrase = rng.choice(_END_PHRASES)
    return {"end_phrase": phrase}, f"Finish your answer with the exact phrase '{phrase}' and nothing after it."


def _repeat(rng: random.Random, request: str) -> tuple[dict, str]:
    return {"prompt_to_repeat": request}, "Start by repeating the request word for word, then answer it."


def _g(*names: str) -> frozenset[str]:
    return frozenset(names)


# Groups: "case" (how letters are cased; section markers are matched with their case),
# "structure" (how the answer is laid out), "ending" and "opening" (what comes last or first),
# "length" (one count of size), "keywords" (one word list to use), "comma" (JSON and a repeated
# request may need commas), "markup" (JSON has no room for titles, highlights or placeholders
# outside its strings).
TEMPLATES = (
    Template("punctuation:no_comma", _g("comma"), _fixed("Do not use any commas.")),
    Template("change_case:english_lowercase", _g("case"), _fixed("Write only in lowercase letters, with no capitals.")),
    Template("change_case:english_capital", _g("case"), _fixed("Write your whole answer in capital letters.")),
    Template("change_case:capital_word_frequency", _g("case"), _capital_words),
    Template("length_constraints:number_words", _g("length"), _words),
    Template("length_constraints:number_sentences", _g("length", "structure"), _sentences),
    Template("length_constraints:number_paragraphs", _g("structure"), _paragraphs),
    Template("keywords:existence", _g("keywords"), _keywords),
    Template("keywords:frequency", _g("keywords"), _keyword_count),
    Template("keywords:forbidden_words", _g(), _forbidden),
    Template("keywords:letter_frequency", _g(), _letters),
    Template("detectable_content:postscript", _g("ending"), _postscript),
    Template("detectable_content:number_placeholders", _g("markup"), _placeholders),
    Template("detectable_format:number_bullet_lists", _g("structure"), _bullets),
    Template("detectable_format:number_highlighted_sections", _g("markup"), _highlights),
    Template(
        "detectable_format:title",
        _g("markup"),
        _fixed("Give your answer a title in double angle brackets, like <<A Title>>."),
    ),  # noqa: E501
    Template("detectable_format:multiple_sections", _g("structure", "case"), _sections),
    Template(
        "detectable_format:json_format",
        _g("structure", "ending", "opening", "comma", "markup", "case"),
        _fixed("Write your whole answer as valid JSON."),
    ),  # noqa: E501
    Template("startend:end_checker", _g("ending"), _end_phrase),
    Template(
        "startend:quotation", _g("ending", "opening"), _fixed("Put your whole answer inside double quotation marks.")
    ),  # noqa: E501
    Template("combination:repeat_prompt", _g("opening", "comma"), _repeat),
    Template(
        "combination:two_responses",
        _g("structure", "ending"),
        _fixed("Give two different answers, separated by six asterisks: ******."),
    ),  # noqa: E501
)
TEMPLATE_IDS = tuple(t.id for t in TEMPLATES)
_BY_ID = {t.id: t for t in TEMPLATES}


def is_held_out(request: str, held_out_fraction: float) -> bool:
    """Stable split membership by a hash of the request (see the module docstring)."""
    h = int.from_bytes(hashlib.sha256(request.encode()).digest()[:8], "big")
    return (h % 10_000) < held_out_fraction * 10_000


def split_requests(split: str, held_out_fraction: float) -> list[str]:
    want_test = split == "test"
    return [r for r in REQUESTS if is_held_out(r, held_out_fraction) == want_test]


def templates_for(types: list[str] | tuple[str, ...] | None) -> tuple[Template, ...]:
    """The templates named by `types` (all when empty or None); ValueError naming unknown ids."""
    if not types:
        return TEMPLATES
    unknown = [t for t in types if t not in _BY_ID]
    if unknown:
        named = ", ".join(map(repr, unknown))
        raise ValueError(f"no instruction template for {named}; the generator writes: {', '.join(TEMPLATE_IDS)}")
    return tuple(_BY_ID[t] for t in dict.fromkeys(types))


def draw_constraints(rng: random.Random, request: str, templates: tuple[Template, ...], count: int) -> list[tuple]:
    """Up to `count` (template, kwargs, text) of templates sharing no group, in a random order
    (fewer when the templates given cannot make `count` compatible constraints)."""
    chosen: list[tuple] = []
    used: set[str] = set()
    for template in rng.sample(templates, len(templates)):
        if len(chosen) == count:
            break
        if template.groups & used:
            continue
        used |= template.groups
        kwargs, text = template.draw(rng, request)
        chosen.append((template, kwargs, text))
    return chosen


def row_for(request: str, constraints: list[tuple]) -> dict:
    """A task-schema row: the request, then each constraint's sentence; the constraints in
    `verification_info`. The id is a hash of the prompt and the constraints."""
    prompt = " ".join([request, *(text for _, _, text in constraints)])
    info = {"instruction_id_list": [t.id for t, _, _ in constraints], "kwargs": [k for _, k, _ in constraints]}
    digest = hashlib.sha256(json.dumps([prompt, info], sort_keys=True).encode()).hexdigest()[:12]
    return {
        "problem_id": f"instr-{digest}",
        "task_type": TASK_TYPE,
        "prompt": prompt,
        "verification_info": json.dumps(info),
        "constraints": len(constraints),
    }


def options(tasks) -> dict:
    """The generate() keywords a run's tasks config sets beyond size, split and seed."""
    return {
        "max_constraints": tasks.max_constraints,
        "types": tuple(tasks.instruction_types),
        "held_out_fraction": tasks.held_out_fraction,
    }


def generate(
    n: int,
    *,
    split: str = "train",
    held_out_fraction: float = 0.1,
    max_constraints: int = 3,
    types: tuple[str, ...] = (),
    seed: int = 0,
) -> list[dict]:
    """`n` distinct rows of one split, each a request of that split with 1 to `max_constraints`
    constraints (uniform) from the templates named in `types` (all when empty). Deterministic
    given the arguments."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if max_constraints < 1:
        raise ValueError(f"max_constraints must be at least 1, got {max_constraints}")
    templates = templates_for(types)
    requests = split_requests(split, held_out_fraction)
    if not requests:
        raise ValueError(
            f"held_out_fraction={held_out_fraction} leaves no request in split {split!r}; "
            f"there are {len(REQUESTS)} requests in all: move it away from 0 and 1"
        )
    rng = random.Random(f"instructions-{seed}-{split}-{max_constraints}-{','.join(t.id for t in templates)}")
    rows, seen = [], set()
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 50 * n + 1000:
            raise ValueError(
                f"asked for {n} distinct instruction prompts in split {split!r}, but {len(requests)} requests "
                f"and {len(templates)} templates make too few: lower `n`, or allow more templates or constraints"
            )
        request = rng.choice(requests)
        constraints = draw_constraints(rng, request, templates, rng.randint(1, max_constraints))
        row = row_for(request, constraints)
        if row["problem_id"] in seen:
            continue
        seen.add(row["problem_id"])
        rows.append(row)
    return rows
