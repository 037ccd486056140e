"""Benchmark (not a test): the same short `swarmrl rl` job at async bound k=0 and k=2.

What it measures, per run, from the run's metrics.jsonl (steps after the first few, which
include start-up):
  step      mean time/step (wall time per trainer step)
  gen       mean time/generation: worker seconds spent producing what that step consumed
            (stale and uninformative groups included)
  train     mean time/train + time/publish: trainer seconds per step
  ratio     step / max(gen, train). With perfect overlap of inference and training, a step
            takes as long as the slower of the two: the ideal is 1.0. Synchronous (k=0) is
            expected near (gen + train) / max(gen, train).

On a 2-core machine the worker and the trainer each get one thread, so both sides compete for
the same two cores; the figures say how well the loop overlaps them, not how fast a GPU would be.

Usage: python benchmarks/bench_async.py [--steps 30] [--out FILE.json] [extra swarmrl overrides]
The base model is the cached default one (built on first use by `swarmrl sft`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(k: int, steps: int, extra: list[str], root: Path) -> dict:
    run_dir = root / f"k{k}"
    cmd = [
        sys.executable,
        "-m",
        "swarmrl.cli",
        "rl",
        "--run-dir",
        str(run_dir),
        "--async.bound",
        str(k),
        "--trainer.steps",
        str(steps),
        "--eval.every",
        "0",
        "--logging.plots",
        "false",
        "--logging.progress",
        "false",
        *extra,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rec = [r for r in records if "time/step" in r][3:]  # skip start-up steps
    step = statistics.fmean(r["time/step"] for r in steps_rec)
    gen = statistics.fmean(r["time/generation"] for r in steps_rec)
    train = statistics.fmean(r["time/train"] + r["time/publish"] for r in steps_rec)
    return {
        "k": k,
        "step_s": step,
        "generation_s": gen,
        "train_s": train,
        "ratio_to_ideal": step / max(gen, train),
        "max_off_policy": max(r["off_policy/max"] for r in steps_rec),
        "dropped_groups": sum(r["off_policy/dropped"] for r in steps_rec),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", help="write the figures as JSON")
    args, extra = p.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(k, args.steps, extra, Path(tmp)) for k in (0, 2)]
    print(
        f"{'k':>2} {'step s':>8} {'gen s':>8} {'train s':>8} {'step/max(gen,train)':>20} {'off-policy max':>15} {'dropped':>8}"  # noqa: E501
    )
    for r in results:
        print(
            f"{r['k']:>2} {r['step_s']:>8.2f} {r['generation_s']:>8.2f} {r['train_s']:>8.2f} "
            f"{r['ratio_to_ideal']:>20.2f} {r['max_off_policy']:>15.0f} {r['dropped_groups']:>8.0f}"
        )
    speedup = results[0]["step_s"] / results[1]["step_s"]
    print(f"k=2 step time is {1 / speedup:.2f}x k=0's ({speedup:.2f}x faster)")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": results, "k2_over_k0_step_time": 1 / speedup}, indent=1))


if __name__ == "__main__":
    main()
