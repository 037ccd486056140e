"""Adversarial suite: scripted malicious workers against a real orchestrator and its validator.

One orchestrator process on 127.0.0.1 (in-process validator, validation rate 1), policy
versions signed and served over HTTP by a real broadcast origin (ShardServer): v0, and v1 = v0
after ten real AdamW steps.
Every cheat is an `AdversarialWorker` (the same code `swarmrl worker --adversary` runs) or a
hand-made request, submitted over HTTP; each test checks the reason it is rejected with, and
that the honest worker sharing the run has no rejection at all.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmrl.inference.worker import Worker
from swarmrl.protocol.client import Refused
from swarmrl.protocol.signing import public_key_hex, sign_headers

from adversary_world import World, attack, honest_clean, honest_round, lease_of, settled
from harness import RunHandle
from orchestrator_harness import closed_clean

pytestmark = pytest.mark.timeout(300)


def verdicts(world: World, worker_key: str) -> list[dict]:
    with world.db() as db:
        return [
            json.loads(v)
            for (v,) in db.execute("SELECT verdict FROM groups WHERE worker = ? AND verdict IS NOT NULL", (worker_key,))
        ]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    yield from closed_clean(World(tmp_path_factory.mktemp("validation")))


# ---- honest -------------------------------------------------------------------------------------
def test_honest_workers_pass_the_full_check(world):
    for _ in range(2):
        honest_round(world)
    honest_clean(world)
    checked = verdicts(world, world.honest.client.key_hex)
    assert len(checked) >= 4 and all(v["ok"] for v in checked)
    # The statistics behind the verdict are kept, and sit well inside the limits. Exponent
    # mismatches come from bf16 ties at the 128th place and decode/prefill rounding: 2 at most
    # on machine Y, 3 in CI on machine E, so the bound is half the configured limit (8), not a
    # count one CPU printed.
    for v in checked:
        s = v["stats"]
        assert s["chunks"] >= 2 and s["exp_mismatches_max"] <= 4 and s["sampling_margin_max"] < 1e-3
        assert s["logprob_err_max"] < 1e-3


def test_a_worker_decoding_in_streams_passes_the_full_check(world):
    from swarmrl.inference.streams import StreamedEngine

    w = world.worker("streams", streams=2)
    engine = w.sampler
    assert isinstance(engine, StreamedEngine)
    # A new version goes to the running stream processes (none are started per version).
    assert w._ensure_policy(world.policy[0]) and w._ensure_policy(world.policy[1])
    assert w.sampler is engine and w.version == 1
    for _ in range(2):
        result = w.client.submit(w.generate(lease_of(w)))
        assert result["rejected"] == [] and len(result["accepted"]) == 2
    me = settled(w)
    assert me["rejected"] == 0 and me["fraud"] == 0 and not me["banned"], me
    checked = verdicts(world, w.client.key_hex)
    assert len(checked) >= 4 and all(v["ok"] for v in checked)


# ---- cheats caught by the validator's prefill -----------------------------------------------------
@pytest.mark.parametrize(
    "kind, reason",
    [
        ("other_model", "toploc"),
        ("int4_weights", "toploc"),
        ("edit_tokens", "sampling"),
        ("edit_logprobs", "logprobs"),
        ("cherry_pick", "sampling"),
        ("garbage_proofs", "toploc"),
        ("replay", "sampling"),
    ],
)
def test_cheats_are_rejected_by_the_validator(world, kind, reason):
    if kind == "replay":  # its first lease is honest; the replay is the second
        adv = world.worker("adv-replay", "replay")
        first = adv.client.submit(adv.generate(lease_of(adv)))
        assert first["rejected"] == []
        result = adv.client.submit(adv.generate(lease_of(adv)))
        record = settled(adv)
        honest_clean(world)
        assert record["rejections"] == {reason: 2}, record
        assert record["accepted"] == 2  # the honest first lease
        return
    result, record = attack(world, kind)
    # Cheap checks pass (the cheat is careful), so the submission is accepted for validation...
    assert result["rejected"] == [] and all(a["validation"] == "pending" for a in result["accepted"])
    # ... and the validator rejects both groups for the reason aimed at this cheat.
    assert record["rejections"] == {reason: 2}, record
    assert record["accepted"] == 0 and record["fraud"] == 2
    with world.db() as db:
        states = [s for (s,) in db.execute("SELECT state FROM groups WHERE worker = ?", (record["worker"],))]
        details = [d for (d,) in db.execute("SELECT detail FROM rejections WHERE worker = ?", (record["worker"],))]
    assert states == ["rejected", "rejected"]
    assert all(d for d in details)  # a reason with numbers, for the operator


def test_an_old_policy_claimed_as_new_is_rejected(world):
    adv = world.worker("adv-old", "old_version", version=0)  # samples with v0 from now on ...
    assert adv._ensure_policy(world.policy[1]) and adv.version == 1  # ... while claiming v1
    honest_round(world)
    sub = adv.generate(lease_of(adv))
    assert {g["policy_version"] for g in sub["groups"]} == {1}
    result = adv.client.submit(sub)
    assert result["rejected"] == []
    record = settled(adv)
    assert record["rejections"] == {"toploc": 2}, record
    honest_clean(world)


# ---- cheats caught by the orchestrator's cheap checks ----------------------------------------------
@pytest.mark.parametrize(
    "kind, reason",
    [
        ("claim_reward", "claimed_reward"),
        ("truncated_proofs", "proofs_malformed"),
        ("missing_proofs", "proofs_missing"),
        ("wrong_group_size", "group_size"),
    ],
)
def test_cheats_refused_at_submission(world, kind, reason):
    result, record = attack(world, kind)
    assert result["accepted"] == [] and [r["reason"] for r in result["rejected"]] == [reason, reason]
    assert record["rejections"] == {reason: 2} and record["fraud"] == 2


def test_another_workers_lease_is_refused(world):
    honest_lease = lease_of(world.honest)
    adv = world.worker("adv-foreign", "claim_reward")
    stolen = world.honest.generate(honest_lease)  # even honest work, if sent under someone else's lease
    with pytest.raises(Refused) as e:
        adv.client.submit(stolen)
    assert e.value.status == 403 and e.value.code == "foreign_lease"
    # Refused without counting against the key: a lease id can be fed to an honest worker.
    assert settled(adv)["rejections"] == {} and settled(adv)["fraud"] == 0
    # The owner can still deliver it.
    assert world.honest.client.submit(stolen)["rejected"] == []
    honest_clean(world)


def test_a_forged_signature_is_refused_and_costs_the_victim_nothing(world):
    forger = Ed25519PrivateKey.generate()
    body = json.dumps({"policy_version": 1}).encode()
    headers = {
        "content-type": "application/json",
        **sign_headers(forger, world.honest.client.run(), "POST", "/v1/leases", body),
    }
    headers["x-swarmrl-key"] = world.honest.client.key_hex  # claims to be the honest worker
    r = httpx.post(world.orch.url + "/v1/leases", content=body, headers=headers)
    assert r.status_code == 401 and r.json()["error"] == "bad_signature"
    honest_clean(world)


def test_a_replayed_request_is_refused(world):
    w = world.honest
    sub = w.generate(lease_of(w))
    body = json.dumps(sub, separators=(",", ":")).encode()
    headers = {"content-type": "application/json", **sign_headers(w.key, w.client.run(), "POST", "/v1/rollouts", body)}
    first = httpx.post(world.orch.url + "/v1/rollouts", content=body, headers=headers)
    assert first.status_code == 200 and first.json()["rejected"] == []
    again = httpx.post(world.orch.url + "/v1/rollouts", content=body, headers=headers)  # byte-identical
    assert again.status_code == 401 and again.json()["error"] == "replayed_nonce"
    honest_clean(world)


def test_an_oversized_payload_is_refused_before_parsing(world):
    adv = world.worker("adv-big")
    lease = lease_of(adv)
    sub = adv.generate(lease)
    sub["groups"][0]["samples"][0]["padding"] = "x" * (9 << 20)
    body = json.dumps(sub).encode()
    headers = {
        "content-type": "application/json",
        **sign_headers(adv.key, adv.client.run(), "POST", "/v1/rollouts", body),
    }
    r = httpx.post(world.orch.url + "/v1/rollouts", content=body, headers=headers, timeout=60)
    assert r.status_code == 413 and r.json()["error"] == "too_large"
    honest_clean(world)


def test_every_rejection_reason_is_a_metric(world):
    # The cheats of this module may have run in another pytest-xdist worker (another world): any
    # reason this world has not seen yet is produced here first.
    causes = {
        "toploc": "int4_weights",
        "sampling": "edit_tokens",
        "logprobs": "edit_logprobs",
        "claimed_reward": "claim_reward",
        "proofs_malformed": "truncated_proofs",
        "group_size": "wrong_group_size",
    }
    for reason, kind in causes.items():
        metric = f'swarmrl_total{{what="rejected/{reason}"}}'
        if metric not in httpx.get(world.orch.url + "/metrics").text:
            attack(world, kind)
        assert metric in httpx.get(world.orch.url + "/metrics").text, reason


# ---- bans --------------------------------------------------------------------------------------------
def test_a_banned_worker_is_refused_and_its_unchecked_groups_are_rechecked(tmp_path):
    # Validation rate 0: only cheap checks, so edited logprobs get through at first.
    world = World(tmp_path, "--validator.rate", "0", "--validator.ban_after", "2")
    try:
        adv = world.worker("adv", "edit_logprobs")
        first = adv.client.submit(adv.generate(lease_of(adv)))
        assert first["rejected"] == [] and len(first["accepted"]) == 2
        honest_round(world)
        adv.kind = "claim_reward"  # now a cheat the cheap checks see: 2 fraudulent groups = ban
        second = adv.client.submit(adv.generate(lease_of(adv)))
        assert [r["reason"] for r in second["rejected"]] == ["claimed_reward"] * 2
        with pytest.raises(Refused) as e:
            adv.client.lease(1)
        assert e.value.code == "banned"
        record = settled(adv)  # the ban sent its two queued groups to the validator
        assert record["banned"] and record["rejections"] == {"claimed_reward": 2, "logprobs": 2}, record
        assert record["accepted"] == 0  # its first two groups no longer count as accepted
        with world.db() as db:
            states = [s for (s,) in db.execute("SELECT state FROM groups WHERE worker = ?", (record["worker"],))]
        assert states == ["rejected", "rejected"]
        assert "banned: worker adv" in world.orch.log()
        # Nothing of it reaches the trainer; the honest groups do.
        batch = world.trainer.batch(0)
        assert batch.ready is False or all(g.worker != record["worker"] for g in batch.groups)
        honest_clean(world)
    finally:
        world.close()


# ---- validation by reputation (issue 30) ------------------------------------------------------------
def test_a_key_on_a_clean_streak_is_sampled_and_any_failure_sends_it_back_to_full_checks(tmp_path):
    # A clean streak after 2 passed groups, and then a sampled rate of 0: what only the full check sees
    # gets through while the streak lasts. A failure the cheap checks see ends it.
    world = World(tmp_path, "--validator.sample_after", "2", "--validator.sampled_rate", "0")
    try:
        honest_round(world)
        adv = world.worker("adv", "edit_logprobs")
        earned = adv.client.submit(Worker.submission(adv, lease_of(adv)))  # honest work earns the streak
        assert [a["validation"] for a in earned["accepted"]] == ["pending", "pending"]
        assert settled(adv)["rejections"] == {}
        with world.db() as db:
            assert db.execute("SELECT clean_streak FROM workers WHERE name = 'adv'").fetchone()[0] == 2
        unchecked = adv.client.submit(adv.generate(lease_of(adv)))  # edited logprobs, now sampled out
        assert [a["validation"] for a in unchecked["accepted"]] == ["cheap checks only"] * 2
        assert settled(adv)["rejections"] == {}
        adv.kind = "claim_reward"  # caught by the cheap checks: the streak is over ...
        caught = adv.client.submit(adv.generate(lease_of(adv)))
        assert [r["reason"] for r in caught["rejected"]] == ["claimed_reward"] * 2
        record = settled(adv)  # ... and the two unchecked groups got the full check after all
        assert record["rejections"] == {"claimed_reward": 2, "logprobs": 2} and not record["banned"], record
        assert record["accepted"] == 2  # the honest two; the edited ones no longer count
        assert "2 of its unchecked groups go back to the validator" in world.orch.log()
        with world.db() as db:  # back below sample_after: its next groups get the full check
            assert db.execute("SELECT clean_streak FROM workers WHERE name = 'adv'").fetchone()[0] == 0
        # (It may not lease again to show it: 4 frauds in the penalty window used up its allowance.)
        honest_clean(world)
        assert world.honest.client.me()["rejections"] == {}
    finally:
        world.close()


# ---- the validator as its own process ------------------------------------------------------------------
def test_an_external_validator_process_judges_the_groups(tmp_path):
    world = World(tmp_path, "--validator.mode", "external")
    try:
        honest_round(world)
        adv = world.worker("adv", "cherry_pick")
        adv.client.submit(adv.generate(lease_of(adv)))
        time.sleep(0.5)
        assert world.honest.client.me()["awaiting_validation"] == 2  # nobody validates in-process
        token = ["--token-file", str(world.run / "validator.token")]
        home = ["--cache-dir", str(tmp_path / "vcache"), "--threads", "1"]
        with RunHandle("validator", "--orchestrator", world.orch.url, *token, *home, log=tmp_path / "validator.log"):
            assert settled(adv)["rejections"] == {"sampling": 2}
            honest_clean(world)
        # A wrong token is refused, with a message that says which file holds the right one.
        r = httpx.post(world.orch.url + "/v1/validator/claim", json={}, headers={"authorization": "Bearer nope"})
        assert r.status_code == 401 and "validator.token" in r.json()["detail"]
        assert public_key_hex(adv.key) == adv.client.key_hex
    finally:
        world.close()
