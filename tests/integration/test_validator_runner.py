"""The validator's claim loop when work cannot be checked yet (issue 18: an external validator
whose trainer was down retried 1,053 times in 15 s and counted every put-back group as checked)."""

from __future__ import annotations

from swarmrl.config import ValidatorConfig
from swarmrl.validator.core import Validator
from swarmrl.validator.runner import Pause, Round, validate_once

from harness import free_port


def test_pause_backs_off_while_work_waits_and_resets_on_progress():
    p = Pause(idle_s=0.05, idle_max=0.5, stuck_min=1.0, stuck_max=15.0)
    stuck = [p.after(Round(checked=0, waiting=3)) for _ in range(6)]
    assert stuck == [1.0, 2.0, 4.0, 8.0, 15.0, 15.0]
    assert p.after(Round(checked=2, waiting=1)) == 0.0  # progress: claim again at once
    assert p.after(Round(checked=0, waiting=1)) == 1.0  # and the back-off starts over
    idle = [p.after(Round()) for _ in range(6)]
    assert idle == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]


class _Source:
    """An orchestrator's claim/record pair, in memory (the loop under test is the validator's)."""

    def __init__(self, items, policies):
        self.items, self.policies, self.recorded = items, policies, []

    def claim(self, n):
        return {
            "items": self.items[:n],
            "policies": self.policies,
            "min_version": 0,
            "config": ValidatorConfig().model_dump(),
            "dtype": "float32",
        }

    def record(self, verdicts, retry):
        self.recorded.append((verdicts, list(retry)))


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there: the trainer's origin is down


def test_groups_whose_policy_cannot_load_are_put_back_not_counted_and_logged_once(tmp_path):
    items = [
        {
            "id": i,
            "worker": "w",
            "policy_version": 3,
            "temperature": 1.0,
            "prompt_ids": [1, 2],
            "samples": [],
            "checks": "full",
            "engine_dtype": None,
        }
        for i in range(4)
    ]
    policies = {"3": {"url": _dead_url(), "manifest": {"version": 3, "files": [], "public_key": ""}}}
    source = _Source(items, policies)
    lines = []
    v = Validator(ValidatorConfig(), tmp_path / "validator", log=lines.append)
    rounds = [validate_once(source, v, 8) for _ in range(5)]
    assert rounds == [Round(checked=0, waiting=4)] * 5
    assert all(verdicts == [] and retry == [0, 1, 2, 3] for verdicts, retry in source.recorded)
    said = [line for line in lines if "cannot load policy v3" in line]
    assert len(said) == 1, lines  # not once per claim
