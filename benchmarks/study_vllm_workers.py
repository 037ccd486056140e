"""Study (not a test): does a run with an untrusted proving vLLM worker learn like a run with
built-in workers only, and is any of the vLLM worker's honest work refused?

For each seed, two real `swarmrl rl` runs (orchestrator validating every group, trainer, relay,
workers on loopback) of the same config:

  builtin  `async.workers 2` (the default)
  vllm     `async.workers 1 --async.vllm_workers 1`: one built-in worker and one proving vLLM
           worker (`swarmrl worker --engine vllm` on `async.vllm_python`)

and reads each run's summary.json (held-out accuracy before and after) and orchestrator.sqlite:
per worker, the groups it submitted, how many the validator judged and passed, what was
rejected and why, and the fraud count. Writes results.json and table.md into --out; a run whose
folder already holds summary.json is read, not rerun.

Usage: python benchmarks/study_vllm_workers.py --seeds 0,1 --out /tmp/study_vllm [swarmrl overrides]
A default-config pair takes about 6 minutes on 2 cores after the base is built (the first run
of a seed builds it: 3.5-7.5 minutes); needs .venv-vllm (`make vllm-env`).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import tomllib
from pathlib import Path

SIDES = {"builtin": [], "vllm": ["--async.workers", "1", "--async.vllm_workers", "1"]}


def run(side: str, seed: int, out: Path, extra: list[str]) -> Path:
    run_dir = out / f"{side}-s{seed}"
    if (run_dir / "summary.json").exists():
        return run_dir
    cmd = [sys.executable, "-m", "swarmrl.cli", "rl", "--run-dir", str(run_dir), "--seed", str(seed)]
    cmd += ["--sft.seed", str(seed), "--logging.progress", "false", *SIDES[side], *extra]
    print(" ".join(cmd), flush=True)
    with open(out / f"{side}-s{seed}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
    return run_dir


def read(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    group_size = tomllib.loads((run_dir / "config.toml").read_text())["sampling"]["group_size"]
    db = sqlite3.connect(run_dir / "orchestrator.sqlite")
    workers = {}
    for key, name, fraud, banned in db.execute("SELECT key, name, fraud, banned FROM workers"):
        rows = db.execute("SELECT state, verdict FROM groups WHERE worker = ?", (key,)).fetchall()
        verdicts = [json.loads(v) for _, v in rows if v is not None]
        rejected = dict(
            db.execute("SELECT reason, COUNT(*) FROM rejections WHERE worker = ? GROUP BY reason", (key,)).fetchall()
        )
        workers[name] = {
            "groups": len(rows),
            "completions": len(rows) * group_size,
            "judged": len(verdicts),
            "passed": sum(v["ok"] for v in verdicts),
            "trained": sum(state == "consumed" for state, _ in rows),
            "rejected": rejected,
            "fraud": fraud,
            "banned": bool(banned),
        }
    return {
        "before": summary["accuracy_before"],
        "after": summary["accuracy_after"],
        "gain": summary["accuracy_gain"],
        "steps": summary["steps"],
        "wall_s": summary["wall_seconds"],
        "workers": workers,
    }


def table(results: dict) -> str:
    lines = [
        "| seed | side | held-out before | after | gain | vLLM worker: groups (completions) / judged / passed / "
        "trained / rejected | other workers: rejected | fraud |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        side, seed = key.rsplit("-s", 1)
        vllm = {n: w for n, w in r["workers"].items() if "vllm" in n}
        other = {n: w for n, w in r["workers"].items() if "vllm" not in n}
        cells = [
            f"{w['groups']} ({w['completions']}) / {w['judged']} / {w['passed']} / {w['trained']} / "
            + str(w["rejected"] or 0)
            for w in vllm.values()
        ]
        v = "; ".join(cells) or "-"
        o = ", ".join(f"{n}: {w['rejected'] or 0}" for n, w in other.items())
        fraud = sum(w["fraud"] for w in r["workers"].values())
        lines.append(
            f"| {seed} | {side} | {r['before']:.3f} | {r['after']:.3f} | {r['gain']:+.3f} | {v} | {o} | {fraud} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--sides", default="vllm,builtin")
    parser.add_argument("--out", required=True)
    args, extra = parser.parse_known_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for side in args.sides.split(","):
            results[f"{side}-s{seed}"] = read(run(side, seed, out, extra))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
