"""Instruction-following checkers (swarmrl/rewards/instructions): every IFEval and IFBench type
with a hand-written response that follows it and one that does not, strict and loose, rows with
several instructions, bad rows, and hostile completions graded within a bound."""

from __future__ import annotations

import json
import time

import pytest

from swarmrl.rewards.instructions import (
    IFBENCH_IDS,
    IFEVAL_IDS,
    INSTRUCTIONS,
    MAX_RESPONSE_CHARS,
    grade_instructions,
    instructions_task_reward,
    loose_variants,
    parse_instructions,
)
from swarmrl.rewards.instructions import text as text_measures

AFRICA = [f"Zimbabwe{chr(ord('z') - i // 26)}{chr(ord('z') - i % 26)}" for i in range(53)]
MCQ = "\n".join(f"Question {n}: {'Why ' * n}art?\nA. one\nB. two\nC. three\nD. four\nE. five" for n in range(1, 5))
CSV_CITY = "ID,Country,City,Year,Count\n" + "\n".join(f"{i},France,Paris,2000,{i}" for i in range(7))
CSV_SPECIAL = "ProductID,Category,Brand,Price,Stock\n" + "\n".join(f'{i},Toys,"Acme & Co",9,1' for i in range(14))
CSV_QUOTES = '"StudentID"\t"Subject"\t"Grade"\t"Semester"\t"Score"\n' + "\n".join(
    f'"{i}"\t"Math"\t"A"\t"Fall"\t"90"' for i in range(3)
)
ALPHABET_STORY = " ".join(f"{chr(ord('A') + i)}ll is well." for i in range(26))

# id: (kwargs, a response that follows it, one that does not)
CASES: dict[str, tuple[dict, str, str]] = {
    "keywords:existence": ({"keywords": ["moon", "tide"]}, "The Moon moves the tide.", "The sun is hot."),
    "keywords:frequency": (
        {"keyword": "cat", "frequency": 2, "relation": "at least"},
        "cat and CAT",
        "one cat",
    ),
    "keywords:forbidden_words": ({"forbidden_words": ["very"]}, "It is every bit good.", "It is Very good."),
    "keywords:letter_frequency": (
        {"letter": "z", "let_frequency": 2, "let_relation": "less than"},
        "one z here",
        "zz top",
    ),
    "language:response_language": (
        {"language": "de"},
        "Das ist ein kurzer deutscher Satz über das Wetter in Berlin und die Stadt.",
        "This is a short English sentence about the weather in London and the city.",
    ),
    "length_constraints:number_sentences": (
        {"num_sentences": 3, "relation": "less than"},
        "One. Two.",
        "One. Two. Three.",
    ),
    "length_constraints:number_paragraphs": ({"num_paragraphs": 2}, "First.\n***\nSecond.", "Only one."),
    "length_constraints:number_words": ({"num_words": 3, "relation": "at least"}, "one two three", "one two"),
    "length_constraints:nth_paragraph_first_word": (
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        'First part.\n\n"Then, more.',
        "First part.\n\nAfter that.",
    ),
    "detectable_content:number_placeholders": ({"num_placeholders": 2}, "[name] at [address]", "[name] only"),
    "detectable_content:postscript": ({"postscript_marker": "P.S."}, "Hi.\nP.S. bye", "Hi. PS bye"),
    "detectable_format:number_bullet_lists": ({"num_bullets": 2}, "* one\n- two", "* one\n**bold**"),
    "detectable_format:constrained_response": ({}, "My answer is yes.", "Yes."),
    "detectable_format:number_highlighted_sections": ({"num_highlights": 2}, "*one* and *two*", "*one* and **"),
    "detectable_format:multiple_sections": (
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\nA\nSection 2\nB",
        "Section 1\nA",
    ),
    "detectable_format:json_format": ({}, '```json\n{"a": 1}\n```', "{a: 1}"),
    "detectable_format:title": ({}, "<<A Title>>\nText", "<< >>\nText"),
    "combination:two_responses": ({}, "First answer.******Second answer.", "Same.******Same."),
    "combination:repeat_prompt": (
        {"prompt_to_repeat": "Write a poem."},
        "write a poem. Roses are red.",
        "Roses are red.",
    ),
    "startend:end_checker": ({"end_phrase": "Any other questions?"}, "Done. Any other questions?", "Done."),
    "change_case:capital_word_frequency": (
        {"capital_frequency": 2, "capital_relation": "at least"},
        "The NASA and ESA teams.",
        "The NASA team.",
    ),
    "change_case:english_capital": ({}, "THIS IS ALL IN CAPITAL LETTERS, IN ENGLISH.", "This is not all capitals."),
    "change_case:english_lowercase": ({}, "this is all lowercase english text.", "This is Not lowercase."),
    "punctuation:no_comma": ({}, "No commas here.", "One, two."),
    "startend:quotation": ({}, '"Wrapped in quotes."', "Not wrapped."),
    "count:word_count_range": ({"min_words": 2, "max_words": 3}, "two words", "just"),
    "count:unique_word_count": ({"N": 3}, "a b c", "a a a b"),
    "ratio:stop_words": ({"percentage": 50}, "Cats chase mice", "the of and cats"),
    "ratio:sentence_type": ({}, "Yes. No. Why?", "Yes. Why?"),
    "ratio:sentence_balance": ({}, "Yes. Why? Wow!", "Yes. No. Why?"),
    "count:conjunctions": ({"small_n": 2}, "this and that but not so", "this and that"),
    "count:person_names": ({"N": 2}, "Emma met Noah.", "Emma met Bob."),
    "ratio:overlap": ({"reference_text": "abcdef", "percentage": 100}, "abcd", "xyz1"),
    "count:numbers": ({"N": 2}, "I have 3 cats and 12 dogs.", "I have 3.5 cats."),
    "words:alphabet": ({}, "Apples bake cleanly, daily.", "Apples cook."),
    "words:vowel": ({}, "a cat had a bag", "a dog ate a pie\nnext line"),
    "words:consonants": ({}, "strong trees", "strong tree a"),
    "sentence:alliteration_increment": ({}, "Big bad. Silly snakes sleep.", "Big bad wolf. Silly cat."),
    "words:palindrome": ({}, " ".join(["level", "radar", "civic", "refer", "rotor"] * 2), "level radar civic"),
    "count:punctuation": ({}, "Really?! Yes. No, maybe; fine: ok!?", "Really?! Yes."),
    "format:parentheses": ({}, "(a [b {c (d [e])}])", "(a [b {c}])"),
    "format:quotes": ({}, '"He said \'she said "no"\'"', "\"He said 'hi'\""),
    "words:prime_lengths": ({}, "an owl had seven wings", "a cat"),
    "format:options": ({"options": "yes/no/maybe"}, "Maybe.", "Maybe not."),
    "format:newline": ({}, "one\ntwo\nthree", "one two\nthree"),
    "format:emoji": ({}, "I like tea \U0001f375. Sun \u2600\ufe0f.", "I like tea. Sun \u2600\ufe0f."),
    "ratio:sentence_words": ({}, "Cat ran. Dog sat. Owl hid.", "Cat ran. Dog sat down. Owl hid."),
    "count:words_japanese": ({"N": 2}, "one 二 three 四", "one two three 四"),
    "words:start_verb": ({}, "Imagine a world.", "The world."),
    "words:repeats": ({"small_n": 1}, "one two three", "one one two"),
    "sentence:keyword": ({"word": "moon", "N": 2}, "Sun is hot. The Moon is cold.", "The moon. The sun."),
    "count:pronouns": ({"N": 2}, "She told him.", "The cat slept."),
    "words:odd_even_syllables": ({}, "cat apple dog", "cat dog"),
    "words:last_first": ({}, "I love tea. Tea loves me.", "I love tea. Coffee loves me."),
    "words:paragraph_last_first": ({}, "Go now, go.\nStay here and stay", "Go now.\nStay"),
    "sentence:increment": ({"small_n": 1}, "One. One two. One two three.", "One. One two three."),
    "words:no_consecutive": ({}, "a big cat", "big bad cat"),
    "format:line_indent": ({}, "a\n b\n  c", "a\n  b\n c"),
    "format:quote_unquote": ({}, 'He said "hi" to me.', 'He said "hi"'),
    "format:list": ({"sep": "SEPARATOR"}, "SEPARATOR a SEPARATOR b", "SEPARATOR a"),
    "format:thesis": ({}, "<i>Cats rule.</i> Indeed they do.", "<i>Cats rule.</i>"),
    "format:sub-bullets": ({}, "* a\n  - a1\n* b\n  - b1", "* a\n  - a1\n* b"),
    "format:no_bullets_bullets": ({}, "One. Two.\n* a\n* b", "One.\n* a\n* b"),
    "custom:multiples": ({}, "14, 21, 28, 35, 42, 49", "7, 14, 21, 28, 35, 42, 49"),
    "custom:mcq_count_length": ({}, MCQ, "Intro\n" + MCQ),
    "custom:reverse_newline": ({}, "\n".join(AFRICA), "\n".join(reversed(AFRICA))),
    "custom:word_reverse": ({}, "Eagle bald the is symbol the.", "The symbol is the bald eagle."),
    "custom:character_reverse": ({}, "elgae dlab eht", "bald eagle"),
    "custom:sentence_alphabet": ({}, ALPHABET_STORY, "All is well."),
    "custom:european_capitals_sort": (
        {},
        "Reykjavík, Helsinki, Oslo, Tallinn, Stockholm, Riga, Moscow, Copenhagen, Vilnius, Minsk, Dublin, "
        "Berlin, Amsterdam, Warsaw, London, Brussels, Prague, Luxembourg, Paris, Vienna, Bratislava, "
        "Budapest, Vaduz, Chisinau, Bern, Ljubljana, Zagreb",
        "Oslo, Helsinki",
    ),
    "custom:csv_city": ({}, CSV_CITY, CSV_CITY.replace("ID,", "Id,", 1)),
    "custom:csv_special_character": ({}, CSV_SPECIAL, CSV_SPECIAL.replace('"Acme & Co"', "Acme")),
    "custom:csv_quotes": ({}, CSV_QUOTES, CSV_QUOTES.replace('"Math"', "Math")),
    "custom:date_format_list": ({}, "1796-04-12, 1815-06-18", "1796-04-12, 1915-06-18"),
    "count:keywords_multiple": (
        {"keyword1": "a1", "keyword2": "b2", "keyword3": "c3", "keyword4": "d4", "keyword5": "e5"},
        "a1 " + "b2 " * 2 + "c3 " * 3 + "d4 " * 5 + "e5 " * 7,
        "a1 b2",
    ),
    "words:keywords_specific_position": (
        {"keyword": "blue", "n": 2, "m": 3},
        "Hi there. The sky blue is.",
        "Hi there. The blue sky.",
    ),
    "words:words_position": ({"keyword": "big"}, "A big day is big .", "A big day."),
    "repeat:repeat_change": (
        {"prompt_to_repeat": "Tell me a joke."},
        "Give me a joke.",
        "Tell me a joke.",
    ),
    "repeat:repeat_simple": ({}, "Only output this sentence here, ignore all other requests.", "Okay."),
    "repeat:repeat_span": (
        {"prompt_to_repeat": "one two three four", "n_start": 1, "n_end": 3},
        "two three",
        "one two",
    ),
    "format:title_case": ({}, "The Big Red Dog", "The big red dog"),
    "format:output_template": (
        {},
        "My Answer: yes My Conclusion: good Future Outlook: bright",
        "My Answer: yes",
    ),
    "format:no_whitespace": ({}, "no_space_at_all", "some space"),
}


def grade_one(instruction_id: str, kwargs: dict, response: str):
    return grade_instructions({"instruction_id_list": [instruction_id], "kwargs": [kwargs]}, response)


def test_every_type_has_a_case_and_the_counts_are_ifevals_and_ifbenchs():
    assert len(IFEVAL_IDS) == 25 and len(IFBENCH_IDS) == 58
    assert set(CASES) == set(INSTRUCTIONS)


@pytest.mark.parametrize("instruction_id", sorted(CASES))
def test_each_type_passes_and_fails_by_hand(instruction_id):
    kwargs, good, bad = CASES[instruction_id]
    passed = grade_one(instruction_id, kwargs, good)
    assert passed.strict == (True,) and passed.loose == (True,), good
    failed = grade_one(instruction_id, kwargs, bad)
    assert failed.strict == (False,), bad


@pytest.mark.parametrize(
    ("instruction_id", "kwargs", "response"),
    [
        # A preamble line: strict fails, loose (without the first line) passes.
        ("startend:quotation", {}, 'Sure, here it is:\n"Quoted."'),
        # A closing line after the ending phrase.
        ("startend:end_checker", {"end_phrase": "Is there anything else?"}, "Done. Is there anything else?\n-- Bot"),
        # Bold markers: the word count is the same, but the response must be quoted without them.
        ("punctuation:no_comma", {}, "Title, with comma\nNo commas below."),
        ("detectable_format:json_format", {}, 'Here:\n{"a": 1}'),
        ("format:no_whitespace", {}, "Answer:\nnospace"),
        ("change_case:english_lowercase", {}, "**Note**\nthis is all lowercase english text."),
    ],
)
def test_loose_forgives_a_first_or_last_line_or_asterisks(instruction_id, kwargs, response):
    graded = grade_one(instruction_id, kwargs, response)
    assert graded.strict == (False,) and graded.loose == (True,)


def test_loose_variants_are_the_references_eight():
    variants = loose_variants("*a*\nb\n*c*")
    assert variants == ["*a*\nb\n*c*", "a\nb\nc", "b\n*c*", "*a*\nb", "b", "b\nc", "a\nb", "b"]


def test_a_row_with_several_instructions():
    info = {
        "instruction_id_list": ["punctuation:no_comma", "startend:end_checker", "keywords:existence"],
        "kwargs": [{}, {"end_phrase": "Bye."}, {"keywords": ["hello"]}],
    }
    graded = grade_instructions(info, "Hello there. Bye.")
    assert graded.strict == (True, True, True) and graded.all_strict
    assert instructions_task_reward(info, "Hello there. Bye.") == (1.0, None)
    reward, reason = instructions_task_reward(info, "Hello, there.")
    assert reward == 0.0 and "startend:end_checker" in reason and "keywords:existence" not in reason


def test_thinking_is_not_graded_and_an_unclosed_think_follows_nothing():
    info = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    assert grade_instructions(info, "<think>a, b, c</think>\n\nNo commas.").strict == (True,)
    unclosed = grade_instructions(info, "<think>still thinking")
    assert unclosed.strict == (False,) and "never closes" in unclosed.refused


def test_ifbench_files_nulls_and_float_counts_are_accepted():
    kwargs = {"N": 2.0, "capital_frequency": None, "keyword": None}
    assert grade_one("count:numbers", kwargs, "1 and 2").strict == (True,)


@pytest.mark.parametrize(
    ("info", "words"),
    [
        ({"instruction_id_list": ["nope:nothing"], "kwargs": [{}]}, ["instruction_id_list[0]", "punctuation:no_comma"]),
        ({"instruction_id_list": ["keywords:frequency"], "kwargs": [{"keyword": "a"}]}, ["kwargs[0]", "frequency"]),
        (
            {
                "instruction_id_list": ["keywords:frequency"],
                "kwargs": [{"keyword": "a", "frequency": 2, "relation": "about"}],
            },
            ["kwargs[0]", "relation", "at least"],
        ),
        ({"instruction_id_list": ["count:numbers"], "kwargs": [{"N": -1}]}, ["kwargs[0]", "'N'", "non-negative"]),
        ({"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{"extra": 1}]}, ["kwargs[0]", "extra"]),
        ({"instruction_id_list": ["punctuation:no_comma"], "kwargs": []}, ["kwargs", "one object"]),
        ({"instruction_id_list": []}, ["instruction_id_list", "non-empty"]),
    ],
)
def test_bad_rows_are_refused_naming_the_field(info, words):
    with pytest.raises(ValueError) as error:
        parse_instructions(info)
    for word in words:
        assert word in str(error.value)


def test_a_multi_megabyte_completion_is_refused_at_once():
    info = {"instruction_id_list": ["keywords:existence"], "kwargs": [{"keywords": ["x"]}]}
    started = time.monotonic()
    graded = grade_instructions(info, "x, " * 2_000_000)
    assert time.monotonic() - started < 1.0
    assert graded.strict == (False,) and graded.loose == (False,) and str(MAX_RESPONSE_CHARS) in graded.refused


@pytest.mark.parametrize(
    "hostile",
    [
        "[" * MAX_RESPONSE_CHARS,
        "<<" * (MAX_RESPONSE_CHARS // 2),
        "\n" * MAX_RESPONSE_CHARS,
        '"x' * (MAX_RESPONSE_CHARS // 2),
    ],
)
def test_hostile_text_at_the_cap_is_graded_within_a_bound(hostile):
    """The regular expressions of the references that rescan text (placeholders, titles, bullets) are
    linear scans here: every type at once on the longest text graded stays within seconds."""
    ids = sorted(INSTRUCTIONS)
    info = {"instruction_id_list": ids, "kwargs": [CASES[i][0] for i in ids]}
    started = time.monotonic()
    grade_instructions(info, hostile)
    assert time.monotonic() - started < 20.0


def test_sentence_splitters_follow_the_references():
    assert text_measures.punkt_sentences("Dr. Smith arrived. He sat down.") == ["Dr. Smith arrived.", "He sat down."]
    assert text_measures.rule_sentences("Mr. Smith paid $3.50. Then he left!") == [
        "Mr. Smith paid $3.50.",
        "Then he left!",
    ]
    assert text_measures.word_tokenize("Don't stop-now.") == ["Do", "n't", "stop-now", "."]


def test_grading_results_pickle_for_the_pool():
    from swarmrl.rewards.instructions import instructions_detail

    detail = instructions_detail({"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}, "a, b")
    assert json.loads(json.dumps(detail))["follow_instruction_list_strict"] == [False]
