"""IFEval's 25 instruction types (Zhou et al. 2023, "Instruction-Following Evaluation for Large
Language Models"), with the reference checkers' semantics.

Where the reference builds a regular expression from a row's argument (a keyword, a section
splitter, a postscript marker), the argument is matched literally here; where its own regular
expressions can take quadratic time on hostile text, the same matches are found by a linear scan.
docs/instructions.md lists both.
"""

from __future__ import annotations

import collections
import json
import re

from swarmrl.rewards.instructions import text
from swarmrl.rewards.instructions.spec import COUNT, RELATION, TEXT, TEXTS, Instruction, compare


def keyword_existence(response: str, *, keywords: list[str]) -> bool:
    lowered = response.lower()
    return all(keyword.lower() in lowered for keyword in keywords)


def keyword_frequency(response: str, *, keyword: str, frequency: int, relation: str) -> bool:
    pattern = re.compile(re.escape(keyword.strip()), re.IGNORECASE)
    return compare(sum(1 for _ in pattern.finditer(response)), relation, frequency)


def forbidden_words(response: str, *, forbidden_words: list[str]) -> bool:
    return not any(
        re.search(r"\b" + re.escape(word) + r"\b", response, flags=re.IGNORECASE) for word in set(forbidden_words)
    )


def letter_frequency(response: str, *, letter: str, let_frequency: int, let_relation: str) -> bool:
    count = collections.Counter(response.lower())[letter.strip().lower()]
    return compare(count, let_relation, let_frequency)


def response_language(response: str, *, language: str) -> bool:
    detected = text.detect_language(response)
    # The reference counts text no language can be read from (digits, symbols) as followed.
    return detected is None or detected == language


def number_sentences(response: str, *, num_sentences: int, relation: str) -> bool:
    return compare(len(text.punkt_sentences(response)), relation, num_sentences)


def number_paragraphs(response: str, *, num_paragraphs: int) -> bool:
    """Paragraphs separated by the markdown divider ``***``; an empty one counts only at either end
    (where it is dropped), an empty one inside fails."""
    paragraphs = re.split(r"\s?\*\*\*\s?", response)
    count = len(paragraphs)
    for index, paragraph in enumerate(paragraphs):
        if not paragraph.strip():
            if index in (0, len(paragraphs) - 1):
                count -= 1
            else:
                return False
    return count == num_paragraphs


def number_words(response: str, *, num_words: int, relation: str) -> bool:
    return compare(text.count_words(response), relation, num_words)


def nth_paragraph_first_word(response: str, *, num_paragraphs: int, nth_paragraph: int, first_word: str) -> bool:
    """Exactly ``num_paragraphs`` paragraphs split by blank lines (``\\n\\n``), the nth starting
    with ``first_word`` (case-insensitive, leading quotes and trailing punctuation ignored)."""
    paragraphs = response.split("\n\n")
    count = sum(1 for paragraph in paragraphs if paragraph.strip())
    if nth_paragraph > count or nth_paragraph < 1:
        return False
    paragraph = paragraphs[nth_paragraph - 1].strip()
    if not paragraph:
        return False
    word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
    first = ""
    for char in word:
        if char in ".,?!'\"":
            break
        first += char.lower()
    return count == num_paragraphs and first == first_word.lower()


def count_placeholders(response: str) -> int:
    """How many ``[...]`` spans a line holds, as ``re.findall(r"\\[.*?\\]")`` counts them, but in
    linear time (the regular expression rescans a line for every unclosed ``[``)."""
    count = 0
    for line in response.split("\n"):
        position = 0
        while (start := line.find("[", position)) >= 0:
            end = line.find("]", start + 1)
            if end < 0:
                break  # no "]" after this "[", so none after any later one either
            count += 1
            position = end + 1
    return count


def number_placeholders(response: str, *, num_placeholders: int) -> bool:
    return count_placeholders(response) >= num_placeholders


def postscript(response: str, *, postscript_marker: str) -> bool:
    lowered = response.lower()
    marker = postscript_marker.strip()
    if marker == "P.P.S":
        pattern = r"p\.\s?p\.\s?s"
    elif marker == "P.S.":
        pattern = r"p\.\s?s\."
    else:
        pattern = re.escape(marker.lower())
    return re.search(pattern, lowered) is not None


def count_bullets(response: str) -> int:
    """Lines that start (after whitespace) with ``*`` and a character other than ``*`` (markdown
    bullets, not bold), or with ``-``."""
    count = 0
    lines = response.split("\n")
    for index, line in enumerate(lines):
        stripped = line.lstrip()
        if stripped.startswith("-"):
            count += 1
        elif stripped.startswith("*"):
            # A lone "*" ends its line: the reference's [^*] then takes the line break.
            follows = stripped[1:2] or ("\n" if index < len(lines) - 1 else "")
            if follows and follows != "*":
                count += 1
    return count


def number_bullet_lists(response: str, *, num_bullets: int) -> bool:
    return count_bullets(response) == num_bullets


CONSTRAINED_RESPONSES = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


def constrained_response(response: str) -> bool:
    stripped = response.strip()
    return any(option in stripped for option in CONSTRAINED_RESPONSES)


def number_highlighted_sections(response: str, *, num_highlights: int) -> bool:
    """``*highlighted*`` spans (one line, not empty), plus ``**bold**`` spans counted again."""
    singles = re.findall(r"\*[^\n\*]*\*", response)
    doubles = re.findall(r"\*\*[^\n\*]*\*\*", response)
    count = sum(1 for span in singles if span.strip("*").strip())
    count += sum(1 for span in doubles if span[2:-2].strip())
    return count >= num_highlights


def multiple_sections(response: str, *, section_spliter: str, num_sections: int) -> bool:
    """Sections headed by the splitter and a number ("SECTION 1"); text before the first counts
    for nothing."""
    splitter = r"\s?" + re.escape(section_spliter.strip()) + r"\s?\d+\s?"
    return len(re.split(splitter, response)) - 1 >= num_sections


def json_format(response: str) -> bool:
    stripped = response.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        stripped = stripped.removeprefix(prefix)
    stripped = stripped.removesuffix("```").strip()
    try:
        json.loads(stripped)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        return False
    return True


def title(response: str) -> bool:
    """A ``<<title>>`` on one line, with something in it. As the reference's greedy
    ``<<[^\\n]+>>`` reads a line: from its first ``<<`` to its last ``>>``, scanned once."""
    for line in response.split("\n"):
        start = line.find("<<")
        end = line.rfind(">>")
        if start >= 0 and end >= start + 3 and line[start : end + 2].lstrip("<").rstrip(">").strip():
            return True
    return False


def two_responses(response: str) -> bool:
    """Two different responses separated by ``******`` (empty parts allowed only at either end)."""
    parts = response.split("******")
    kept = []
    for index, part in enumerate(parts):
        if part.strip():
            kept.append(part)
        elif index not in (0, len(parts) - 1):
            return False
    return len(kept) == 2 and kept[0].strip() != kept[1].strip()


def repeat_prompt(response: str, *, prompt_to_repeat: str) -> bool:
    return response.strip().lower().startswith(prompt_to_repeat.strip().lower())


def end_checker(response: str, *, end_phrase: str) -> bool:
    return response.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def capital_word_frequency(response: str, *, capital_frequency: int, capital_relation: str) -> bool:
    capitals = sum(1 for token in text.word_tokenize(response) if token.isupper())
    return compare(capitals, capital_relation, capital_frequency)


def english_capital(response: str) -> bool:
    return response.isupper() and text.detect_language(response) in ("en", None)


def english_lowercase(response: str) -> bool:
    return response.islower() and text.detect_language(response) in ("en", None)


def no_comma(response: str) -> bool:
    return "," not in response


def quotation(response: str) -> bool:
    stripped = response.strip()
    return len(stripped) > 1 and stripped[0] == '"' and stripped[-1] == '"'


INSTRUCTIONS = [
    Instruction("keywords:existence", keyword_existence, {"keywords": TEXTS}),
    Instruction("keywords:frequency", keyword_frequency, {"keyword": TEXT, "frequency": COUNT, "relation": RELATION}),
    Instruction("keywords:forbidden_words", forbidden_words, {"forbidden_words": TEXTS}),
    Instruction(
        "keywords:letter_frequency",
        letter_frequency,
        {"letter": TEXT, "let_frequency": COUNT, "let_relation": RELATION},
    ),
    Instruction("language:response_language", response_language, {"language": TEXT}),
    Instruction(
        "length_constraints:number_sentences", number_sentences, {"num_sentences": COUNT, "relation": RELATION}
    ),
    Instruction("length_constraints:number_paragraphs", number_paragraphs, {"num_paragraphs": COUNT}),
    Instruction("length_constraints:number_words", number_words, {"num_words": COUNT, "relation": RELATION}),
    Instruction(
        "length_constraints:nth_paragraph_first_word",
        nth_paragraph_first_word,
        {"num_paragraphs": COUNT, "nth_paragraph": COUNT, "first_word": TEXT},
    ),
    Instruction("detectable_content:number_placeholders", number_placeholders, {"num_placeholders": COUNT}),
    Instruction("detectable_content:postscript", postscript, {"postscript_marker": TEXT}),
    Instruction("detectable_format:number_bullet_lists", number_bullet_lists, {"num_bullets": COUNT}),
    Instruction("detectable_format:constrained_response", constrained_response, {}),
    Instruction(
        "detectable_format:number_highlighted_sections", number_highlighted_sections, {"num_highlights": COUNT}
    ),
    Instruction(
        "detectable_format:multiple_sections", multiple_sections, {"section_spliter": TEXT, "num_sections": COUNT}
    ),
    Instruction("detectable_format:json_format", json_format, {}),
    Instruction("detectable_format:title", title, {}),
    Instruction("combination:two_responses", two_responses, {}),
    Instruction("combination:repeat_prompt", repeat_prompt, {"prompt_to_repeat": TEXT}),
    Instruction("startend:end_checker", end_checker, {"end_phrase": TEXT}),
    Instruction(
        "change_case:capital_word_frequency",
        capital_word_frequency,
        {"capital_frequency": COUNT, "capital_relation": RELATION},
    ),
    Instruction("change_case:english_capital", english_capital, {}),
    Instruction("change_case:english_lowercase", english_lowercase, {}),
    Instruction("punctuation:no_comma", no_comma, {}),
    Instruction("startend:quotation", quotation, {}),
]
