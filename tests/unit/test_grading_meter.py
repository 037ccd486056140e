"""Grading time charged to its sender (orchestrator/admission.py): the meter, the metered lane and
the lease kept through a busy lane, by hand with a fake clock; then wired in an `Orchestrator` in
process (no server, no grading processes: a pool that grades inline, or waits while the test
holds it), with hostile answers holding the new workers' lane while an honest key submits."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from swarmrl.config import load_config
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.orchestrator.admission import GradingLanes, GradingMeter, Metered, Spent, extended_expiry
from swarmrl.orchestrator.errors import ApiError
from swarmrl.orchestrator.service import Orchestrator
from swarmrl.proofs.toploc import build_proofs, encode
from swarmrl.protocol.messages import GroupIn
from swarmrl.rewards.pool import Outcome

from runs import TINY_GROUPS

TOKENIZER = build_char_tokenizer()
HIDDEN = 64


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- by hand ---------------------------------------------------------------------------------
def test_the_meter_charges_a_key_and_its_address_and_refills():
    clock = Clock()
    meter = GradingMeter(10.0, 60.0, clock=clock)  # refills 1 s per 6 s
    hostile, neighbour, stranger = (
        GradingLanes.names(k, a) for k, a in (("h", "1.2.3.4"), ("n", "1.2.3.4"), ("s", "5.6.7.8"))
    )
    assert meter.left_s(hostile) == 10.0 and meter.wait_s(hostile) == (0.0, None)
    meter.charge(hostile, 12.0)
    assert meter.left_s(hostile) == -2.0
    # Back to a tenth of the capacity (1 s) after (1 - -2) / (1/6) = 18 s; a new key of the same
    # address waits as long (its address paid), one from elsewhere does not wait at all.
    assert meter.wait_s(hostile) == (pytest.approx(18.0), "key h")
    assert meter.wait_s(neighbour)[0] == pytest.approx(18.0)
    assert meter.wait_s(stranger) == (0.0, None)
    clock.now += 18.0
    assert meter.wait_s(hostile)[0] == 0.0 and meter.left_s(hostile) == pytest.approx(1.0)
    clock.now += 1000.0
    assert meter.left_s(hostile) == 10.0  # never above the capacity


def test_a_metered_lane_stops_once_its_seconds_are_spent():
    clock = Clock()

    class SlowPool:
        num_workers = 1

        def map(self, fn, calls):
            clock.now += len(calls)  # 1 s an answer
            return [Outcome(fn(*c), None, 1.0) for c in calls]

    lane = Metered(SlowPool(), allowed_s=2.5, reason="not graded: spent", clock=clock)
    out = lane.map(str, [(i,) for i in range(6)])
    # Started at 0, 1, 2 s (each under 2.5 s); the other three were never run.
    assert [o.value for o in out[:3]] == ["0", "1", "2"]
    assert [o.error for o in out[3:]] == ["not graded: spent"] * 3 and lane.skipped == 3


def test_a_lease_is_kept_through_a_busy_lane_but_not_for_ever():
    # created 100, due 220 (120 s); each busy refusal keeps it 15 s from then, at most to 100 + 240.
    assert extended_expiry(220.0, 100.0, now=219.0, grace_s=15.0, longest_s=240.0) == 234.0
    assert extended_expiry(220.0, 100.0, now=150.0, grace_s=15.0, longest_s=240.0) == 220.0  # never earlier
    assert extended_expiry(220.0, 100.0, now=339.0, grace_s=15.0, longest_s=240.0) == 340.0  # capped


def test_a_spent_key_waits_while_other_keys_get_the_lane():
    class Lane:
        num_workers = 1

        def map(self, fn, calls):
            clock.now += 3.0 * len(calls)
            return [Outcome(None, "timed out after 3 s", 3.0) for _ in calls]

        def close(self):
            pass

    clock = Clock()
    lanes = GradingLanes([Lane()], wait_s=0.1, meter=GradingMeter(4.0, 60.0, clock=clock))
    with lanes.lane("hostile", False, "1.2.3.4") as lane:
        out = lane.map(str, [(i,) for i in range(8)])
    # Two answers ran (from 0 s and 3 s, both under its 4 s), six were not graded: 6 s charged.
    assert sum(o.error.startswith("not graded") for o in out) == 6
    with pytest.raises(Spent, match="this key used the 4 s of grading") as e:
        with lanes.lane("hostile", False, "1.2.3.4"):
            pass
    assert e.value.retry_after == pytest.approx((0.4 + 2.0) / (4.0 / 60.0))
    with pytest.raises(Spent, match="new workers from 1.2.3.4"):  # a fresh key of the same address
        with lanes.lane("fresh", False, "1.2.3.4"):
            pass
    with lanes.lane("honest", False, "5.6.7.8") as lane:  # another address grades at once
        assert isinstance(lane, Metered)
    with lanes.lane("proven", True, "1.2.3.4") as lane:  # proven keys are not metered
        assert isinstance(lane, Lane)


# ---- wired in the orchestrator -----------------------------------------------------------------
class HeldPool:
    """Grades inline; a call whose completion holds SLOW waits for `release` (a hostile answer
    holding the lane), and every call takes `per_call_s`."""

    num_workers = 1

    def __init__(self, per_call_s: float = 0.0):
        self.release, self.holding = threading.Event(), threading.Event()
        self.per_call_s = per_call_s

    def map(self, fn, calls):
        out = []
        for args in calls:
            if "SLOW" in args[1]:
                self.holding.set()
                assert self.release.wait(30)
            time.sleep(self.per_call_s)
            out.append(Outcome(fn(*args), None, self.per_call_s))
        return out

    def close(self):
        pass


def orchestrator(tmp_path, pool, *overrides: str) -> Orchestrator:
    cfg = load_config(
        None,
        [
            *TINY_GROUPS,
            "--async.max_pending_groups",
            "100",
            "--validator.rate",
            "0",
            "--orchestrator.grading_lanes",
            "1",
            "--orchestrator.grading_wait_s",
            "0.2",
            *overrides,
        ],
    )
    o = Orchestrator(
        cfg,
        tmp_path,
        tokenizer=TOKENIZER,
        vocab_size=len(TOKENIZER),
        hidden_size=HIDDEN,
        trainer_token="t",
        validator_token="v",
        pool=pool,
        log=lambda *_: None,
    )
    o.publish(0, "http://x/v0", {"version": 0})
    return o


def join(o: Orchestrator, key: str, source: str) -> dict:
    """Register `key` (once) and lease from `source`."""
    if o.store.worker(key) is None:
        o.admit_registration(key, source)
        o.authenticate(key, f"nonce-{key[:4]}", time.time(), registering=True)
        o.register(key, key[:4])
    lease = o.lease(key, 0, source)["lease"]
    assert lease is not None
    return lease


def groups(o: Orchestrator, lease: dict, answer=None) -> list[GroupIn]:
    """A group per prompt, each completion answering right (or `answer`), with proofs of the
    right format (their content is the validator's business, off here)."""
    out = []
    for p in lease["prompts"]:
        row = next(r for r in o.rows if r["problem_id"] == p["problem_id"])
        text = answer or json.loads(row["verification_info"])["ground_truth"]
        ids = TOKENIZER(f"</think> \\boxed{{{text}}}", add_special_tokens=False)["input_ids"][:15]
        ids.append(TOKENIZER.eos_token_id)
        proofs = encode(build_proofs(torch.randn(len(ids), HIDDEN), chunk_size=32, topk=128))
        sample = {"token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop", "proofs": proofs}
        out.append(GroupIn(slot=p["slot"], policy_version=0, samples=[sample, sample]))
    return out


def test_an_honest_keys_lease_survives_a_busy_grading_lane(tmp_path):
    pool = HeldPool()
    # Leases of 3 s, kept at most 6 s in all while the lane is busy.
    o = orchestrator(tmp_path, pool, "--orchestrator.lease_timeout_s", "3")
    hostile, honest = "a" * 64, "b" * 64
    hostile_lease, honest_lease = join(o, hostile, "10.0.0.1"), join(o, honest, "10.0.0.2")
    worker = threading.Thread(
        target=o.submit, args=(hostile, hostile_lease["lease_id"], groups(o, hostile_lease, "SLOW"))
    )
    worker.start()
    try:
        assert pool.holding.wait(10)  # the hostile answers hold the new workers' lane
        with pytest.raises(ApiError) as e:
            o.submit(honest, honest_lease["lease_id"], groups(o, honest_lease))
        assert e.value.status == 429 and e.value.code == "grading_busy" and "lease is kept" in e.value.message
        time.sleep(max(0.0, honest_lease["expires_at"] - time.time()) + 0.3)  # past its deadline
        o.lease("c" * 64, 0, "10.0.0.3")  # leasing expires what is due: the honest lease is not
        with pytest.raises(ApiError) as e:
            o.submit(honest, honest_lease["lease_id"], groups(o, honest_lease))
        assert e.value.code == "grading_busy"  # still busy: not 410 lease_expired
    finally:
        pool.release.set()
        worker.join(30)
    reply = o.submit(honest, honest_lease["lease_id"], groups(o, honest_lease))
    assert time.time() > honest_lease["expires_at"]
    assert [a["rewards"] for a in reply["accepted"]] == [[1.0, 1.0]] * 2 and not reply["rejected"]
    o.close()


def test_an_unproven_submission_stops_at_its_grading_seconds(tmp_path):
    pool = HeldPool(per_call_s=0.6)
    o = orchestrator(tmp_path, pool, "--orchestrator.unproven_grading_s", "0.5")
    hostile, honest = "a" * 64, "c" * 64
    lease = join(o, hostile, "10.0.0.1")
    reply = o.submit(hostile, lease["lease_id"], groups(o, lease, "x"))  # 4 answers of 0.6 s
    assert len(reply["accepted"]) == 2  # scored: the answers not graded score 0
    totals = o.totals()
    # Its 0.5 s let the first answer start; the other three were not graded (2.4 s unmetered).
    assert totals["grading/not_graded"] == 3 and totals["grading_seconds/unproven"] < 2.0
    second = join(o, hostile, "10.0.0.1")
    with pytest.raises(ApiError) as e:
        o.submit(hostile, second["lease_id"], groups(o, second))
    assert e.value.status == 429 and e.value.code == "grading_spent" and e.value.retry_after > 1
    assert "this key used the 0.5 s of grading" in e.value.message
    # The hostile key's slots stay open (it may come back), and other addresses' keys grade.
    honest_lease = join(o, honest, "10.0.0.2")
    assert len(o.submit(honest, honest_lease["lease_id"], groups(o, honest_lease))["accepted"]) == 2
    o.close()
