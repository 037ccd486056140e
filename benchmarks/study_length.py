"""Study (not a test): does a policy follow "Think for N tokens before giving a response."?

For each model and each length target, runs `swarmrl eval --length-target N` on the held-out
problems (avg@k at T = 1, the same seeds for every model) and reads its per-sample lengths:

  rel error   mean |length - N| / N over all samples (the issue's adherence error)
  length      mean and quartiles of the completion length in tokens
  accuracy    avg@k of the task reward (length shaping is not part of it)

Writes results.json, table.md and lengths.png (completion length against target, one panel per
model) into --out.

Usage (after `swarmrl rl --config configs/length-control.toml --run-dir runs/length`):
    python benchmarks/study_length.py --config configs/length-control.toml \\
        --model base=.cache/swarmrl/base/<key> --model rl=runs/length/policies/v000100 --out /tmp/study_length
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tomllib
from pathlib import Path


def run_eval(model: str, target: int, args, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "swarmrl.cli",
        "eval",
        "--model",
        model,
        "--benchmark",
        "arithmetic",
        "--config",
        args.config,
        "--length-target",
        str(target),
        "--k",
        str(args.k),
        "--max-tokens",
        str(args.max_tokens),
        "--temperature",
        "1.0",
        "--seed",
        str(args.seed),
        "--output-dir",
        str(out),
    ]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"eval of {model} at target {target} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    lengths = [n for line in (out / "results.jsonl").read_text().splitlines() for n in json.loads(line)["lengths"]]
    return {
        "target": target,
        "accuracy": summary[f"avg@{args.k}"],
        "lengths": lengths,
        "rel_error": statistics.fmean(abs(n - target) / target for n in lengths),
    }


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| model | target N | mean length | quartiles | rel error mean abs(len-N)/N | accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        for r in rows:
            q = statistics.quantiles(r["lengths"], n=4)
            lines.append(
                f"| {name} | {r['target']} | {statistics.fmean(r['lengths']):.1f} | "
                f"{q[0]:.0f} / {q[1]:.0f} / {q[2]:.0f} | {r['rel_error']:.3f} | {r['accuracy']:.3f} |"
            )
        lines.append(
            f"| {name} | **all** | | | **{statistics.fmean(r['rel_error'] for r in rows):.3f}** | "
            f"**{statistics.fmean(r['accuracy'] for r in rows):.3f}** |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.2), sharey=True, squeeze=False)
    for ax, (name, rows) in zip(axes[0], results.items()):
        targets = [r["target"] for r in rows]
        ax.violinplot([r["lengths"] for r in rows], positions=targets, widths=10, showmedians=True)
        ax.plot(
            [min(targets) - 10, max(targets) + 10],
            [min(targets) - 10, max(targets) + 10],
            "k--",
            lw=1,
            label="length = N",
        )
        err = statistics.fmean(r["rel_error"] for r in rows)
        acc = statistics.fmean(r["accuracy"] for r in rows)
        ax.set_title(f"{name}: rel. error {err:.2f}, accuracy {acc:.2f}", fontsize=10)
        ax.set_xlabel("target N in the prompt (tokens)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("completion length (tokens)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lengths.png", dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config",
        default="configs/length-control.toml",
        help="the run's config: its [length] targets and max_new_tokens are used",
    )
    p.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="a model folder to evaluate, named for the table (repeatable)",
    )
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--limit", type=int, default=0, help="only the first N held-out problems (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/study_length")
    args = p.parse_args()
    cfg = tomllib.loads(Path(args.config).read_text())
    targets = cfg.get("length", {}).get("targets")
    if not targets:
        p.error(f"{args.config} has no [length] targets")
    args.max_tokens = cfg.get("sampling", {}).get("max_new_tokens", 64)
    models = {}
    for item in args.model:
        name, sep, path = item.partition("=")
        if not sep or not Path(path, "config.json").exists():
            p.error(f"--model wants NAME=PATH to an HF model folder, got {item!r}")
        models[name] = path
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        name: [run_eval(path, n, args, out / "evals" / f"{name}-N{n}") for n in targets]
        for name, path in models.items()
    }
    (out / "results.json").write_text(json.dumps(results))
    (out / "table.md").write_text(table(results))
    plot(results, out)
    print(table(results))


if __name__ == "__main__":
    main()
