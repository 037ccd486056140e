"""Study (not a test): how much asynchrony costs under each off-policy objective.

Runs the real `swarmrl rl` loop (orchestrator, trainer, relay, workers on loopback) for every
cell of async bound k x objective x seed, and reads each run's metrics.jsonl:

  acc@step   held-out avg@4 (T = 1) at every evaluation step
  wall       trainer wall time (sum of time/step) at those steps
  off-policy mean staleness (steps) of the trained groups, and the mean |log p_prox - log p_behav|
             per token where the objective recomputes (the off-policy gap the correction sees)

Objectives (see swarmrl/algorithm/offpolicy.py):
  seed        old logprobs recomputed by the trainer, no correction (INTELLECT-2; the default
              before this study)
  behaviour   old logprobs = the worker's: the PPO clip itself bounds the off-policy ratio
  decoupled   decoupled PPO (AReaL): clip against the recomputed policy, weight each token by
              min(p_prox / p_behav, 2) (the default since this study)
  masked      decoupled, and tokens whose ratio leaves [1/4, 4] are dropped
  sequence    decoupled with the geometric mean of a sequence's ratios, capped at 2

By default the orchestrator's queue is made (k + 1) batches deep, so data really is up to k steps
old (the production back-pressure keeps it near 1 whatever the bound; `--production-queue` keeps
that instead). Writes results.json, table.md and plots into --out.

Usage: python benchmarks/study_async.py --ks 0,1,2,4 --objectives seed,decoupled --seeds 0,1 \
           --steps 60 --eval-every 10 --out docs/study_async [extra swarmrl overrides]
Each run takes about as long as a default run of that many steps (a 60-step run: 2-4 minutes on 2
cores); the whole default grid is many of them: run it on a quiet machine, because wall-time
figures are only comparable within one sitting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

OBJECTIVES = {
    "seed": ["--algorithm.tis_cap", "off"],
    "behaviour": ["--algorithm.old_logprobs", "inference"],
    "decoupled": ["--algorithm.tis_cap", "2.0"],
    "masked": ["--algorithm.tis_cap", "2.0", "--algorithm.tis_mask_band", "4.0"],
    "sequence": ["--algorithm.tis_cap", "2.0", "--algorithm.tis_level", "sequence"],
}


def run_cell(k: int, objective: str, seed: int, args, extra: list[str], root: Path) -> dict:
    run_dir = root / f"k{k}-{objective}-s{seed}"
    cmd = [
        sys.executable,
        "-m",
        "swarmrl.cli",
        "rl",
        "--run-dir",
        str(run_dir),
        "--seed",
        str(seed),
        "--async.bound",
        str(k),
        "--trainer.steps",
        str(args.steps),
        "--eval.every",
        str(args.eval_every),
        "--logging.plots",
        "false",
        "--logging.progress",
        "false",
        *OBJECTIVES[objective],
    ]
    if not args.production_queue:
        cmd += ["--async.max_pending_groups", str(args.prompts_per_step * (k + 1))]
    cmd += extra
    started = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"run {run_dir.name} failed (exit {proc.returncode}); its logs are in {run_dir}/logs\n"
            + proc.stderr[-2000:]
        )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    wall, curve, gaps, stale, gap_curve = 0.0, [], [], [], []
    for r in records:
        wall += r.get("time/step", 0.0)
        if "eval/accuracy" in r:
            curve.append({"step": r.get("step", 0), "wall_s": round(wall, 1), "accuracy": r["eval/accuracy"]})
        if "off_policy/logprob_abs_diff" in r:
            gaps.append(r["off_policy/logprob_abs_diff"])
            gap_curve.append([r.get("step", 0), r["off_policy/logprob_abs_diff"]])
        if "off_policy/mean" in r:
            stale.append(r["off_policy/mean"])
    return {
        "k": k,
        "objective": objective,
        "seed": seed,
        "curve": curve,
        "gap_curve": gap_curve,
        "staleness_mean": statistics.fmean(stale) if stale else 0.0,
        "logprob_gap_mean": statistics.fmean(gaps) if gaps else None,
        "seconds": round(time.monotonic() - started, 1),
    }


def first_wall_to_gain(curve: list[dict], gain: float) -> float | None:
    base = curve[0]["accuracy"]
    return next((c["wall_s"] for c in curve if c["accuracy"] - base >= gain), None)


def table(results: list[dict], gain: float) -> str:
    cells: dict[tuple[int, str], list[dict]] = {}
    for r in results:
        cells.setdefault((r["k"], r["objective"]), []).append(r)
    lines = [
        f"| k | objective | seeds | base | final acc (mean, min-max) | gain | wall to +{round(gain * 100)} pts "
        "(mean) | staleness | log-prob gap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (k, obj), runs in sorted(cells.items()):
        finals = [r["curve"][-1]["accuracy"] for r in runs]
        bases = [r["curve"][0]["accuracy"] for r in runs]
        walls = [first_wall_to_gain(r["curve"], gain) for r in runs]
        reached = [w for w in walls if w is not None]
        wall = f"{statistics.fmean(reached):.0f} s ({len(reached)}/{len(runs)})" if reached else "not reached"
        gaps = [r["logprob_gap_mean"] for r in runs if r["logprob_gap_mean"] is not None]
        lines.append(
            f"| {k} | {obj} | {len(runs)} | {statistics.fmean(bases):.3f} | {statistics.fmean(finals):.3f} "
            f"({min(finals):.3f}-{max(finals):.3f}) | {statistics.fmean(finals) - statistics.fmean(bases):+.3f} | "
            f"{wall} | {statistics.fmean(r['staleness_mean'] for r in runs):.2f} | "
            f"{statistics.fmean(gaps):.4f} |"
            if gaps
            else f"| {k} | {obj} | {len(runs)} | {statistics.fmean(bases):.3f} | {statistics.fmean(finals):.3f} "
            f"({min(finals):.3f}-{max(finals):.3f}) | {statistics.fmean(finals) - statistics.fmean(bases):+.3f} | "
            f"{wall} | {statistics.fmean(r['staleness_mean'] for r in runs):.2f} | n/a |"
        )
    return "\n".join(lines) + "\n"


def _mean_curves(runs: list[dict], key: str) -> tuple[list[float], list[float], list[float]]:
    """Steps, mean trainer wall time and mean accuracy over a cell's seeds (common eval steps)."""
    n = min(len(r["curve"]) for r in runs)
    steps = [runs[0]["curve"][i]["step"] for i in range(n)]
    wall = [statistics.fmean(r["curve"][i]["wall_s"] for r in runs) for i in range(n)]
    acc = [statistics.fmean(r["curve"][i][key] for r in runs) for i in range(n)]
    return steps, wall, acc


def plots(results: list[dict], out: Path) -> None:
    """Accuracy vs step and vs wall time (mean over seeds; colour = k, line style = objective),
    and the per-token off-policy gap the trainer measured at each step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells: dict[tuple[int, str], list[dict]] = {}
    for r in results:
        cells.setdefault((r["k"], r["objective"]), []).append(r)
    ks = sorted({k for k, _ in cells})
    colours = dict(zip(ks, ["black", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]))
    styles = dict(zip(OBJECTIVES, ["-", "--", ":", "-.", (0, (5, 1))]))
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for (k, obj), runs in sorted(cells.items()):
        label = f"k={k} {obj} ({len(runs)} seeds)"
        kw = {"color": colours[k], "linestyle": styles[obj], "marker": "."}
        steps, wall, acc = _mean_curves(runs, "accuracy")
        axes[0].plot(steps, acc, label=label, **kw)
        axes[1].plot(wall, acc, label=label, **kw)
        gap_runs = [r.get("gap_curve") for r in runs if r.get("gap_curve")]
        if gap_runs:
            n = min(len(g) for g in gap_runs)
            axes[2].plot(
                [gap_runs[0][i][0] for i in range(n)],
                [statistics.fmean(g[i][1] for g in gap_runs) for i in range(n)],
                color=colours[k],
                linestyle=styles[obj],
                label=label,
            )
    axes[0].set_xlabel("trainer step")
    axes[1].set_xlabel("trainer wall time (s)")
    for ax in axes[:2]:
        ax.set_ylabel("held-out avg@4 (T=1), mean over seeds")
    axes[2].set_xlabel("trainer step")
    axes[2].set_ylabel("mean |log p_trainer - log p_worker| per token")
    axes[2].set_title("off-policy gap (objectives that recompute)", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", default="0,1,2,4")
    p.add_argument("--objectives", default=",".join(OBJECTIVES))
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--prompts-per-step", type=int, default=16, help="must match sampling.prompts_per_step")
    p.add_argument("--gain", type=float, default=0.20, help="the gain whose wall time the table reports")
    p.add_argument(
        "--production-queue",
        action="store_true",
        help="keep the orchestrator's default back-pressure (staleness stays near 1)",
    )
    p.add_argument("--out", default="docs/study_async")
    args, extra = p.parse_known_args()
    unknown = [o for o in args.objectives.split(",") if o not in OBJECTIVES]
    if unknown:
        p.error(f"unknown objective(s) {', '.join(unknown)}; choose from {', '.join(OBJECTIVES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = out / "runs"
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    done = {(r["k"], r["objective"], r["seed"]) for r in results}
    for k in [int(x) for x in args.ks.split(",")]:
        # At k = 0 every objective is the same update up to float rounding: run only the seed's.
        for objective in ["seed"] if k == 0 else args.objectives.split(","):
            for seed in [int(x) for x in args.seeds.split(",")]:
                if (k, objective, seed) in done:
                    continue
                r = run_cell(k, objective, seed, args, extra, root)
                results.append(r)
                results_path.write_text(json.dumps(results, indent=1))  # resumable cell by cell
                print(
                    f"k={k} {objective} seed {seed}: {r['curve'][0]['accuracy']:.3f} -> "
                    f"{r['curve'][-1]['accuracy']:.3f}, staleness {r['staleness_mean']:.2f}, {r['seconds']:.0f} s",
                    flush=True,
                )
    (out / "table.md").write_text(table(results, args.gain))
    plots(results, out)
    print(table(results, args.gain))


if __name__ == "__main__":
    main()
