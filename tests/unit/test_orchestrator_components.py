"""The orchestrator's components wired by `Orchestrator`, in process (no server, no verifier
processes: grading runs inline), so a broken dependency between them fails here in seconds.
The HTTP behaviour is tested against a real process in test_orchestrator.py."""

from __future__ import annotations

import json
import os
import time
from functools import partial

import pytest

from swarmrl.config import load_config
from swarmrl.config.task import (
    NO_SIGNAL_ACCURACY,
    NO_SIGNAL_FALSE_STOP,
    all_equal_chance,
    default_uninformative_limit,
)
from swarmrl.orchestrator.batches import no_signal_message
from swarmrl.orchestrator.dashboard import record_trainer_metrics
from swarmrl.orchestrator.errors import ApiError
from swarmrl.protocol.messages import GroupIn
from swarmrl.protocol.rollouts import Group, Sample

from orchestrator_steps import (
    OTHER,
    TOKENIZER,
    TRUSTED,
    make_orchestrator,
    orchestrator_config,
    submit_groups,
    train_steps_through,
)


@pytest.fixture
def orch(tmp_path):
    o = make_orchestrator(tmp_path)
    yield o
    o.close()


def completion(orch, problem_id: str, right: bool) -> dict:
    row = next(r for r in orch.rows if r["problem_id"] == problem_id)
    answer = json.loads(row["verification_info"])["ground_truth"] if right else "x"
    ids = TOKENIZER(f"</think> \\boxed{{{answer}}}", add_special_tokens=False)["input_ids"]
    ids = ids[:15] + [TOKENIZER.eos_token_id]
    return {"token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop"}


def submit_lease(o, key: str, right: tuple[bool, ...], version: int = 0) -> tuple[dict, dict]:
    """Lease for `key` and submit a group per prompt whose completions are right or wrong as
    `right` says (an openai-engine group: a trusted key's); (the lease, the reply)."""
    return submit_groups(o, key, version, lambda problem: [completion(o, problem, r) for r in right])


def test_a_group_goes_from_lease_to_batch(orch):
    assert orch.lease(TRUSTED, 0)["lease"] is None  # no policy published yet
    orch.publish(0, "http://x/v0", {"version": 0})
    for key, name in ((TRUSTED, "t"), (OTHER, "o")):
        orch.admit_registration(key, "127.0.0.1")
        orch.authenticate(key, f"nonce-{name}", time.time(), registering=True)
        orch.register(key, name)
    lease = orch.lease(TRUSTED, 0)["lease"]
    groups = [
        GroupIn(
            slot=p["slot"],
            policy_version=0,
            engine="openai",
            samples=[completion(orch, p["problem_id"], right) for right in (True, False)],
        )
        for p in lease["prompts"]
    ]
    reply = orch.submit(TRUSTED, lease["lease_id"], groups)
    assert [a["validation"] for a in reply["accepted"]] == ["pending", "pending"] and not reply["rejected"]
    assert all(a["rewards"][0] > a["rewards"][1] for a in reply["accepted"])
    assert orch.build_batch(0)["ready"] is False  # the validator has not passed them yet

    claim = orch.claim_validation(10)
    assert [item["checks"] for item in claim["items"]] == ["logprobs", "logprobs"]
    assert orch.record_verdicts([{"id": item["id"], "ok": True} for item in claim["items"]])["recorded"] == 2
    batch = orch.build_batch(0)
    assert batch["ready"] and len(batch["groups"]) == 2 and orch.build_batch(0) == batch
    assert orch.status()["next_step"] == 1
    record = orch.worker_record(TRUSTED)
    assert record["trusted"] and record["proven"] is True and record["accepted"] == 2
    totals = orch.totals()
    assert totals["batches_built"] == 1 and totals["validator/passed"] == 2 and totals["leases_issued"] == 1


def test_a_finished_run_gives_validators_nothing_more_and_a_resumed_one_does(orch):
    """Groups still pending when the trainer has taken its last step are never trained: claiming
    them would keep an external validator fetching versions from a trainer that is gone (a CI run
    of docs/operating.md's rehearsal waited on them until it was killed). They stay pending."""
    orch.publish(0, "http://x/v0", {"version": 0})
    orch.admit_registration(TRUSTED, "127.0.0.1")
    orch.authenticate(TRUSTED, "nonce-t", time.time(), registering=True)
    orch.register(TRUSTED, "t")
    lease = orch.lease(TRUSTED, 0)["lease"]
    groups = [
        GroupIn(
            slot=p["slot"], policy_version=0, engine="openai", samples=[completion(orch, p["problem_id"], True)] * 2
        )
        for p in lease["prompts"]
    ]
    assert len(orch.submit(TRUSTED, lease["lease_id"], groups)["accepted"]) == 2
    orch.finish()
    assert orch.claim_validation(10)["items"] == [] and orch.status()["finished"]
    orch.reopen()  # a resumed trainer: the same groups are checked as before
    assert len(orch.claim_validation(10)["items"]) == 2


def test_unproven_keys_of_one_address_crowd_out_only_each_other_and_trusted_keys_are_not_counted(orch):
    """The service layer with the source a request came from: leases of 2 prompts and a share of
    2, then one lease per address from the reserve (admission.py); a trusted key counts as proven."""
    orch.publish(0, "http://x/v0", {"version": 0})
    keys = {TRUSTED: "t", OTHER: "o", "c" * 64: "c", "d" * 64: "d"}
    for key, name in keys.items():
        orch.admit_registration(key, "10.0.0.1")
        orch.authenticate(key, f"nonce-{name}", time.time(), registering=True)
        orch.register(key, name)
    assert orch.lease(TRUSTED, 0, "10.0.0.1")["lease"] is not None
    assert orch.lease(OTHER, 0, "10.0.0.1")["lease"] is not None  # the trusted key's lease is not counted
    refused = orch.lease("c" * 64, 0, "10.0.0.1")
    assert refused["lease"] is None and "new workers hold 2 of the 2" in refused["reason"]
    assert orch.lease("d" * 64, 0, "10.0.0.2")["lease"] is not None  # another address is not held back


def test_the_http_face_refuses_coerced_types_and_repeated_keys_naming_them(orch):
    """Through the ASGI app in process: a signed body, and a trusted role's, each refused with 422
    naming the field (or the key sent twice); the well-typed request goes through."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from starlette.testclient import TestClient

    from swarmrl.orchestrator.app import create_app
    from swarmrl.protocol.signing import sign_headers

    orch.publish(0, "http://x/v0", {"version": 0})
    key = Ed25519PrivateKey.generate()
    http = TestClient(create_app(orch))

    def signed(path: str, raw: str):
        body = raw.encode()
        headers = {"content-type": "application/json", **sign_headers(key, orch.run_id, "POST", path, body)}
        return http.post(path, content=body, headers=headers)

    assert signed("/v1/workers/register", '{"name": "w"}').status_code == 200
    for raw, detail in (
        ('{"policy_version": "0"}', "body.policy_version: Input should be a valid integer"),
        ('{"policy_version": false}', "body.policy_version: Input should be a valid integer"),
        ('{"policy_version": 0, "policy_version": 0}', "body: the key 'policy_version' appears twice in one object"),
    ):
        r = signed("/v1/leases", raw)
        assert r.status_code == 422 and r.json()["error"] == "invalid_request", r.text
        assert r.json()["detail"].startswith(detail), r.text
    assert signed("/v1/leases", '{"policy_version": 0}').json()["lease"] is not None
    validator = {"authorization": "Bearer v", "content-type": "application/json"}
    for path, raw, detail in (
        ("/v1/validator/claim", '{"max_groups": "2"}', "body.max_groups: Input should be a valid integer"),
        ("/v1/validator/claim", '{"max_groups": 2, "max_groups": 3}', "body: the key 'max_groups' appears twice"),
        (
            "/v1/validator/verdicts",
            '{"verdicts": [{"id": 1, "ok": 1}]}',
            "body.verdicts.0.ok: Input should be a valid boolean",
        ),
    ):
        r = http.post(path, content=raw.encode(), headers=validator)
        assert r.status_code == 422 and r.json()["detail"].startswith(detail), r.text
    assert (
        http.post("/v1/validator/claim", content=b"{}", headers={"content-type": "application/json"}).status_code == 401
    )
    assert http.post("/v1/validator/claim", content=b'{"max_groups": 2}', headers=validator).status_code == 200
    trainer = {"authorization": "Bearer t", "content-type": "application/json"}
    r = http.post("/v1/trainer/metrics", content=b'{"step": 0, "metrics": {"eval/accuracy": true}}', headers=trainer)
    assert r.status_code == 422 and r.json()["detail"].startswith(
        "body.metrics.eval/accuracy: Input should be a valid number"
    )


def test_fraud_bans_the_key_and_expires_its_leases(orch):
    orch.publish(0, "http://x/v0", {"version": 0})
    orch.register(OTHER, "o")
    lease = orch.lease(OTHER, 0)["lease"]
    no_proofs = {"token_ids": [5, 6, TOKENIZER.eos_token_id], "logprobs": [-0.1] * 3, "finish_reason": "stop"}
    reply = orch.submit(OTHER, lease["lease_id"], [GroupIn(slot=0, policy_version=0, samples=[no_proofs] * 2)])
    assert reply["rejected"][0]["reason"] == "proofs_missing"
    with pytest.raises(ApiError) as e:
        orch.authenticate(OTHER, "n", time.time())
    assert e.value.code == "banned"
    with pytest.raises(ApiError) as e:  # ending the banned key's leases went through leasing
        orch.submit(OTHER, lease["lease_id"], [GroupIn(slot=1, policy_version=0, samples=[no_proofs] * 2)])
    assert e.value.code == "lease_expired"
    assert orch.gauges()["workers_banned"] == 1 and orch.totals()["workers_banned"] == 1
    assert any(line.startswith("banned: worker o") for line in orch.logs)


def _group(task_rewards: list[float], finish: str = "stop") -> Group:
    sample = Sample(token_ids=[1, 2], logprobs=[-0.1, -0.1], finish_reason=finish, seed=0)
    return Group(
        problem_id="p",
        task_type="verifiable_math",
        prompt="q",
        verification_info="{}",
        prompt_ids=[1],
        samples=[sample] * len(task_rewards),
        policy_version=0,
        worker="w",
        temperature=1.0,
        rewards=list(task_rewards),
        task_rewards=list(task_rewards),
    )


def test_the_no_signal_limit_is_bounded_by_the_run_and_spares_honest_hard_runs():
    cfg = load_config(None, [])
    # The default run (groups of 8, 16 prompts a batch): 4 batches' worth.
    assert cfg.sampling.uninformative_limit is None and cfg.sampling.no_signal_limit() == 64
    # A small run still waits 32 groups and at least what a 5%-accurate base needs to be safe.
    assert default_uninformative_limit(8, 2) == 51 and default_uninformative_limit(16, 1) == 32
    assert default_uninformative_limit(2, 2) == 208  # pairs are all-equal 90% of the time at 5%
    for g in (2, 4, 8, 16, 32):
        for pps in (1, 2, 16, 32, 256):
            n = default_uninformative_limit(g, pps)
            assert n >= 4 * pps and n >= 32
            assert all_equal_chance(NO_SIGNAL_ACCURACY, g) ** n <= NO_SIGNAL_FALSE_STOP
    # 5% accuracy with groups of 8: about a third of the groups still have signal.
    assert 1 - all_equal_chance(0.05, 8) == pytest.approx(0.3366, abs=1e-4)
    assert load_config(None, ["--sampling.uninformative_limit", "7"]).sampling.no_signal_limit() == 7
    with pytest.raises(ValueError, match="uninformative_limit"):
        load_config(None, ["--sampling.uninformative_limit", "0"])


def test_the_no_signal_message_names_the_cause_and_the_fixes():
    cfg = load_config(None, [])
    never = no_signal_message(
        streak=64, seen=80, all_equal=70, groups=[_group([0.0] * 8)] * 64, accuracy_before=0.0, cfg=cfg
    )
    assert "the last 64 groups in a row had all-equal rewards" in never
    assert "70 of the 80 groups sampled so far, 88%" in never
    assert "mean task reward 0.00" in never and "never earns a reward" in never
    assert "Held-out accuracy before RL: 0.000" in never
    assert "64 in a row, this run's default" in never
    for fix in ("easier task", "model.path", "swarmrl sft", "\\boxed", "tasks.types", "sampling.group_size (now 8)"):
        assert fix in never, fix
    assert "max_new_tokens" not in never  # the completions were not cut off

    always = no_signal_message(
        streak=64, seen=64, all_equal=64, groups=[_group([1.0] * 8)] * 64, accuracy_before=None, cfg=cfg
    )
    assert "mean task reward 1.00" in always and "solves all of these tasks" in always
    assert "harder tasks" in always and "easier task" not in always
    assert "Held-out accuracy" not in always  # not reported: the trainer adds its own figure

    cut = load_config(None, ["--sampling.uninformative_limit", "5"])
    mixed = no_signal_message(
        streak=5,
        seen=5,
        all_equal=5,
        groups=[_group([0.0] * 8, "length")] * 3 + [_group([1.0] * 8, "length")] * 2,
        accuracy_before=0.4,
        cfg=cut,
    )
    assert (
        "3 scored 0 throughout and 2 scored 1 throughout" in mixed
        and "(sampling.uninformative_limit: 5 in a row, set)" in mixed
    )
    assert "100% of their completions stopped at sampling.max_new_tokens = 64" in mixed


def test_a_run_without_signal_is_refused_once_the_streak_reaches_the_limit(tmp_path):
    """Groups settle through the validator (validator.rate 1): the streak counts passed groups."""
    o = make_orchestrator(tmp_path, "--sampling.uninformative_limit", "4")
    try:
        o.publish(0, "http://x/v0", {"version": 0})
        o.register(TRUSTED, "t")
        record_trainer_metrics(o, 0, {"eval/accuracy": 0.0})  # what the trainer reports before step 1
        for i in range(2):  # 2 leases of 2 prompts, every completion wrong: 4 all-equal groups
            _, reply = submit_lease(o, TRUSTED, (False, False))
            assert not any(a["informative"] for a in reply["accepted"])
            if i == 0:  # pending groups count once the validator passes them
                assert o.build_batch(0)["groups_seen"] == 0
            claim = o.claim_validation(10)
            o.record_verdicts([{"id": item["id"], "ok": True} for item in claim["items"]])
            if i == 0:
                half = o.build_batch(0)
                assert not half["ready"] and half["queued"] == 0 and half["all_equal_limit"] == 4
                assert (half["groups_seen"], half["groups_all_equal"], half["all_equal_streak"]) == (2, 2, 2)
        with pytest.raises(ApiError) as e:
            o.build_batch(0)
        assert e.value.status == 409 and e.value.code == "no_signal"
        message = e.value.message
        assert "the last 4 groups in a row" in message and "4 of the 4 groups sampled so far, 100%" in message
        assert "never earns a reward" in message and "Held-out accuracy before RL: 0.000" in message
    finally:
        o.close()


def test_a_restarted_origin_moves_every_version_it_holds_to_its_new_url(orch):
    """A trainer restarted with `trainer.weights_port` 0 serves its broadcast root on a new port
    and announces only its current version there: the older versions it still holds must be
    fetched from that address too (a validator asked the dead one for ever in a chaos run)."""
    orch.publish(0, "http://127.0.0.1:1000", {"version": 0})
    orch.publish(1, "http://127.0.0.1:1000", {"version": 1})
    orch.publish(2, "http://127.0.0.1:2000", {"version": 2})  # the trainer came back on another port
    with orch.store.tx() as db:
        urls = [orch.store.policy(db, v)["url"] for v in (0, 1, 2)]
    assert urls == ["http://127.0.0.1:2000"] * 3


def _limits_file(
    path, folder, *, spread: float, version: int | None = None, dtype: str = "bfloat16", engines=("builtin", "vllm")
) -> dict:
    """A limits file measured on `folder` (a run's version when `version` is given), its honest
    group statistic spread by `spread` and int8 work 0.3 above it."""
    import random

    from swarmrl.proofs.limits import FORMAT, choose_limits, model_digest

    rng = random.Random(0)

    def stats(group: float) -> dict:
        return {"exp_mismatches_max": 4, "mant_err_mean_max": group + 0.3, "mant_err_median_max": 1.0,
                "mant_err_group": group, "sampling_margin_max": 0.0, "logprob_err_max": 0.01,
                "logprob_err_mean": 0.001, "logprob_bias": 0.001}  # fmt: skip

    honest = {e: [stats(rng.gauss(0.6, spread)) for _ in range(200)] for e in engines}
    cheats = {"int8": [stats(rng.gauss(0.9, spread)) for _ in range(64)], "int4": [stats(4.0) for _ in range(16)]}
    model = {"digest": model_digest(folder), **({"version": version} if version is not None else {})}
    data = {"format": FORMAT, "dtype": dtype, "model": model, **choose_limits(honest, cheats)}
    path.write_text(json.dumps(data))
    _limits_file.mtime_ns = getattr(_limits_file, "mtime_ns", time.time_ns()) + 1_000_000_000
    os.utime(path, ns=(_limits_file.mtime_ns, _limits_file.mtime_ns))  # seen as new on any clock
    return data


def test_a_limits_file_written_again_is_taken_by_the_running_orchestrator(tmp_path):
    """The drift watch asks for limits measured near the current version: written over the run's
    file, they are checked like a run's start, then judged by (validators get them with their
    next claim); a file that does not pass leaves the run's limits as they were."""
    from swarmrl.orchestrator.limits_reload import LimitsReload
    from swarmrl.proofs.limits import run_limits

    versions = {}
    for v, weights in ((0, b"v0"), (3, b"v3")):
        folder = versions[v] = tmp_path / "policies" / f"v{v:06d}"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(weights)
    f = tmp_path / "limits.json"
    first = _limits_file(f, versions[0], spread=0.08)
    flags = ("--sampling.dtype", "bfloat16", "--model.path", str(versions[0]), "--validator.limits_file", str(f))
    cfg = orchestrator_config(tmp_path, *flags)
    o = make_orchestrator(tmp_path, *flags, limits=run_limits(cfg, versions[0], tmp_path))
    try:
        reload = LimitsReload(o.cfg, tmp_path, versions[0], o.validation, o.logs.append)
        test = o.validation.evidence["builtin"][0].name
        with o.store.tx() as db:
            o.store.add_evidence(db, OTHER, "builtin", test, 5.0, 0.9)
        assert not reload.check(), "an unchanged file is not read again"

        rewrite = partial(_limits_file, f)

        # Refused, with what is wrong; the run keeps its limits and every key its score.
        for kw, said in (
            ({"folder": versions[0], "spread": 0.08, "dtype": "float32"}, "calibrated for float32"),
            ({"folder": versions[3], "spread": 0.08}, "another model"),  # v3's weights, not said to be v3
            ({"folder": versions[3], "spread": 0.08, "version": 7}, "policy version 7, which this run never"),
            ({"folder": versions[3], "spread": 0.08, "version": 3, "engines": ("builtin",)}, "does not accept vllm"),
        ):
            rewrite(**kw)
            assert not reload.check()
            assert "is not taken, the run keeps its limits" in o.logs[-1] and said in o.logs[-1], o.logs[-1]
            assert o.validation.limits["engines"] == first["engines"]
        with o.store.read() as db:
            assert o.store.evidence_scores(db, OTHER) == [("builtin", test, 5.0)]

        # Measured on the run's v3: taken; its tests differ, so scores start again (peak kept).
        second = rewrite(folder=versions[3], spread=0.12, version=3)
        assert reload.check()
        assert "measured on policy version 3" in o.logs[-1] and "1 keys' evidence scores start again" in o.logs[-1]
        assert o.validation.limits_summary()["measured_on"] == 3  # what the dashboard and swarmrl status show
        claim = o.claim_validation(4)
        assert claim["calibrated"]["builtin"] == second["engines"]["builtin"]["limits"] != first["engines"][
            "builtin"]["limits"]  # fmt: skip
        with o.store.read() as db:
            assert [r[2] for r in o.store.evidence_scores(db, OTHER)] == [0.0]
            assert o.store.evidence(db)[OTHER][0]["peak"] == 5.0

        # The same evidence tests with another hard limit: the scores carry on.
        with o.store.tx() as db:
            o.store.add_evidence(db, OTHER, "builtin", o.validation.evidence["builtin"][0].name, 2.0, 0.9)
        data = json.loads(f.read_text())
        data["engines"]["builtin"]["limits"]["group_mant_err_max"] += 0.5
        f.write_text(json.dumps(data))
        os.utime(f, ns=(time.time_ns() + 10**10,) * 2)
        assert reload.check() and "evidence score carries on" in o.logs[-1]
        with o.store.read() as db:
            assert [r[2] for r in o.store.evidence_scores(db, OTHER)] == [2.0]
    finally:
        o.close()
    # Resumed with the file it stopped with, the scores carry on; so they do for a store whose
    # scores were summed before the tests were recorded (a run started by an earlier version).
    for forget in (False, True):
        o = make_orchestrator(tmp_path, *flags, limits=run_limits(cfg, versions[0], tmp_path))
        if forget:
            with o.store.tx() as db:
                db.execute("DELETE FROM meta WHERE key = 'evidence_models'")
            o.close()
            o = make_orchestrator(tmp_path, *flags, limits=run_limits(cfg, versions[0], tmp_path))
        with o.store.read() as db:
            assert [r[2] for r in o.store.evidence_scores(db, OTHER)] == [2.0]
        o.close()


def test_problems_without_signal_are_retired_and_never_leased_again(tmp_path):
    """tasks.retire_after 1: a problem whose group had no signal is retired at once, up to
    retire_max_share of them (4 of 8 here); the leases after skip it; the count is a batch metric
    and survives a restart (it is in the store)."""
    flags = ("--tasks.retire_after", "1", "--tasks.train_size", "8", "--tasks.retire_max_share", "0.5")
    o = make_orchestrator(tmp_path, *flags)
    try:
        o.publish(0, "http://x/v0", {"version": 0})
        o.register(TRUSTED, "t")
        retired: list[str] = []
        for _ in range(3):  # 3 leases of 2 prompts, every group all wrong (no signal)
            lease, _ = submit_lease(o, TRUSTED, (False, False))
            assert not {p["problem_id"] for p in lease["prompts"]} & set(retired)  # never a retired one
            o.record_verdicts([{"id": item["id"], "ok": True} for item in o.claim_validation(10)["items"]])
            retired += [p["problem_id"] for p in lease["prompts"]][: 4 - len(retired)]
        assert o.totals()["tasks/retired"] == 4  # the cap: half of the 8 problems
        ids = {r["problem_id"] for r in o.rows}
        live = ids - set(retired)
        leased = set()
        for _ in range(2):  # the next leases (2 fit in the queue) take problems still in rotation
            lease, _ = submit_lease(o, TRUSTED, (True, False))
            leased |= {p["problem_id"] for p in lease["prompts"]}
            o.record_verdicts([{"id": item["id"], "ok": True} for item in o.claim_validation(10)["items"]])
        assert leased and leased <= live
        with o.store.read() as db:
            assert o.validation.metrics(db)["tasks/retired"] == 4.0
    finally:
        o.close()
    again = make_orchestrator(tmp_path, *flags)  # a restart: the store remembers
    try:
        assert again.build_batch(0)["ready"] and again.build_batch(1)["ready"]  # the trainer takes both
        again.publish(1, "http://x/v1", {"version": 1})
        lease, _ = submit_lease(again, TRUSTED, (True, False), version=1)
        assert not {p["problem_id"] for p in lease["prompts"]} & set(retired)
    finally:
        again.close()


def test_a_streak_retires_at_its_length_resets_on_signal_and_stops_at_the_cap():
    import sqlite3

    from swarmrl.orchestrator import curriculum

    db = sqlite3.connect(":memory:")
    db.execute(curriculum.SCHEMA)
    assert curriculum.max_retired(10, 0.9) == 9 and curriculum.max_retired(1, 0.9) == 0
    steps = [curriculum.record(db, 7, informative, after=3, limit=1) for informative in (False, False, True, False)]
    assert steps == [False, False, False, False]  # the informative group reset the streak at 2
    assert curriculum.record(db, 7, False, after=3, limit=1) is False  # streak 2 again
    assert curriculum.record(db, 7, False, after=3, limit=1) is True  # 3 in a row: retired
    assert curriculum.retired(db) == {7}
    assert [curriculum.record(db, 8, False, after=1, limit=1) for _ in range(2)] == [False, False]  # the cap: 1
    assert db.execute("SELECT groups, streak FROM problems WHERE problem = 8").fetchone() == (2, 2)


def test_the_store_grows_with_steps_not_tokens_once_groups_are_trained_on(tmp_path):
    """orchestrator.keep_payload_steps: groups of 400-token and of 100-token completions over 60
    steps with payloads pruned once trained on (checkpoints every 5 steps, no step kept beyond
    them), and 400-token groups with every payload kept. The pruned stores hold the tokens of the
    newest batches only and grow by the same bytes a step whatever the completions' length; a
    batch a resume could ask for again is served whole, an older one is refused naming the
    setting; what stays of a pruned group is its audit summary."""
    sizes = {}
    for name, keep, tokens in (("pruned", "0", 400), ("short", "0", 100), ("kept", "all", 400)):
        (tmp_path / name).mkdir()
        overrides = ["--sampling.max_new_tokens", "512", "--trainer.checkpoint_every", "5"]
        o = make_orchestrator(tmp_path / name, *overrides, "--orchestrator.keep_payload_steps", keep)
        try:
            o.admit_registration(TRUSTED, "127.0.0.1")
            o.authenticate(TRUSTED, "nonce-t", time.time(), registering=True)
            o.register(TRUSTED, "t")
            sizes[name] = train_steps_through(o, range(60), tokens=tokens)
            if name == "pruned":
                # Batch 59 was asked for by a trainer 59 steps in, whose newest checkpoints are of
                # steps 55 and 50: a resume from either asks for batches 50.., which stay whole.
                assert len(o.build_batch(50)["groups"]) == 2
                with pytest.raises(ApiError) as refused:
                    o.build_batch(49)
                assert refused.value.status == 410 and "keep_payload_steps" in refused.value.message
                with o.store.read() as db:
                    kept = db.execute("SELECT payload FROM groups WHERE pruned = 0").fetchall()
                    summary = json.loads(db.execute("SELECT payload FROM groups WHERE pruned = 1").fetchone()[0])
                assert len(kept) == 2 * 10  # batches 50-59
                assert summary["lengths"] == [400, 400] and summary["rewards"][0] > summary["rewards"][1]
                assert summary["worker"] == TRUSTED and len(summary["payload_sha256"]) == 64
                assert o.totals()["groups_pruned"] == 2 * 50
        finally:
            o.close()
    pruned, kept = sizes["pruned"], sizes["kept"]
    assert pruned[-1]["groups_with_payload"] <= 2 * 10 and kept[-1]["groups_with_payload"] == 120
    assert pruned[-1]["groups_pruned"] == 100 and kept[-1]["groups_pruned"] == 0
    # File growth from step 20 to 60 (pages in use, as the file is once freed pages are released).
    used = lambda f: f["bytes"] - f["free_bytes"]  # noqa: E731
    grown = {name: used(f[-1]) - used(f[19]) for name, f in sizes.items()}
    assert grown["kept"] > 40 * 2 * 400 * 4  # every token's id and logprob stayed
    # Pruned: a summary, a batch and a lease a step (about 4 KB here), the same for 4x the tokens.
    assert grown["pruned"] < grown["kept"] / 3 and grown["pruned"] < 1.25 * grown["short"] + 16384, grown
