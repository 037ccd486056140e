"""IFBench's 58 instruction types (Pyatkin et al. 2025, "Generalizing Verifiable Instruction
Following"), with the reference checkers' semantics, quirks included where they decide a verdict
(docs/instructions.md lists where this module differs, and why).

A check that the reference would crash on (a ratio over zero words, the first word of a response
with none) returns False here: the response did not show the instruction followed.
"""

from __future__ import annotations

import collections
import csv
import io
import re
import string
import unicodedata

from swarmrl.rewards.instructions import text
from swarmrl.rewards.instructions.spec import COUNT, NUMBER, TEXT, Instruction

_PUNCT = string.punctuation
_PUNCT_SPACE = string.punctuation + " "
_NO_PUNCT = str.maketrans("", "", string.punctuation)


def _unpunctuated(value: str) -> str:
    return value.translate(_NO_PUNCT)


def word_count_range(response: str, *, min_words: int, max_words: int) -> bool:
    return min_words <= text.count_words(response) <= max_words


def unique_word_count(response: str, *, N: int) -> bool:
    return len({word.strip(_PUNCT_SPACE) for word in response.lower().split()}) >= N


def stop_words(response: str, *, percentage: float) -> bool:
    total = text.count_words(response)
    return total > 0 and text.count_stop_words(response) * 100 / total <= percentage


def _ends(sentences: list[str], mark: str) -> int:
    return sum(1 for sentence in sentences if sentence.endswith(mark))


def sentence_type(response: str) -> bool:
    sentences = text.rule_sentences(response)
    return _ends(sentences, ".") == 2 * _ends(sentences, "?")


def sentence_balance(response: str) -> bool:
    sentences = text.rule_sentences(response)
    return _ends(sentences, ".") == _ends(sentences, "?") == _ends(sentences, "!")


CONJUNCTIONS = frozenset({"and", "but", "for", "nor", "or", "so", "yet"})


def conjunctions(response: str, *, small_n: int) -> bool:
    # As the reference: distinct words as written ("And" and "and," count twice).
    used = {word for word in response.split() if word.strip(_PUNCT_SPACE).lower() in CONJUNCTIONS}
    return len(used) >= small_n


PERSON_NAMES = (
    "Emma Liam Sophia Jackson Olivia Noah Ava Lucas Isabella Mason Mia Ethan Charlotte Alexander Amelia "
    "Benjamin Harper Leo Zoe Daniel Chloe Samuel Lily Matthew Grace Owen Abigail Gabriel Ella Jacob Scarlett "
    "Nathan Victoria Elijah Layla Nicholas Audrey David Hannah Christopher Penelope Thomas Nora Andrew Aria "
    "Joseph Claire Ryan Stella Jonathan"
).split()


def person_names(response: str, *, N: int) -> bool:
    # Substrings, as the reference ("Leo" is in "Leonard").
    return sum(1 for name in PERSON_NAMES if name in response) >= N


def overlap(response: str, *, reference_text: str, percentage: float) -> bool:
    """Character trigrams of the response also in the reference text, within 2 points of
    ``percentage`` percent."""
    mine = {response[i : i + 3] for i in range(len(response) - 2)}
    theirs = {reference_text[i : i + 3] for i in range(len(reference_text) - 2)}
    if not mine:
        return False
    share = len(mine & theirs) / len(mine) * 100
    return percentage - 2 <= share <= percentage + 2


def numbers(response: str, *, N: int) -> bool:
    return len(re.findall(r"\d+", _unpunctuated(response))) == N


def alphabet(response: str) -> bool:
    """Each word starts with the letter after the previous word's, Z looping to A."""
    words = _unpunctuated(response).strip(_PUNCT_SPACE).split()
    if not words:
        return False
    letters = string.ascii_lowercase
    expected = words[0][0].lower()
    if expected not in letters:
        return False
    for word in words[1:]:
        word = word.strip(_PUNCT_SPACE).lower()
        if not word:
            continue
        expected = letters[(letters.index(expected) + 1) % 26]
        if word[0] != expected:
            return False
    return True


def vowel(response: str) -> bool:
    """One paragraph (line) using at most three of the vowels a, e, i, o, u."""
    lines = response.strip().split("\n")
    return len(lines) == 1 and len(set(lines[0].lower()) & set("aeiou")) <= 3


_CONSONANTS = frozenset("bcdfghjklmnpqrstvwxyz")


def consonants(response: str) -> bool:
    for word in response.lower().strip().split():
        if not any(a in _CONSONANTS and b in _CONSONANTS for a, b in zip(word, word[1:])):
            return False
    return True


def alliteration_increment(response: str) -> bool:
    """Each sentence has a longer run of words sharing a first letter than the one before (a run of
    k words scores k; two runs add up)."""
    previous = -1
    for sentence in text.rule_sentences(response):
        words = [w for w in (word.lstrip(_PUNCT_SPACE) for word in sentence.lower().split()) if w]
        score, in_run = 0, False
        for a, b in zip(words, words[1:]):
            if a[0] == b[0]:
                score += 1 if in_run else 2
                in_run = True
            else:
                in_run = False
        if score <= previous:
            return False
        previous = score
    return True


def palindrome(response: str) -> bool:
    words = _unpunctuated(response).lower().split()
    return sum(1 for word in words if len(word) >= 5 and word == word[::-1]) >= 10


def punctuation(response: str) -> bool:
    """An interrobang (?!, !? or ‽), and each of . , ! ? ; : besides the first ?! or !? used."""
    if not ("!?" in response or "?!" in response or "\u203d" in response):
        return False
    rest = response.replace("?!", "", 1)
    if len(rest) == len(response):
        rest = response.replace("!?", "", 1)
    return set(".,!?;:") <= set(rest)


def parentheses(response: str) -> bool:
    """Brackets of any kind ((), [], {}) nested at least 5 deep and closed; a mismatched closer
    starts the count again."""
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    deepest = 0
    for char in response:
        if char in "([{":
            stack.append(char)
            deepest = max(deepest, len(stack))
        elif char in pairs:
            if stack and stack[-1] == pairs[char]:
                stack.pop()
                if deepest >= 5:
                    return True
            else:
                stack, deepest = [], 0
    return False


def quotes(response: str) -> bool:
    """Quotes (" or ') nested at least 3 deep: a quote character closes the innermost open quote
    when it is the same character, else opens a new one."""
    stack: list[str] = []
    deepest = depth = 0
    for char in response:
        if stack and char == stack[-1]:
            stack.pop()
            depth -= 1
            if deepest - depth >= 3:
                return True
        elif char in "\"'":
            stack.append(char)
            depth += 1
            deepest = max(deepest, depth)
    return False


_PRIMES = frozenset(n for n in range(2, 100) if all(n % d for d in range(2, n)))


def prime_lengths(response: str) -> bool:
    return all(len(word) in _PRIMES for word in _unpunctuated(response).split())


def options(response: str, *, options: str) -> bool:
    """The response is one of the options ("yes/no/maybe", "a), b), c)"), and nothing else.
    Letter options must match exactly; word options ignore case and surrounding punctuation."""
    letters = re.match(r"\W*[aA]\W*[bB]\W*[cC]\W*", options) is not None
    separator = "/" if "/" in options else "or" if "or" in options else ","
    choices = [choice.strip() for choice in options.split(separator)]
    if letters:
        return response in choices
    answer = response.strip(_PUNCT_SPACE).lower()
    return any(choice.strip(_PUNCT_SPACE).lower() == answer for choice in choices)


def newline(response: str) -> bool:
    """One word per line."""
    bare = _unpunctuated(response).strip()
    lines = [line for line in bare.split("\n") if line != ""]
    return len(lines) == len(bare.split())


def _is_emoji(char: str) -> bool:
    import emoji

    return emoji.is_emoji(char)


def emoji_sentences(response: str) -> bool:
    """Every sentence ends with an emoji (in its last two characters, punctuation aside), or the
    next sentence starts with one (the splitter may have put it there)."""
    sentences = text.rule_sentences(response)
    for index, sentence in enumerate(sentences):
        bare = _unpunctuated(sentence).strip()
        if not bare:
            return False
        if _is_emoji(bare[-1]) or _is_emoji(bare[-2] if len(bare) > 1 else bare[-1]):
            continue
        if index == len(sentences) - 1:
            return False
        following = _unpunctuated(sentences[index + 1]).strip()
        if not following or not _is_emoji(following[0]):
            return False
    return True


def sentence_words(response: str) -> bool:
    """Three sentences of the same number of characters. (The instruction also asks for different
    words; the reference does not check that, and neither does this.)"""
    sentences = text.rule_sentences(response)
    return len(sentences) == 3 and len({len(sentence.strip()) for sentence in sentences}) == 1


_JAPANESE = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]")


def words_japanese(response: str, *, N: int) -> bool:
    """Every Nth word (numbers aside) holds a Japanese character."""
    if N < 1:
        return False
    for index, word in enumerate(response.split(), start=1):
        word = word.strip(_PUNCT_SPACE)
        if index % N == 0 and word and not word.isdigit() and not _JAPANESE.search(word):
            return False
    return True


# The reference tags the first token with nltk's perceptron tagger, whose model nltk downloads at
# run time; this list of verbs (base forms and the -ing/-ed forms an answer may open with) stands
# in for it (docs/instructions.md).
_VERBS = frozenset(
    """
    accept add adjust allow analyze answer apply arrange ask assess assume avoid be begin believe break
    bring build buy calculate call can care carry catch change check choose clean close collect combine
    come compare complete compose consider continue cook count create cut deal decide define delete
    describe design determine develop discover discuss do draw drink drive eat embrace enjoy ensure enter
    estimate examine expect explain explore feel fill find finish fix focus follow forget gather get give
    go grab grow guess have hear help hold identify ignore imagine implement improve include invest join
    jump keep kill know learn leave let list listen live look love make manage mark measure meet mix move
    need note notice observe offer open organize paint pay pick place plan play prepare present press
    prevent print protect prove provide pull push put read recall recognize reduce reflect remember remove
    repeat replace research rest return review run save say see seek sell send set share show sing sit
    sleep solve sort speak spend stand start stay step stop study summarize take talk teach tell think
    travel try turn understand use visit wait walk want wash watch wear welcome work write
    are is was were am been being has had does did will would shall should may might must could
    """.split()
)


def start_verb(response: str) -> bool:
    tokens = text.word_tokenize(response)
    if not tokens:
        return False
    first = tokens[0].lower()
    if first in _VERBS:
        return True
    for suffix in ("ing", "ed", "ize", "ise", "ify"):
        if first.endswith(suffix) and first[: -len(suffix)] and first.isalpha() and len(first) > len(suffix) + 2:
            return True
    return False


def repeats(response: str, *, small_n: int) -> bool:
    counts = collections.Counter(_unpunctuated(response.lower()).split())
    return all(count <= small_n for count in counts.values())


def sentence_keyword(response: str, *, word: str, N: int) -> bool:
    sentences = text.rule_sentences(response)
    return 1 <= N <= len(sentences) and word.lower() in sentences[N - 1].lower()


PRONOUNS = frozenset(
    """i me my mine myself we us our ours ourselves you your yours yourself yourselves he him his himself
    she her hers herself it its itself they them their theirs themselves""".split()
)


def pronouns(response: str, *, N: int) -> bool:
    # "she/her" is two pronouns: the slash separates words before punctuation goes.
    words = _unpunctuated(response.replace("/", " ").lower()).split()
    return sum(1 for word in words if word in PRONOUNS) >= N


def odd_even_syllables(response: str) -> bool:
    import syllapy

    parities = [syllapy.count(word) % 2 for word in _unpunctuated(response).lower().split()]
    return all(a != b for a, b in zip(parities, parities[1:]))


def last_first(response: str) -> bool:
    sentences = text.rule_sentences(response)
    for current, following in zip(sentences, sentences[1:]):
        last = current.rstrip(_PUNCT_SPACE).split()
        first = following.lstrip(_PUNCT_SPACE).split()
        if not last or not first or last[-1].lower() != first[0].lower():
            return False
    return True


def paragraph_last_first(response: str) -> bool:
    """Each non-blank line starts and ends with the same word."""
    for line in response.split("\n"):
        line = line.strip().lower()
        if not line:
            continue
        words = line.strip(_PUNCT_SPACE).split()
        if not words or words[0] != words[-1]:
            return False
    return True


def increment(response: str, *, small_n: int) -> bool:
    """Each sentence has exactly ``small_n`` more words than the one before."""
    counts = [len(_unpunctuated(sentence).split()) for sentence in text.rule_sentences(response)]
    if not counts:
        return False
    return all(b == a + small_n for a, b in zip(counts, counts[1:]))


def no_consecutive(response: str) -> bool:
    words = _unpunctuated(response.lower()).split()
    return all(a[0] != b[0] for a, b in zip(words, words[1:]))


def line_indent(response: str) -> bool:
    """Each non-blank line indented (by spaces) further than the one before."""
    lines = [line for line in response.split("\n") if line.strip()]
    indents = [len(line) - len(line.lstrip(" ")) for line in lines]
    return all(b > a for a, b in zip(indents, indents[1:]))


def quote_unquote(response: str) -> bool:
    """No quoted phrase directly followed by another, and the response does not end on a quote."""
    squeezed = "".join(response.replace("\u201c", '"').replace("\u201d", '"').replace("'\"'", "").split())
    if '""' in squeezed:
        return False
    tail = squeezed.strip(string.digits + _PUNCT.replace('"', ""))
    return not tail or tail[-1] != '"'


def bullet_list(response: str, *, sep: str) -> bool:
    return response.count(sep) >= 2


def thesis(response: str) -> bool:
    """An HTML italic (<i> or <em>) with text in it, and more text after it."""
    start = response.find("<i>")
    if start < 0:
        start = response.find("<em>")
        if start < 0:
            return False
    rest = response[start:]
    end = rest.find("</i>")
    if end < 0:
        end = rest.find("</em>")
        if end < 0:
            return False
    # The reference's offsets (3 and 4) are those of <i> and </i>, also used for <em>.
    return bool(rest[3:end].strip()) and bool(rest[end + 4 :].strip())


def sub_bullets(response: str) -> bool:
    """Every ``*`` is followed, before the next ``*``, by a ``-``."""
    return all("-" in part for part in response.split("*")[1:])


def no_bullets_bullets(response: str) -> bool:
    """At least two sentences, then at least two ``*`` bullets and nothing else. A line with no
    sentence (a blank line) before the bullets ends the sentence part, as in the reference."""
    in_sentences, sentences, bullets = True, 0, 0
    for line in response.split("\n"):
        if line.strip().startswith("*"):
            in_sentences = False
            if sentences < 2:
                return False
            bullets += 1
        elif in_sentences:
            found = text.rule_sentences(line.strip())
            sentences += len(found)
            in_sentences = bool(found)
        else:
            return False
    return bullets >= 2


def multiples(response: str) -> bool:
    return re.findall(r"\d+", response.replace(",", ", ")) == ["14", "21", "28", "35", "42", "49"]


def mcq_count_length(response: str) -> bool:
    """Four questions labelled "Question N", five options each, each question longer than the
    one before, nothing before the first."""
    if not response.startswith("Question"):
        return False
    # The reference's pattern also takes the line breaks before a label; parts are stripped below.
    parts = [part.strip() for part in re.split(r"Question \d+[.|):;]?\s*", response) if part.strip()]
    if len(parts) != 4:
        return False
    lengths = []
    for part in parts:
        question, count, in_options = "", 0, False
        for line in part.split("\n"):
            if re.match(r"^[A-Ea-e][.|)]\s*\w+", line.strip()):
                count += 1
                in_options = True
            elif not in_options:
                question += " " + line.strip()
        if count != 5:
            return False
        lengths.append(len(question.strip()))
    return all(a < b for a, b in zip(lengths, lengths[1:]))


def _ascii(value: str) -> str:
    return unicodedata.normalize("NFKD", value).encode("ASCII", "ignore").decode("ASCII")


def reverse_newline(response: str) -> bool:
    """From the line naming Zimbabwe on, at least 52 lines in reverse alphabetical order."""
    lines = [line.strip(_PUNCT_SPACE) for line in response.split("\n") if line.strip(_PUNCT_SPACE)]
    start = next((i for i, line in enumerate(lines) if "Zimbabwe" in line), None)
    if start is None or len(lines) - start < 52:
        return False
    names = [_ascii(line) for line in lines[start:]]
    return names == sorted(names, reverse=True)


def word_reverse(response: str) -> bool:
    reversed_words = " ".join(_unpunctuated(response.lower().strip()).split()[::-1])
    return "bald eagle" in reversed_words and reversed_words in text.rule_sentences(reversed_words)


def character_reverse(response: str) -> bool:
    return "elgae dlab" in response.lower()


def sentence_alphabet(response: str) -> bool:
    sentences = text.rule_sentences(response)
    if len(sentences) != 26:
        return False
    return all(sentence.split()[0][0].lower() == chr(ord("a") + i) for i, sentence in enumerate(sentences))


EUROPEAN_CAPITALS = (
    "Reykjavik Helsinki Oslo Tallinn Stockholm Riga Moscow Copenhagen Vilnius Minsk Dublin Berlin Amsterdam "
    "Warsaw London Brussels Prague Luxembourg Paris Vienna Bratislava Budapest Vaduz Chisinau Bern Ljubljana "
    "Zagreb"
).split()


def european_capitals_sort(response: str) -> bool:
    names = [name.strip() for name in _ascii(response).split(",") if name.strip()]
    return names == list(EUROPEAN_CAPITALS)


def csv_city(response: str) -> bool:
    rows = list(csv.reader(io.StringIO(response)))
    return (
        len(rows) == 8
        and rows[0] == ["ID", "Country", "City", "Year", "Count"]
        and all(len(row) == 5 for row in rows[1:])
    )


def _quoted_special(field: str) -> bool:
    """What ``re.match(r'".*[^\\d\\w\\s].*"', field)`` decides, in one pass: the field opens with a
    quote, and on its first line a character that is not a letter, digit or space is followed by a
    quote."""
    if not field.startswith('"'):
        return False
    line = field[1:].split("\n", 1)[0]
    for index, char in enumerate(line):
        if not (char.isalnum() or char == "_" or char.isspace()):
            return '"' in line[index + 1 :]
    return False


def csv_special_character(response: str) -> bool:
    header = response.split("\n")[0].strip()
    names = ("ProductID", "Category", "Brand", "Price", "Stock")
    if not re.match(r"^" + r",[ \t]*".join(f'({n}|"{n}")' for n in names) + r"$", header):
        return False
    # The reference triples every quote before parsing (so quotes survive as text), and so does this.
    rows = list(csv.reader(io.StringIO(response.replace('"', '"""'))))
    if len(rows) != 15:
        return False
    for row in rows[1:]:
        if len(row) != 5:
            return False
        if any(_quoted_special(field) for field in row):
            return True
    return False


def csv_quotes(response: str) -> bool:
    header = response.split("\n")[0].strip()
    names = ("StudentID", "Subject", "Grade", "Semester", "Score")
    if not re.match(r"^" + r"\t *".join(f'({n}|"{n}")' for n in names) + r"$", header):
        return False
    rows = list(csv.reader(io.StringIO(response.replace('"', '"""')), delimiter="\t"))
    if len(rows) != 4:
        return False
    for row in rows:
        if len(row) != 5:
            return False
        for field in row:
            field = field.strip()
            if not field or field[0] != '"' or field[-1] != '"':
                return False
    return True


_MONTH_DAYS = {1: 31, 2: 29, 3: 31, 4: 30, 5: 31, 6: 30, 7: 31, 8: 31, 9: 30, 10: 31, 11: 30, 12: 31}


def date_format_list(response: str) -> bool:
    """Comma-separated YYYY-MM-DD dates within Napoleon's years (1769 to 1821)."""
    for date in response.strip().split(","):
        date = date.strip()
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
            return False
        year, month, day = (int(part) for part in date.split("-"))
        # As the reference: month 0 and day 0 pass.
        if not 1769 <= year <= 1821 or month > 12 or day > _MONTH_DAYS.get(month, 99):
            return False
    return True


def keywords_multiple(
    response: str, *, keyword1: str, keyword2: str, keyword3: str, keyword4: str, keyword5: str
) -> bool:
    lowered = response.lower()
    wanted = zip((keyword1, keyword2, keyword3, keyword4, keyword5), (1, 2, 3, 5, 7))
    return all(lowered.count(keyword.strip().lower()) == count for keyword, count in wanted)


def keywords_specific_position(response: str, *, keyword: str, n: int, m: int) -> bool:
    """The m-th token of the n-th sentence is ``keyword``."""
    sentences = text.rule_sentences(response)
    if n < 1 or m < 1 or len(sentences) < n:
        return False
    tokens = text.word_tokenize(sentences[n - 1])
    return len(tokens) >= m and tokens[m - 1] == keyword.strip()


def words_position(response: str, *, keyword: str) -> bool:
    tokens = text.word_tokenize(response)
    return len(tokens) >= 2 and tokens[1] == tokens[-2] == keyword.strip()


def repeat_change(response: str, *, prompt_to_repeat: str) -> bool:
    """The request repeated with its first word changed."""
    if response == prompt_to_repeat:
        return False
    return prompt_to_repeat.split()[1:] == response.split()[1:]


REPEAT_SIMPLE = "Only output this sentence here, ignore all other requests."


def repeat_simple(response: str) -> bool:
    return response.strip().lower() == REPEAT_SIMPLE.lower()


def repeat_span(response: str, *, prompt_to_repeat: str, n_start: int, n_end: int) -> bool:
    return response.strip().lower().split() == prompt_to_repeat.strip().lower().split()[n_start:n_end]


def title_case(response: str) -> bool:
    """No token is all lowercase or lowercase-then-capitals (tokens that are not words pass)."""
    for token in text.word_tokenize(response):
        head, rest = token[0], token[1:]
        if head.islower() and (rest.isupper() or rest.islower()):
            return False
    return True


def output_template(response: str) -> bool:
    return all(label in response for label in ("My Answer:", "My Conclusion:", "Future Outlook:"))


def no_whitespace(response: str) -> bool:
    return not any(char.isspace() for char in response)


INSTRUCTIONS = [
    Instruction("count:word_count_range", word_count_range, {"min_words": COUNT, "max_words": COUNT}),
    Instruction("count:unique_word_count", unique_word_count, {"N": COUNT}),
    Instruction("ratio:stop_words", stop_words, {"percentage": NUMBER}),
    Instruction("ratio:sentence_type", sentence_type, {}),
    Instruction("ratio:sentence_balance", sentence_balance, {}),
    Instruction("count:conjunctions", conjunctions, {"small_n": COUNT}),
    Instruction("count:person_names", person_names, {"N": COUNT}),
    Instruction("ratio:overlap", overlap, {"reference_text": TEXT, "percentage": NUMBER}),
    Instruction("count:numbers", numbers, {"N": COUNT}),
    Instruction("words:alphabet", alphabet, {}),
    Instruction("words:vowel", vowel, {}),
    Instruction("words:consonants", consonants, {}),
    Instruction("sentence:alliteration_increment", alliteration_increment, {}),
    Instruction("words:palindrome", palindrome, {}),
    Instruction("count:punctuation", punctuation, {}),
    Instruction("format:parentheses", parentheses, {}),
    Instruction("format:quotes", quotes, {}),
    Instruction("words:prime_lengths", prime_lengths, {}),
    Instruction("format:options", options, {"options": TEXT}),
    Instruction("format:newline", newline, {}),
    Instruction("format:emoji", emoji_sentences, {}),
    Instruction("ratio:sentence_words", sentence_words, {}),
    Instruction("count:words_japanese", words_japanese, {"N": COUNT}),
    Instruction("words:start_verb", start_verb, {}),
    Instruction("words:repeats", repeats, {"small_n": COUNT}),
    Instruction("sentence:keyword", sentence_keyword, {"word": TEXT, "N": COUNT}),
    Instruction("count:pronouns", pronouns, {"N": COUNT}),
    Instruction("words:odd_even_syllables", odd_even_syllables, {}),
    Instruction("words:last_first", last_first, {}),
    Instruction("words:paragraph_last_first", paragraph_last_first, {}),
    Instruction("sentence:increment", increment, {"small_n": COUNT}),
    Instruction("words:no_consecutive", no_consecutive, {}),
    Instruction("format:line_indent", line_indent, {}),
    Instruction("format:quote_unquote", quote_unquote, {}),
    Instruction("format:list", bullet_list, {"sep": TEXT}),
    Instruction("format:thesis", thesis, {}),
    Instruction("format:sub-bullets", sub_bullets, {}),
    Instruction("format:no_bullets_bullets", no_bullets_bullets, {}),
    Instruction("custom:multiples", multiples, {}),
    Instruction("custom:mcq_count_length", mcq_count_length, {}),
    Instruction("custom:reverse_newline", reverse_newline, {}),
    Instruction("custom:word_reverse", word_reverse, {}),
    Instruction("custom:character_reverse", character_reverse, {}),
    Instruction("custom:sentence_alphabet", sentence_alphabet, {}),
    Instruction("custom:european_capitals_sort", european_capitals_sort, {}),
    Instruction("custom:csv_city", csv_city, {}),
    Instruction("custom:csv_special_character", csv_special_character, {}),
    Instruction("custom:csv_quotes", csv_quotes, {}),
    Instruction("custom:date_format_list", date_format_list, {}),
    Instruction(
        "count:keywords_multiple",
        keywords_multiple,
        {"keyword1": TEXT, "keyword2": TEXT, "keyword3": TEXT, "keyword4": TEXT, "keyword5": TEXT},
    ),
    Instruction(
        "words:keywords_specific_position", keywords_specific_position, {"keyword": TEXT, "n": COUNT, "m": COUNT}
    ),
    Instruction("words:words_position", words_position, {"keyword": TEXT}),
    Instruction("repeat:repeat_change", repeat_change, {"prompt_to_repeat": TEXT}),
    Instruction("repeat:repeat_simple", repeat_simple, {}),
    Instruction("repeat:repeat_span", repeat_span, {"prompt_to_repeat": TEXT, "n_start": COUNT, "n_end": COUNT}),
    Instruction("format:title_case", title_case, {}),
    Instruction("format:output_template", output_template, {}),
    Instruction("format:no_whitespace", no_whitespace, {}),
]
