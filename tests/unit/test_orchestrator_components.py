"""The orchestrator's components wired by `Orchestrator`, in process (no server, no verifier
processes: grading runs inline), so a broken dependency between them fails here in seconds.
The HTTP behaviour is tested against a real process in test_orchestrator.py."""

from __future__ import annotations

import json
import time

import pytest

from swarmrl.config import load_config
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.orchestrator.errors import ApiError
from swarmrl.orchestrator.service import Orchestrator
from swarmrl.protocol.messages import GroupIn
from swarmrl.rewards.pool import Outcome

TRUSTED, OTHER = "a" * 64, "b" * 64
TOKENIZER = build_char_tokenizer()


class InlinePool:
    """A verifier pool that grades in this process."""

    def map(self, fn, calls):
        return [Outcome(fn(*args), None, 0.0) for args in calls]

    def close(self) -> None:
        pass


@pytest.fixture
def orch(tmp_path):
    (tmp_path / "trusted.txt").write_text(TRUSTED + "\n")
    cfg = load_config(
        None,
        [
            "--sampling.prompts_per_step",
            "2",
            "--sampling.group_size",
            "2",
            "--sampling.worker_batch_prompts",
            "2",
            "--sampling.max_new_tokens",
            "16",
            "--tasks.train_size",
            "40",
            "--tasks.eval_size",
            "4",
            "--async.bound",
            "1",
            "--validator.rate",
            "1.0",
            "--validator.trusted_rate",
            "1.0",
            "--validator.ban_after",
            "1",
            "--orchestrator.grading_lanes",
            "1",
            "--orchestrator.trusted_keys_file",
            str(tmp_path / "trusted.txt"),
        ],
    )
    logs: list[str] = []
    o = Orchestrator(
        cfg,
        tmp_path,
        tokenizer=TOKENIZER,
        vocab_size=len(TOKENIZER),
        hidden_size=64,
        trainer_token="t",
        validator_token="v",
        pool=InlinePool(),
        log=logs.append,
    )
    o.logs = logs
    yield o
    o.close()


def completion(orch, problem_id: str, right: bool) -> dict:
    row = next(r for r in orch.rows if r["problem_id"] == problem_id)
    answer = json.loads(row["verification_info"])["ground_truth"] if right else "x"
    ids = TOKENIZER(f"</think> \\boxed{{{answer}}}", add_special_tokens=False)["input_ids"]
    ids = ids[:15] + [TOKENIZER.eos_token_id]
    return {"token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop"}


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
