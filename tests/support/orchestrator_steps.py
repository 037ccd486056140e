"""The orchestrator's components driven in process (no server, no verifier processes: grading runs
inline), for tests/unit/test_orchestrator_components.py and benchmarks/bench_store.py: an
orchestrator over a run directory, and whole steps through it (publish, lease, submit, validate,
build the batch)."""

from __future__ import annotations

import json

from swarmrl.config import load_config
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.orchestrator.retention import footprint
from swarmrl.orchestrator.service import Orchestrator
from swarmrl.protocol.messages import GroupIn
from swarmrl.rewards.pool import Outcome

from runs import TINY_GROUPS

TRUSTED, OTHER = "a" * 64, "b" * 64
TOKENIZER = build_char_tokenizer()


class InlinePool:
    """A verifier pool that grades in this process (a call that raises is its error, as in the real pool)."""

    def map(self, fn, calls):
        return [self._call(fn, args) for args in calls]

    @staticmethod
    def _call(fn, args) -> Outcome:
        try:
            return Outcome(fn(*args), None, 0.0)
        except Exception as e:
            return Outcome(None, f"{type(e).__name__}: {e}", 0.0)

    def close(self) -> None:
        pass


def make_orchestrator(tmp_path, *overrides: str, limits: dict | None = None) -> Orchestrator:
    cfg = orchestrator_config(tmp_path, *overrides)
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
        limits=limits,
    )
    o.logs = logs
    return o


def orchestrator_config(tmp_path, *overrides: str):
    (tmp_path / "trusted.txt").write_text(TRUSTED + "\n")
    return load_config(
        None,
        [
            *TINY_GROUPS,
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
            *overrides,
        ],
    )


def long_completion(orch, problem_id: str, right: bool, tokens: int) -> dict:
    """A completion of `tokens` tokens (reasoning padded before the answer), right or wrong."""
    row = next(r for r in orch.rows if r["problem_id"] == problem_id)
    answer = json.loads(row["verification_info"])["ground_truth"] if right else "x"
    tail = TOKENIZER(f"</think> \\boxed{{{answer}}}", add_special_tokens=False)["input_ids"]
    pad = TOKENIZER("think " * tokens, add_special_tokens=False)["input_ids"][: tokens - len(tail) - 1]
    ids = pad + tail + [TOKENIZER.eos_token_id]
    return {"token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop"}


def submit_groups(o, key: str, version: int, samples) -> tuple[dict, dict]:
    """Lease for `key` and submit a group per prompt, its completions `samples(problem_id)` (an
    openai-engine group: a trusted key's); (the lease, the reply)."""
    lease = o.lease(key, version)["lease"]
    groups = [
        GroupIn(slot=p["slot"], policy_version=version, engine="openai", samples=samples(p["problem_id"]))
        for p in lease["prompts"]
    ]
    return lease, o.submit(key, lease["lease_id"], groups)


def train_steps_through(o, steps: range, tokens: int) -> list[dict]:
    """Steps of a run driven through the orchestrator's components: publish the version, lease,
    submit a group of a right and a wrong completion per prompt, pass the validator, build the
    batch. The store's footprint after each step."""
    seen = []
    for step in steps:
        o.publish(step, f"http://x/v{step}", {"version": step})
        pair = lambda problem: [long_completion(o, problem, r, tokens) for r in (True, False)]  # noqa: E731
        _, reply = submit_groups(o, TRUSTED, step, pair)
        assert len(reply["accepted"]) == 2
        items = o.claim_validation(10)["items"]
        o.record_verdicts([{"id": item["id"], "ok": True} for item in items])
        assert o.build_batch(step)["ready"]
        with o.store.read() as db:
            seen.append(footprint(o.store, db))
    return seen
