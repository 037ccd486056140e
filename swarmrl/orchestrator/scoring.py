"""Trusted scoring of groups: rewards are always recomputed from the tokens, never taken from
a worker."""

from __future__ import annotations

from swarmrl.config import Config
from swarmrl.protocol.rollouts import Group
from swarmrl.rewards.pool import VerifierPool
from swarmrl.rewards.registry import Graders
from swarmrl.rewards.scoring import Score, score_rows


def score_groups(
    groups: list[Group], *, tokenizer, pool: VerifierPool, cfg: Config, graders: Graders | None = None
) -> list[list[Score]]:
    """Fill `rewards` and `task_rewards` of each group in place; return the Scores per group.
    Task types whose grader owns a resource (code: the sandbox) are graded by `graders`."""
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
