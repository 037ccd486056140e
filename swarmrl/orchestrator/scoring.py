"""Trusted scoring of groups: rewards are always recomputed from the tokens, never taken from
a worker."""

from __future__ import annotations

import json

from swarmrl.config import Config
from swarmrl.envs import registry as envs
from swarmrl.envs.episode import runs
from swarmrl.model.tokenizer import decode_completion
from swarmrl.orchestrator.admission import out_of_time
from swarmrl.protocol.rollouts import Group
from swarmrl.rewards.length import length_reward
from swarmrl.rewards.pool import VerifierPool, sendable
from swarmrl.rewards.registry import Graders
from swarmrl.rewards.scoring import Score, score_rows


def score_groups(
    groups: list[Group], *, tokenizer, pool: VerifierPool, cfg: Config, graders: Graders | None = None
) -> list[list[Score]]:
    """Fill `rewards` and `task_rewards` of each group in place; return the Scores per group.
    Task types whose grader owns a resource (code: the sandbox) are graded by `graders`; episodes
    by their environment's `reward` (`score_episodes`)."""
    episodic = {i: g for i, g in enumerate(groups) if envs.for_task_type(g.task_type) is not None}
    done = {i: score_episodes(g, tokenizer=tokenizer, cfg=cfg, pool=pool) for i, g in episodic.items()}
    single = [g for i, g in enumerate(groups) if i not in episodic]
    scored = iter(_score_single(single, tokenizer=tokenizer, pool=pool, cfg=cfg, graders=graders) if single else [])
    return [done[i] if i in done else next(scored) for i in range(len(groups))]


def score_episodes(g: Group, *, tokenizer, cfg: Config, pool=None) -> list[Score]:
    """An episode group's rewards: the environment's grade of each episode's model turns (the
    replay at submission made sure the observations between them are the environment's), shaped
    by length control on the model's tokens (observations are not the model's to shorten).

    With `pool` (a grading lane) and an environment whose `reward` is a module-level function, the
    grades run there, under the pool's per-call timeout and memory limit and, for an unproven key,
    its metered seconds: worker-written text must not cost the orchestrator's process unbounded
    time. A closure (a verifiers environment) is graded here."""
    env = envs.for_task_type(g.task_type)
    assert env is not None, g.task_type
    task = json.loads(g.verification_info)
    stop = [tokenizer.eos_token_id]
    turns = [
        [decode_completion(tokenizer, smp.token_ids[a:b], stop) for a, b, model in runs(smp.model_mask) if model]
        for smp in g.samples
    ]
    if pool is not None and sendable(env.reward):
        graded = [o.value if o.ok else o.error for o in pool.map(env.reward, [(task, t, g.env_seed) for t in turns])]
    else:
        graded = []
        for t in turns:
            spent = out_of_time(pool)
            if spent:  # an unproven key's seconds ran out: the rest score 0, as in the pool
                graded.append(spent)
                continue
            try:
                graded.append(env.reward(task, t, g.env_seed))
            except Exception as e:  # a registered environment's bug: this episode is not graded
                graded.append(repr(e))
    out = []
    for smp, result in zip(g.samples, graded):
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], int | float)):
            out.append(Score(0.0, 0.0, 0.0, f"environment {env.name!r} could not grade: {result}"[:300]))
            continue
        task_reward, reason = float(result[0]), result[1]
        reward = task_reward
        if g.target_length is not None:
            made = sum(smp.model_mask)
            reward = length_reward(task_reward, made, g.target_length, cfg.length.mode, cfg.length.coef)
        out.append(Score(task_reward, task_reward - reward, reward, None, reason))
    g.rewards = [s.reward for s in out]
    g.task_rewards = [s.task_reward for s in out]
    return out


def _score_single(
    groups: list[Group], *, tokenizer, pool: VerifierPool, cfg: Config, graders: Graders | None = None
) -> list[list[Score]]:
    rows = []
    for g in groups:
        for s in g.samples:
            rows.append(
                {
                    "problem_id": g.problem_id,
                    "task_type": g.task_type,
                    "prompt": g.prompt,
                    "verification_info": g.verification_info,
                    # Special tokens stay in: `</think>` decides where the answer may be.
                    "completion": tokenizer.decode(s.token_ids, skip_special_tokens=False),
                    "completion_length": len(s.token_ids),
                    "target_length": g.target_length,
                }
            )
    scores = score_rows(
        rows,
        pool=pool,
        count_tokens=lambda text: len(tokenizer(text)["input_ids"]),
        length_mode=cfg.length.mode,
        length_coef=cfg.length.coef,
        graders=graders,
    )
    out, i = [], 0
    for g in groups:
        mine = scores[i : i + len(g.samples)]
        i += len(g.samples)
        g.rewards = [s.reward for s in mine]
        g.task_rewards = [s.task_reward for s in mine]
        out.append(mine)
    return out
