"""Evidence per key in a real bf16 run (issue 49): a limits file made by `calibrate` on the run's own
v0, a real orchestrator process with its in-process validator, an honest built-in worker, an int8
worker and an int8 worker declaring vLLM, all over HTTP on 127.0.0.1.

The run's ban_after is 1000 (adversary_world.SHARED), so a ban here is the sequential test's alone.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

from swarmrl.inference.worker import RefusedEngine
from swarmrl.model.checkpoint import build_tiny_policy, save_policy
from swarmrl.protocol.client import Refused, retrying
from swarmrl.tasks import arithmetic
from swarmrl.validator.calibrate import calibrate

from adversary_world import World, honest_clean, honest_round, lease_of, settled
from orchestrator_harness import closed_clean

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]

# The harness's small groups (orchestrator_harness.SMALL): with 2 completions of at most 16 tokens a
# group's statistics are noisy enough that int8 weights pass every hard limit (calibrated here:
# 48 of 48 groups) and only the evidence of several groups tells them apart (about 9).
GROUP, TOKENS = 2, 16


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("evidence")
    limits = root / "limits.json"

    def calibrate_v0(v0):
        rows = arithmetic.generate(400, digits=2, ops="+-", split="train", seed=0)
        data = calibrate(
            str(v0),
            [r["prompt"] for r in rows],
            dtype="bfloat16",
            engines=["builtin"],
            groups=256,
            cheat_groups=24,
            group_size=GROUP,
            max_new_tokens=TOKENS,
            cheats=("int8_per_32", "int4_per_32", "other_model"),
            work_dir=root / "calibrate",
            log=lambda *_: None,
        )
        limits.write_text(json.dumps(data))

    # v1 = v0 (World's `model`): the calibration is of the weights workers run. (Ten AdamW steps
    # at 3e-3, the harness's usual v1, move this random model so far that int8 work of v1 looks like
    # honest work of v0: a run's limits hold for versions near the one they were measured on.)
    model, tok = build_tiny_policy(seed=0)
    save_policy(model, tok, root / "tiny")
    w = World(
        root,
        "--sampling.dtype",
        "bfloat16",
        "--validator.limits_file",
        str(limits),
        model=root / "tiny",
        before_start=calibrate_v0,
    )
    w.limits, w.limits_file = json.loads(limits.read_text()), limits
    yield from closed_clean(w)


def evidence_of(world: World, name: str) -> list[dict]:
    doc = httpx.get(f"{world.orch.url}/v1/dashboard", timeout=10).json()
    return next(w for w in doc["workers"] if w["name"] == name)["evidence"]


def test_honest_bf16_work_is_never_refused_and_gathers_no_ban(world):
    assert "refused" not in world.limits["engines"]["builtin"], world.limits["engines"]["builtin"].get("refused")
    for _ in range(12):
        honest_round(world)
        settled(world.honest)  # an unproven key's lease allowance waits for the validator
    honest_clean(world)
    rows = evidence_of(world, "honest")
    # Every fully checked group counts (16 before a clean streak, a sample after it).
    assert rows and all(r["engine"] == "builtin" and 16 <= r["groups"] <= 24 for r in rows), rows
    assert all(r["score"] < r["bound"] / 2 for r in rows), rows


def test_an_int8_worker_is_banned_by_the_evidence_of_its_groups(world):
    honest_round(world)  # honest work judged beside the int8 key's (and the test stands alone)
    adv = world.worker("int8", "int8_weights")
    sent = 0

    def patiently(call):  # a key asking as fast as this loop does meets its rate limit
        return retrying(call, what="int8", give_up_s=60, log=lambda *_: None)

    try:
        for _ in range(60):
            lease = patiently(lambda: adv.client.lease(adv.version))["lease"]
            assert lease is not None
            patiently(lambda lease=lease: adv.client.submit(adv.generate(lease)))
            sent += 2  # groups per lease (sampling.worker_batch_prompts)
            settled(adv)
    except Refused as e:  # the key is banned: no more leases
        assert "banned" in str(e), e
    # A banned key may not ask for its record: read it from the store.
    with world.db() as db:
        banned, fraud = db.execute("SELECT banned, fraud FROM workers WHERE name = 'int8'").fetchone()
        reasons = dict(
            db.execute(
                "SELECT reason, COUNT(*) FROM rejections r JOIN workers w ON r.worker = w.key "
                "WHERE w.name = 'int8' GROUP BY reason"
            ).fetchall()
        )
        trained = db.execute(
            "SELECT COUNT(*) FROM groups g JOIN workers w ON g.worker = w.key WHERE w.name = 'int8' "
            "AND g.state IN ('queued', 'consumed')"
        ).fetchone()[0]
    assert banned == 1, (sent, reasons)
    assert reasons.get("evidence") == 1, reasons
    assert trained == 0  # none of its groups is left for the trainer
    print(f"int8 banned after {sent} groups; rejections {reasons}")
    honest_clean(world)


def test_a_cheat_declaring_an_engine_the_calibration_did_not_measure_is_refused_not_judged(world):
    adv = world.worker("int8-as-vllm", "int8_declaring_vllm")
    result = adv.client.submit(adv.generate(lease_of(adv)))
    assert result["accepted"] == [] and {r["reason"] for r in result["rejected"]} == {"engine_refused"}, result
    assert "did not measure the 'vllm' engine" in result["rejected"][0]["detail"]
    me = adv.client.me()
    assert me["fraud"] == 0 and not me["banned"]
    # A worker running that engine stops with the orchestrator's reason rather than send more.
    lease = lease_of(adv)
    entry = adv.outbox / "refused.json"
    entry.write_text(json.dumps({"expires_at": lease["expires_at"], "submission": adv.generate(lease)}))
    with pytest.raises(RefusedEngine, match="refuses this worker's engine: .*it accepts builtin"):
        adv.deliver(entry)


def test_limits_measured_again_on_a_later_version_are_taken_while_the_run_goes_on(world):
    """The drift watch asks for limits measured near the current version: written over the run's
    file, the running orchestrator checks them like a start and judges by them (its in-process
    validator with its next claim); a file that does not pass is logged and changes nothing."""
    from swarmrl.proofs.limits import model_digest
    from swarmrl.validator.calibrate import rechosen

    from adversary_world import train_a_little
    from harness import wait_for

    log = world.run / "orchestrator.log"
    v2 = world.run / "policies" / "v000002"  # a later version the trainer wrote, other weights than v0
    train_a_little(world.run / "policies" / "v000000", v2, steps=2)
    # As `swarmrl calibrate --measured` does it: the limits chosen again (another false-ban rate,
    # so other bounds) from the statistics measured, stamped as measured on v2.
    data = rechosen(world.limits, false_ban_rate=1e-5, horizon=100_000, max_groups_to_ban=64.0)
    data["model"] = {**world.limits["model"], "digest": model_digest(v2), "version": 2}
    before = httpx.get(f"{world.orch.url}/v1/dashboard", timeout=10).json()
    raised = sum(any(r["score"] > 0 for r in w.get("evidence") or []) for w in before["workers"])

    def written(doc: dict) -> None:  # whole or not at all, as `swarmrl calibrate` writes it
        tmp = world.limits_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, world.limits_file)

    written({**data, "dtype": "float32"})
    wait_for(lambda: "is not taken, the run keeps its limits" in log.read_text(), 30, "the refusal", log=log)
    assert "calibrated for float32" in log.read_text()
    written(data)
    line = wait_for(
        lambda: next((x for x in log.read_text().splitlines() if "validator limits: now" in x), None), 30, "the reload",
        log=log,
    )  # fmt: skip
    assert "measured on policy version 2" in line and f"so {raised} keys' evidence scores start again" in line
    assert data["engines"]["builtin"]["evidence"][0]["bound"] != world.limits["engines"]["builtin"]["evidence"][0][
        "bound"]  # fmt: skip
    honest_round(world)
    honest_clean(world)  # still judged, and passed, under the new file
    rows = evidence_of(world, "honest")
    assert {r["bound"] for r in rows} == {m["bound"] for m in data["engines"]["builtin"]["evidence"]}, rows
