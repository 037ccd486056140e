"""The orchestrator's store over a long run, with payloads pruned once trained on and with every
payload kept (`orchestrator.keep_payload_steps`, swarmrl/orchestrator/retention.py).

    python benchmarks/bench_store.py                        # 2000 steps, 400-token completions
    python benchmarks/bench_store.py --steps 500 --tokens 2000 --every 50 --out store.jsonl

What runs: the orchestrator's own components in this process (tests/support/orchestrator_steps.py:
no HTTP server, grading inline), over a real SQLite file in a temporary run directory. Each step
publishes a version, leases 2 prompts to a trusted key, submits a group of 2 completions of
`--tokens` tokens per prompt (one right, one wrong), passes the validator and builds the batch,
as the trainer's request does. Checkpoints every `--checkpoint-every` steps. Per side and every
`--every` steps: the file's size, its log's, the pages in use, the groups still holding tokens
and their bytes, and the seconds the steps took (grading included). The sides run one after the
other (the pruned one first); the store's sizes are deterministic, the seconds are not.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))


def run_side(root: Path, keep: str, args) -> list[dict]:
    from orchestrator_steps import TRUSTED, make_orchestrator, train_steps_through

    overrides = ["--sampling.max_new_tokens", str(args.tokens + 16)]
    overrides += ["--trainer.checkpoint_every", str(args.checkpoint_every), "--trainer.steps", str(args.steps + 1)]
    overrides += ["--orchestrator.keep_payload_steps", keep, "--tasks.train_size", "200"]
    o = make_orchestrator(root, *overrides)
    rows = []
    try:
        o.admit_registration(TRUSTED, "127.0.0.1")
        o.authenticate(TRUSTED, "nonce", time.time(), registering=True)
        o.register(TRUSTED, "t")
        for start in range(0, args.steps, args.every):
            t0 = time.perf_counter()
            seen = train_steps_through(o, range(start, min(start + args.every, args.steps)), tokens=args.tokens)
            f = seen[-1]
            rows.append(
                {
                    "keep_payload_steps": keep,
                    "steps": start + len(seen),
                    "file_mb": round(f["bytes"] / 2**20, 3),
                    "in_use_mb": round((f["bytes"] - f["free_bytes"]) / 2**20, 3),
                    "wal_mb": round(f["wal_bytes"] / 2**20, 3),
                    "groups_with_tokens": f["groups_with_payload"],
                    "token_mb": round(f["payload_bytes"] / 2**20, 3),
                    "groups_pruned": f["groups_pruned"],
                    "s_per_step": round((time.perf_counter() - t0) / len(seen), 4),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        o.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=400, help="tokens per completion (2 per group, 2 groups a step)")
    p.add_argument("--checkpoint-every", type=int, default=20, help="trainer.checkpoint_every (the default)")
    p.add_argument("--keep", default="8", help="orchestrator.keep_payload_steps of the pruned side")
    p.add_argument("--every", type=int, default=200, help="report every this many steps")
    p.add_argument("--out", help="also write the rows here (JSONL)")
    args = p.parse_args()
    rows = []
    for keep in (args.keep, "all"):
        with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
            rows += run_side(Path(tmp), keep, args)
    pruned = [r for r in rows if r["keep_payload_steps"] != "all"]
    kept = [r for r in rows if r["keep_payload_steps"] == "all"]
    print(f"\n{'steps':>6} {'pruned MB':>10} {'kept MB':>9} {'tokens held (pruned)':>21}")
    for a, b in zip(pruned, kept):
        print(f"{a['steps']:>6} {a['in_use_mb']:>10.2f} {b['in_use_mb']:>9.2f} {a['groups_with_tokens']:>21}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
