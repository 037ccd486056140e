"""Multi-turn episodes from untrusted workers (issue 31): a real orchestrator process on 127.0.0.1
whose tasks are episodes of the `guess` environment, its in-process validator at rate 1, and
workers that play them through the built-in engine and submit over signed HTTP.

The honest worker's episodes (model turns, the environment's observations between them, one
proof per chunk of each turn) pass the replay and every check of the validator; each multi-turn
cheat is refused with its own reason; a worker speaking the protocol from before episodes gets
no lease. The policy is the harness's tiny model, whose turns end early enough (it writes the
end-of-turn token at random) that most episodes have several turns.
"""

from __future__ import annotations

import json

import pytest

from swarmrl.envs.episode import runs
from swarmrl.protocol.client import Refused

from adversary_world import World, honest_clean, lease_of, settled
from orchestrator_harness import closed_clean

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(
        tmp_path_factory.mktemp("episodes"),
        "--tasks.source",
        "guess",
        "--tasks.guess_high",
        "8",
        "--sampling.max_new_tokens",
        "96",
    )
    yield from closed_clean(w)


def multi_turn(submission: dict) -> int:
    """Episodes of a submission with more than one model turn."""
    return sum(
        1 for g in submission["groups"] for s in g["samples"] if sum(1 for r in runs(s["model_mask"]) if r[2]) > 1
    )


def test_honest_episodes_pass_the_replay_and_the_full_check(world):
    episodes = 0
    for _ in range(2):
        sub = world.honest.generate(lease_of(world.honest))
        episodes += multi_turn(sub)
        for g in sub["groups"]:
            for s in g["samples"]:
                # Token in, token out: one mask entry per token, observations without logprobs.
                assert len(s["model_mask"]) == len(s["token_ids"]) == len(s["logprobs"])
                assert all(lp == 0.0 for lp, m in zip(s["logprobs"], s["model_mask"]) if not m)
        result = world.honest.client.submit(sub)
        assert result["rejected"] == [] and len(result["accepted"]) == 2
    assert episodes >= 2, "the tiny policy should end some turns early enough for a second one"
    honest_clean(world)
    with world.db() as db:
        rows = db.execute("SELECT payload, verdict FROM groups WHERE verdict IS NOT NULL").fetchall()
    assert len(rows) >= 4
    for payload, verdict in rows:
        v, g = json.loads(verdict), json.loads(payload)
        assert v["ok"], v
        assert g["task_type"] == "env:guess" and g["env_seed"] is not None
        for s in g["samples"]:
            # The trusted side's replay is kept with the sample (dashboard and batch metrics).
            assert s["model_mask"] is not None and s["ended_by_env"] in (True, False)


def _cheat(world: World, kind: str) -> tuple[list[dict], dict]:
    """Leases of an adversary until one had a multi-turn episode to cheat with; its rejections
    and its record once judged."""
    adv = world.worker(f"adv-{kind}", kind)
    rejected = []
    for _ in range(4):
        sub = adv.generate(lease_of(adv))
        result = adv.client.submit(sub)
        rejected += result["rejected"]
        if multi_turn(sub) or rejected:
            break
    return rejected, settled(adv)


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("edit_observation", "observation_mismatch"),  # a forged tool answer or feedback
        ("truncate_episode", "stopped_early"),  # the episode cut before the environment ended it
        ("self_observation", "turn_not_stopped"),  # the model wrote the observations itself
    ],
)
def test_multi_turn_cheats_are_refused_at_submission(world, kind, reason):
    rejected, record = _cheat(world, kind)
    assert rejected and {r["reason"] for r in rejected} == {reason}, rejected
    assert record["fraud"] >= 1 and record["rejections"].get(reason, 0) >= 1, record
    honest_clean(world)


def test_turns_sampled_with_the_wrong_seeds_fail_the_validators_sampling_check(world):
    # Every observation is the environment's and every proof honest, so the replay passes: the
    # validator's per-turn check finds tokens that are not the seeded choice under turn_seed.
    adv = world.worker("adv-seeds", "reuse_turn_seed")
    for _ in range(4):
        sub = adv.generate(lease_of(adv))
        assert adv.client.submit(sub)["rejected"] == []
        if multi_turn(sub):
            break
    record = settled(adv)
    assert record["rejections"].get("sampling", 0) >= 1, record
    honest_clean(world)


def test_a_worker_from_before_episodes_gets_no_lease(world):
    w = world.honest
    with pytest.raises(Refused) as e:
        w.client._signed("/v1/leases", {"policy_version": w.version})  # no protocol_version: v2
    assert e.value.code == "protocol_too_old" and "upgrade swarmrl" in e.value.detail
