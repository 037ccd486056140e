"""Run inside .venv-verifiers (tests/integration/test_verifiers_env.py): a game written for
verifiers' current API (tests/support/vf_guess_v1), loaded as verifiers loads environments,
adapted by swarmrl.envs.verifiers_v1, played, replayed (an edited observation refused) and graded
by its task's reward through swarmrl's own episode code. Prints one JSON line; a failed check raises."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vf_guess_v1, as an installed environment

import verifiers  # noqa: E402
import verifiers.v1 as vf  # noqa: E402
from episode_script import assert_forgery_refused, check, play  # noqa: E402

from swarmrl.envs import registry  # noqa: E402
from swarmrl.envs.verifiers_v1 import from_verifiers_v1, rows_v1  # noqa: E402


def main() -> None:
    env_v1 = vf.load_environment(vf.resolve_env_config({"taskset": {"id": "vf_guess_v1"}}))
    env = registry.register(from_verifiers_v1(env_v1, "vf1-guess", max_turns=5))
    assert registry.for_task_type("env:vf1-guess") is env and env.max_turns == 5
    first, second = rows_v1(env_v1, "vf1-guess")
    assert first["prompt"] == "Guess a number from 1 to 16." and first["task_type"] == "env:vf1-guess"
    task = json.loads(first["verification_info"])
    assert env.check(task) is None and env.check({"prompt": "x"}) is not None  # no answer: not its row

    found = play(env, task, "8", "12", "10", "11", max_turns=5)
    assert found.done and found.turns == 4 and found.observations == 3, found
    replayed = check(env, task, found, 5)
    assert replayed.done and replayed.turns == ["8", "12", "10", "11"]
    assert env.reward(task, replayed.turns, 0) == (1.0, None)
    # The second task hides 12: the same guesses are told "higher" at 11 and end on 12.
    assert [env.respond(json.loads(second["verification_info"]), ["11"], 0).observation] == ["higher"]

    missed = play(env, task, "1", "2", "3", max_turns=3)
    assert not missed.done and missed.turns == 3 and check(env, task, missed, 3).turns == ["1", "2", "3"]
    value, why = env.reward(task, ["1", "2", "3"], 0)
    assert value == 0.0 and "gave 0" in why
    assert env.respond(task, ["pass"], 0).observation == "say a number"

    # A worker that edits the environment's answer ("lower" for "higher") is refused.
    assert_forgery_refused(env, task, found, "higher", "lower_", max_turns=5)
    print(json.dumps({"ok": True, "version": verifiers.__version__, "turns": found.turns}))


if __name__ == "__main__":
    main()
