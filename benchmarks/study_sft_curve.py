"""Study (not a test): how held-out accuracy grows during the warm start.

Runs `swarmrl sft`'s own warm start (`train_sft`, with a hook after each step) and scores the
model every --every steps from --start on the default held-out split, as the RL run's evaluation does
(avg@`eval.samples` at `eval.temperature`). It shows
where a recipe's transition (the model learning column arithmetic itself) happens, and so how many
steps a base needs before its accuracy is set by the data rather than by the trajectory
(docs/learning.md, part 1).

One thread by default, so two studies can share a 2-core machine:

  python benchmarks/study_sft_curve.py --every 50 --start 300 --out /tmp/curve.json [--sft.FIELD value ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from swarmrl.config import load_config
from swarmrl.eval.training import evaluate
from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.rewards.pool import VerifierPool
from swarmrl.sft.warmstart import train_sft
from swarmrl.tasks.source import task_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", type=int, default=50, help="steps between evaluations")
    p.add_argument("--start", type=int, default=0, help="first step evaluated (the last step always is)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="sft_curve.json")
    args, overrides = p.parse_known_args()
    if args.every < 1 or args.start < 0 or args.threads < 1:
        p.error("--every and --threads must be at least 1, --start at least 0")
    cfg = load_config(None, [*overrides, "--sft.threads", str(args.threads)])
    held_out = task_rows(cfg, log=lambda *_: None)[1]
    tokenizer = build_char_tokenizer()  # the one train_sft builds its model with
    curve: list[dict] = []
    clock = {"train": 0.0, "since": time.perf_counter()}

    with VerifierPool(1, cfg.rewards.verify_timeout_s) as pool, tempfile.TemporaryDirectory() as tmp:

        def score(step: int, model, loss: torch.Tensor) -> None:
            if not ((step >= args.start and step % args.every == 0) or step == cfg.sft.steps):
                return
            clock["train"] += time.perf_counter() - clock["since"]  # evaluations are not training time
            model.eval()
            accuracy = evaluate(model, tokenizer, held_out, cfg, pool)["eval/accuracy"]
            model.train()
            curve.append(
                {"step": step, "accuracy": accuracy, "loss": float(loss), "train_seconds": round(clock["train"], 1)}
            )
            print(json.dumps(curve[-1]), flush=True)
            clock["since"] = time.perf_counter()

        train_sft(cfg, tmp, log=lambda *_: None, on_step=score)
    with open(args.out, "w") as f:
        json.dump(
            {
                "overrides": overrides,
                "threads": args.threads,
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "curve": curve,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
