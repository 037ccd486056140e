"""Held-out accuracy on multi-turn tasks: the trainer's model plays each held-out episode
`eval.samples` times (the same turn-by-turn sampling as a worker, `inference/episodes.py`) and
the environment grades it. Besides `eval/accuracy` (the mean reward, avg@k), what a researcher
moving to agentic tasks watches: turns per episode, tool calls and tool errors per episode, and
how many turns the solved episodes took, and the share solved within each number of turns (the
fair measure of "fewer turns to solve": a policy that solves more games also solves some on a late
turn, which raises the mean turns of the solved ones)."""

from __future__ import annotations

import json
import statistics

from swarmrl.config import Config
from swarmrl.envs import registry as envs
from swarmrl.envs.episode import runs
from swarmrl.eval.runner import sample_seeds
from swarmrl.inference.engine import build_engine
from swarmrl.inference.episodes import EpisodeJob, play_episodes
from swarmrl.model.tokenizer import decode_completion
from swarmrl.tasks.source import episode_spec, model_input


def is_episodic(rows: list[dict]) -> bool:
    return any(envs.for_task_type(r.get("task_type")) is not None for r in rows)


def evaluate_episodes(model, tokenizer, rows: list[dict], cfg: Config) -> dict[str, float]:
    """`eval/accuracy` and the episode metrics over held-out episode rows (every row must be an
    episode: a run's tasks are all episodes or none)."""
    k = cfg.eval.samples
    engine = build_engine(model, tokenizer, max_batch=64)
    stop = list(engine.stop_token_ids)
    rewards, turns, calls, errors, solved_turns = [], [], [], [], []
    by_env: dict[str, list[int]] = {}
    turn_cap = 1
    for i, row in enumerate(rows):
        env = envs.for_task_type(row.get("task_type"))
        if env is None:
            raise ValueError(
                f"held-out row {row.get('problem_id')!r} is not an episode: mix no episodes with other tasks"
            )
        by_env.setdefault(env.name, []).append(i)
    for name, idx in by_env.items():
        env = envs.get(name)
        jobs, meta = [], []
        for i in idx:
            seeds = sample_seeds(cfg.seed, i, k)
            spec = episode_spec(cfg, rows[i], seeds)
            _, ids = model_input(tokenizer, rows[i]["prompt"], None)
            for s in seeds:
                jobs.append(EpisodeJob(spec["task"], spec["seed"], ids, s))
                meta.append((json.loads(rows[i]["verification_info"]), spec))
        turn_cap = max(turn_cap, meta[0][1]["max_turns"])
        played = play_episodes(
            engine,
            tokenizer,
            env,
            jobs,
            max_turns=meta[0][1]["max_turns"],
            max_tokens=meta[0][1]["max_tokens"],
            temperature=cfg.eval.temperature,
        )
        for p, job, (task, _) in zip(played, jobs, meta, strict=True):
            ep = p.episode
            said = [decode_completion(tokenizer, ep.tokens[a:b], stop) for a, b, m in runs(ep.model_mask) if m]
            reward, why_not = env.reward(task, said, job.env_seed)
            rewards.append(reward)
            turns.append(ep.turns)
            calls.append(ep.observations)
            errors.append(ep.tool_errors)
            if why_not is None:  # solved, whatever a turn cost took off its reward
                solved_turns.append(ep.turns)
    n = len(rewards)
    metrics = {
        "eval/accuracy": statistics.fmean(rewards),
        "eval/problems": float(len(rows)),
        "eval/episode/turns_mean": statistics.fmean(turns),
        "eval/episode/tool_calls_mean": statistics.fmean(calls),
        "eval/episode/tool_call_rate": sum(1 for c in calls if c) / n,
        "eval/episode/tool_errors_mean": statistics.fmean(errors),
    }
    metrics.update(solved_metrics(solved_turns, n, turn_cap))
    return metrics


def solved_metrics(solved_turns: list[int], episodes: int, max_turns: int) -> dict[str, float]:
    """`eval/episode/solved` (share of the `episodes` solved), `solved_by_turn_K` for K = 1 ..
    `max_turns` (share solved within K model turns) and `turns_when_solved` (when any was)."""
    out = {"eval/episode/solved": len(solved_turns) / episodes}
    for k in range(1, max_turns + 1):
        out[f"eval/episode/solved_by_turn_{k}"] = sum(1 for t in solved_turns if t <= k) / episodes
    if solved_turns:
        out["eval/episode/turns_when_solved"] = statistics.fmean(solved_turns)
    return out
