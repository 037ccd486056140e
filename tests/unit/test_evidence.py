"""The sequential test per key (proofs/evidence.py) and the limits it is chosen with (proofs/limits.py),
with hand-computed values."""

from __future__ import annotations

import json
import math
import random

import pytest

from swarmrl.config import Config, load_config
from swarmrl.proofs.evidence import (
    EvidenceModel,
    ban_bound,
    bin_of,
    cusum,
    fit,
    group_llr,
    groups_to_ban,
    simulate_ban,
    upper_bound,
)
from swarmrl.proofs.limits import (
    FORMAT,
    LimitsError,
    choose_limits,
    hard_limits,
    load_limits,
    model_digest,
    refused_by_hard,
    replay_bans,
    run_limits,
)


def test_bins_put_a_value_on_an_edge_in_the_bin_below():
    edges = (0.5, 1.0)
    assert [bin_of(v, edges) for v in (0.1, 0.5, 0.7, 1.0, 1.01)] == [0, 0, 1, 1, 2]


def test_cusum_never_goes_below_zero_and_bans_at_the_bound():
    m = EvidenceModel("x", (1.0,), (-1.0, 2.0), bound=5.0)
    assert group_llr(0.5, m) == -1.0 and group_llr(3.0, m) == 2.0 and group_llr(math.nan, m) == 0.0
    assert cusum(0.5, -1.0) == 0.0 and cusum(1.0, 2.0) == 3.0
    # Scores 2, 1, 3, 5: banned at the fourth group.
    groups = [{"x": v} for v in (3.0, 0.5, 3.0, 3.0)]
    assert simulate_ban([m], groups) == 4
    assert simulate_ban([m], [{"x": 0.1}] * 100) is None
    assert groups_to_ban(m, [3.0, 3.0, 0.5, 0.5]) == pytest.approx(5.0 / 0.5)
    assert math.isinf(groups_to_ban(m, [0.5, 3.0, 0.5]))


def test_the_bound_pays_for_the_horizon_the_rate_and_the_number_of_tests():
    assert ban_bound(1e-6, 100_000) == pytest.approx(math.log(1e11))
    assert ban_bound(1e-6, 100_000, tests=3) == pytest.approx(math.log(3e11))
    with pytest.raises(ValueError):
        ban_bound(0.0, 10)


def test_upper_bounds_are_clopper_pearson():
    # None seen in n: 1 - delta^(1/n) (the "rule of three" at 95 %: about 3/n).
    assert upper_bound(0, 100, 0.95) == pytest.approx(1 - 0.05 ** (1 / 100))
    assert upper_bound(0, 100, 0.95) == pytest.approx(0.0295, abs=2e-4)
    # 5 of 100 at 95 %, one-sided: 0.1023, where the binomial tail P(X <= 5 | p) is 0.05.
    p = upper_bound(5, 100, 0.95)
    assert p == pytest.approx(0.1023, abs=2e-4)
    assert sum(math.comb(100, k) * p**k * (1 - p) ** (100 - k) for k in range(6)) == pytest.approx(0.05, abs=1e-6)
    assert upper_bound(100, 100, 0.95) == 1.0 and upper_bound(0, 0, 0.95) == 1.0


def test_a_fitted_model_keeps_honest_work_a_supermartingale():
    """E_honest[exp(llr)] <= 1 under the honest sample itself (q sums to 1, u bounds p), so no
    honest key can expect to climb; a shifted cheat gains on average."""
    rng = random.Random(0)
    honest = [rng.gauss(1.0, 0.1) for _ in range(500)]
    cheat = [rng.gauss(1.25, 0.1) for _ in range(100)]
    m = fit("s", honest, cheat, bound=25.0)
    assert len(m.llr) == len(m.edges) + 1
    assert sum(math.exp(group_llr(v, m)) for v in honest) / len(honest) <= 1.0
    assert groups_to_ban(m, cheat) < 25
    fresh = [rng.gauss(1.0, 0.1) for _ in range(100_000)]
    assert simulate_ban([m], [{"s": v} for v in fresh]) is None


def _stats(group: float, logprob: float = 0.01, bias: float = 0.001) -> dict:
    return {
        "exp_mismatches_max": 4,
        "mant_err_mean_max": group + 0.3,
        "mant_err_median_max": 1.0,
        "mant_err_group": group,
        "sampling_margin_max": 0.0,
        "logprob_err_max": logprob,
        "logprob_err_mean": logprob / 10,
        "logprob_bias": bias,
    }


def test_hard_limits_sit_beyond_the_honest_worst():
    honest = [_stats(0.5), _stats(0.8, logprob=0.2)]
    lim = hard_limits(honest)
    assert lim["group_mant_err_max"] == pytest.approx(max(0.8 * 1.5, 0.8 + 0.1))
    assert lim["logprob_tol"] == pytest.approx(0.4)
    assert lim["sampling_margin"] == pytest.approx(0.05)  # all honest gaps 0: the floor
    assert lim["exp_mismatches_max"] == 8
    assert not any(refused_by_hard(s, lim) for s in honest)
    assert refused_by_hard(_stats(1.3), lim) and refused_by_hard(_stats(0.5, logprob=0.5), lim)
    # The signed mean logprob error is evidence only: a trained policy's collapsed completions
    # make it one completion's error, which drifted past a limit fitted at v0 on the real model.
    assert "logprob_bias_max" not in lim
    assert not refused_by_hard(_stats(0.5, bias=0.06), lim)


def _calibration(n_honest: int, shift: float, seed: int = 0):
    rng = random.Random(seed)
    honest = {"builtin": [_stats(rng.gauss(0.6, 0.08)) for _ in range(n_honest)]}
    cheats = {
        "int8": [_stats(rng.gauss(0.6 + shift, 0.08)) for _ in range(64)],
        "int4": [_stats(4.0 + rng.random()) for _ in range(16)],
    }
    return honest, cheats


def test_limits_refuse_the_obvious_and_ban_the_subtle_by_evidence():
    honest, cheats = _calibration(400, 0.25)
    chosen = choose_limits(honest, cheats)
    e = chosen["engines"]["builtin"]
    assert "refused" not in e
    assert e["cheats"]["int4"]["refused_by_limits"] == 16  # every group beyond the hard limits
    assert e["cheats"]["int8"]["refused_by_limits"] < 64 and e["cheats"]["int8"]["groups_to_ban"] < 64
    assert [(m["statistic"], m["target"]) for m in e["evidence"]] == [("mant_err_group", "int8")]
    assert e["honest_peak_score"] < e["evidence"][0]["bound"] / 3
    bans = replay_bans(chosen, "builtin", cheats)
    assert bans["int4"] == 3  # ban_after hard refusals
    assert bans["int8"] is not None and bans["int8"] <= 64


def test_an_engine_whose_honest_work_overlaps_a_cheat_is_refused_with_figures():
    honest, cheats = _calibration(400, 0.02)
    e = choose_limits(honest, cheats)["engines"]["builtin"]
    assert "int8" in e["refused"] and "groups to ban" in e["refused"] and "run without this engine" in e["refused"]


def test_the_previous_version_is_measured_but_never_refuses_an_engine():
    # The same overlapping groups that refuse the engine as "int8" are reported, with their groups to
    # ban, as the previous version, and get no test of their own (no share of the bound).
    honest, cheats = _calibration(400, 0.02)
    e = choose_limits(honest, {"previous_version": cheats["int8"]})["engines"]["builtin"]
    row = e["cheats"]["previous_version"]
    assert "refused" not in e and row["informational"] and row["groups_to_ban"] > 64
    assert all(m["target"] != "previous_version" for m in e["evidence"])


def _write(path, **over) -> None:
    honest, cheats = _calibration(200, 0.3)
    data = {"format": FORMAT, "dtype": "bfloat16", "model": {"digest": "a" * 64}, **choose_limits(honest, cheats)}
    data.update(over)
    path.write_text(json.dumps(data))


def test_a_limits_file_for_another_model_or_dtype_is_refused(tmp_path):
    f = tmp_path / "limits.json"
    _write(f)
    assert load_limits(f, dtype="bfloat16", digest="a" * 64)["engines"]["builtin"]["limits"]
    with pytest.raises(LimitsError, match="calibrated on another model.*run swarmrl calibrate"):
        load_limits(f, dtype="bfloat16", digest="b" * 64)
    with pytest.raises(LimitsError, match="calibrated for bfloat16 but this run samples in float32"):
        load_limits(f, dtype="float32", digest="a" * 64)
    f.write_text("{}")
    with pytest.raises(LimitsError, match="not a limits file"):
        load_limits(f, dtype="bfloat16", digest=None)


def test_a_file_chosen_with_the_retired_bias_limit_is_chosen_again_when_loaded(tmp_path):
    f = tmp_path / "limits.json"
    honest, cheats = _calibration(200, 0.3)
    old = {"format": FORMAT, "dtype": "bfloat16", "model": {"digest": "a" * 64}, **choose_limits(honest, cheats)}
    old["engines"]["builtin"]["limits"]["logprob_bias_max"] = 0.04
    old["engines"]["builtin"]["evidence"] = []  # as if the bias limit had refused the cheat alone
    old["measured"] = {"honest": honest, "cheats": cheats}
    f.write_text(json.dumps(old))
    data = load_limits(f, dtype="bfloat16", digest="a" * 64)
    entry = data["engines"]["builtin"]
    assert "logprob_bias_max" not in entry["limits"] and "retired" in data["chosen_again"]
    assert entry["evidence"], "the cheat the retired limit refused gets its test back"
    del old["measured"]
    f.write_text(json.dumps(old))
    with pytest.raises(LimitsError, match="no measured statistics to choose again from: run swarmrl calibrate"):
        load_limits(f, dtype="bfloat16", digest="a" * 64)


def test_a_bf16_run_on_its_own_model_needs_a_calibration(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    cfg = Config.model_validate({"model": {"path": str(model)}, "sampling": {"dtype": "bfloat16"}})
    with pytest.raises(LimitsError, match="swarmrl calibrate --model .* --dtype bfloat16"):
        run_limits(cfg, model)
    # float32, and the built-in model (its limits ship in the config), go without one.
    assert run_limits(cfg.model_copy(update={"sampling": Config().sampling}), model) is None
    assert run_limits(Config.model_validate({"sampling": {"dtype": "bfloat16"}}), None) is None
    # With a limits file, the model's content decides: same weights elsewhere pass, others do not.
    f = tmp_path / "limits.json"
    _write(f, model={"digest": model_digest(model)})
    cfg = Config.model_validate(
        {"model": {"path": str(model)}, "sampling": {"dtype": "bfloat16"}, "validator": {"limits_file": str(f)}}
    )
    assert run_limits(cfg, model)["dtype"] == "bfloat16"
    # ... and so do the groups it measured: their size, length and temperature must be the run's.
    _write(
        f, model={"digest": model_digest(model)}, sampling={"group_size": 8, "max_new_tokens": 64, "temperature": 1.0}
    )
    assert run_limits(cfg, model)
    hotter = cfg.model_copy(update={"sampling": cfg.sampling.model_copy(update={"temperature": 0.7})})
    with pytest.raises(LimitsError, match=r"temperature 1.0 \(this run: 0.7\).*--temperature 0.7"):
        run_limits(hotter, model)
    (model / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(LimitsError, match="another model"):
        run_limits(cfg, model)


def test_calibration_prompts_are_what_the_orchestrator_leases():
    from swarmrl.model.checkpoint import build_tiny_policy
    from swarmrl.tasks.source import model_input
    from swarmrl.validator.calibrate import prompt_ids

    _, tok = build_tiny_policy(seed=0)
    for text in ("What is 12+7?", "Write a haiku about rain."):
        assert prompt_ids(tok, text) == model_input(tok, text, None)[1]


def test_a_validator_on_another_cpu_kind_says_so_once_before_judging(tmp_path):
    from swarmrl.config import ValidatorConfig
    from swarmrl.proofs.limits import cpu_kind
    from swarmrl.validator.core import Validator

    said: list[str] = []
    v = Validator(ValidatorConfig(), tmp_path, log=said.append)
    v.note_calibration_cpu(cpu_kind())
    assert said == []
    other = Validator(ValidatorConfig(), tmp_path, log=said.append)
    other.note_calibration_cpu("some-other-kind")
    other.note_calibration_cpu("some-other-kind")
    assert len(said) == 1 and "measured on CPU kind some-other-kind" in said[0] and "swarmrl calibrate" in said[0]


def test_a_limits_file_that_accepts_no_engine_stops_the_run(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    f = tmp_path / "limits.json"
    honest, cheats = _calibration(400, 0.02)  # overlapping: the engine is refused
    f.write_text(json.dumps({"format": FORMAT, "dtype": "bfloat16", "model": {"digest": model_digest(model)},
                             **choose_limits(honest, cheats)}))  # fmt: skip
    cfg = Config.model_validate(
        {"model": {"path": str(model)}, "sampling": {"dtype": "bfloat16"}, "validator": {"limits_file": str(f)}}
    )
    with pytest.raises(LimitsError, match="accepts no engine: engine builtin: its honest groups overlap"):
        run_limits(cfg, model)


def test_ban_times_over_drawn_sequences_and_honest_keys_that_never_climb():
    from swarmrl.proofs.limits import ban_times, honest_peaks

    honest, cheats = _calibration(400, 0.25)
    chosen = choose_limits(honest, cheats)
    t = ban_times(chosen, "builtin", cheats, runs=200, max_groups=400)
    assert t["int4"] == {"median": 3, "worst": 3, "never": 0, "runs": 200, "max_groups": 400}  # 3 hard refusals
    assert t["int8"]["never"] == 0 and 3 <= t["int8"]["median"] <= t["int8"]["worst"] <= 400
    expected = chosen["engines"]["builtin"]["cheats"]["int8"]["groups_to_ban"]  # bound / mean llr
    assert t["int8"]["median"] == pytest.approx(expected, rel=0.6)
    h = honest_peaks(chosen, "builtin", honest["builtin"], runs=5, length=5000)
    assert h["refused"] == 0 and h["banned"] == 0 and h["peak_share"] < 1


def test_binomial_tail_by_hand():
    from swarmrl.proofs.evidence import binomial_tail

    assert binomial_tail(0, 5, 0.3) == 1.0 and binomial_tail(6, 5, 0.3) == 0.0
    assert binomial_tail(5, 5, 0.5) == pytest.approx(1 / 32)
    assert binomial_tail(1, 3, 0.5) == pytest.approx(7 / 8)  # 1 - P(0) = 1 - 1/8
    assert binomial_tail(2, 4, 0.1) == pytest.approx(6 * 0.01 * 0.81 + 4 * 0.001 * 0.9 + 0.0001)


def test_a_drift_reference_notices_work_that_left_the_calibration():
    from swarmrl.proofs.evidence import DriftReference

    honest = [i / 100 for i in range(100)]  # 0.00 .. 0.99: the 90th percentile is 0.89
    ref = DriftReference.of("mant_err_group", honest)
    assert ref.level == pytest.approx(0.89)
    assert 0.10 < ref.share < 0.2  # 10 of 100 above it, bounded above at 99 %
    same = [(i % 100) / 100 for i in range(200)]  # honest work as calibrated: 20 of 200 above
    above, p = ref.surprise(same)
    assert above == 20 and p > 0.5
    moved = [v + 0.3 for v in same]  # the whole distribution shifted up: 80 of 200 above
    above, p = ref.surprise(moved)
    assert above == 80 and p < 1e-9


def test_the_drift_watch_warns_once_when_passed_work_leaves_the_calibration_and_once_when_back():
    import random as rnd

    from swarmrl.orchestrator.validation import DRIFT_EVERY, DRIFT_MIN_GROUPS, ValidationQueue

    rng = rnd.Random(0)
    honest = [_stats(rng.gauss(0.6, 0.08)) for _ in range(200)]
    limits = {"engines": {"builtin": {"limits": {}, "evidence": []}}, "measured": {"honest": {"builtin": honest}}}
    said: list[str] = []
    queue = ValidationQueue(None, load_config(None), None, None, said.append, limits)
    for i in range(DRIFT_MIN_GROUPS + DRIFT_EVERY):  # honest work as calibrated, from two keys
        queue._watch("builtin", f"k{i % 2}", _stats(rng.gauss(0.6, 0.08)))
    report = queue.drift_report()["builtin"]
    assert not report["alarm"] and report["statistic"] == "mant_err_group" and said == []
    for i in range(100):  # the policy moved: every key's work sits higher
        queue._watch("builtin", f"k{i % 2}", _stats(rng.gauss(0.9, 0.08)))
    report = queue.drift_report()["builtin"]
    assert report["alarm"] and report["keys"] == 2 and report["p"] < 1e-6
    assert len(said) == 1 and "swarmrl calibrate" in said[0] and "engine builtin" in said[0]
    for _ in range(200):
        queue._watch("builtin", "k0", _stats(rng.gauss(0.6, 0.08)))
    assert not queue.drift_report()["builtin"]["alarm"]
    assert len(said) == 2 and "within the calibration again" in said[1]
    queue._watch("vllm", "k0", _stats(0.6))  # an engine the calibration did not measure: not watched
    assert "vllm" not in queue.drift_report()


def test_swarmrl_status_prints_each_engines_drift():
    from rich.console import Console

    from swarmrl.launch.status import render

    doc = {
        "run": {"run_id": "r", "finished": False, "latest_version": 3, "next_step": 4, "total_steps": 8,
                "async_bound": 2, "prompts_per_step": 8, "group_size": 8, "time": 0.0},
        "progress": [], "workers": [], "workers_total": 0, "broadcast": {"versions": []},
        "validation": {"groups": {}, "rejections": {}, "mode": "in-process", "drift": {
            "vllm": {"statistic": "mant_err_group", "level": 2.15, "window": 200, "above": 135,
                     "expected_at_most": 34.2, "p": 1e-50, "keys": 1, "alarm": True},
            "builtin": {"statistic": "mant_err_group", "level": 2.08, "window": 200, "above": 13,
                        "expected_at_most": 34.2, "p": 0.99, "keys": 1, "alarm": False}},
            "limits": {"measured_on": 30, "dtype": "bfloat16", "cpu": "avx512", "engines": ["builtin", "vllm"]}},
    }  # fmt: skip
    console = Console(record=True, width=200)
    render(doc, console=console)
    text = console.export_text()
    assert "drift vllm: ALARM, 135 of the last 200 passed groups" in text and "measure the limits again" in text
    assert "drift builtin: 13 of the last 200" in text and "within the calibration" in text
    assert "limits: measured on policy version 30 (bfloat16, CPU kind avx512); engines accepted: builtin, vllm" in text


def test_a_limits_file_measured_on_a_version_of_the_run_is_taken_by_that_run_alone(tmp_path):
    from swarmrl.proofs.limits import version_of

    run = tmp_path / "run"
    base, adapter = run / "policies" / "v000000", run / "policies" / "v000012"
    for folder, files in (
        (base, {"config.json": b"{}", "model.safetensors": b"base weights"}),
        (adapter, {"adapter_config.json": b'{"r": 16}', "adapter_model.safetensors": b"lora"}),
    ):
        folder.mkdir(parents=True)
        for name, content in files.items():
            (folder / name).write_bytes(content)
    assert version_of(adapter) == 12 and version_of(tmp_path) is None
    digest = model_digest(adapter)
    (adapter / "adapter_config.json").write_bytes(b'{"r": 8}')  # the adapter's scaling is part of its weights
    assert model_digest(adapter) != digest
    f = tmp_path / "limits.json"
    _write(f, model={"digest": model_digest(adapter), "version": 12, "base_digest": model_digest(base)})
    cfg = Config.model_validate(
        {"model": {"path": str(base)}, "sampling": {"dtype": "bfloat16"}, "validator": {"limits_file": str(f)}}
    )
    assert run_limits(cfg, base, run)["model"]["version"] == 12
    with pytest.raises(LimitsError, match=r"another model .*--model RUN_DIR/policies/vNNNNNN"):
        run_limits(cfg, base)  # no run to look in: only the starting model's digest would do
    other = tmp_path / "other" / "policies" / "v000012"  # another run's adapter of the same name
    other.mkdir(parents=True)
    (other / "adapter_model.safetensors").write_bytes(b"other lora")
    with pytest.raises(LimitsError, match="another model"):
        run_limits(cfg, base, tmp_path / "other")
    _write(f, model={"digest": model_digest(adapter), "version": 12, "base_digest": "c" * 64})
    with pytest.raises(LimitsError, match="another model"):  # this adapter, on another base
        run_limits(cfg, base, run)
    _write(f, model={"digest": model_digest(adapter), "version": 13})
    with pytest.raises(LimitsError, match="policy version 13, which this run never published"):
        run_limits(cfg, base, run)
    # Pruned by the trainer a few steps later: the signed manifest the store keeps still names it
    # (a run resumed after that takes the file it took).
    import hashlib
    import shutil

    from swarmrl.orchestrator.limits_reload import published_by
    from swarmrl.orchestrator.store import Store
    from swarmrl.proofs.limits import manifest_model_digest

    files = [{"name": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in adapter.iterdir()]
    files.append({"name": "tokenizer.json", "sha256": "0" * 64})  # not part of the weights
    assert manifest_model_digest({"files": files}) == model_digest(adapter)
    _write(f, model={"digest": model_digest(adapter), "version": 12, "base_digest": model_digest(base)})
    shutil.rmtree(adapter)
    with pytest.raises(LimitsError, match="policy version 12, which this run never published"):
        run_limits(cfg, base, run, published_by(run))
    store = Store(run / "orchestrator.sqlite")
    with store.tx() as db:
        db.execute("INSERT INTO policies VALUES (12, 'http://x', ?, 0)", (json.dumps({"files": files}),))
    store.close()
    with pytest.raises(LimitsError, match="policy version 12, which this run never published"):
        run_limits(cfg, base, run)  # the proofs layer alone does not read the orchestrator's store
    assert run_limits(cfg, base, run, published_by(run))["model"]["version"] == 12
