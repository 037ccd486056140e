"""Study (not a test): how held-out accuracy grows during the warm start.

Runs `swarmrl sft`'s own recipe (the same data, batches, schedule and `sft.micro_batches` passes as
swarmrl/sft/warmstart.py) and scores the model every --every steps from --start on the default
held-out split, as the RL run's evaluation does (avg@`eval.samples` at `eval.temperature`). It shows
where a recipe's transition (the model learning column arithmetic itself) happens, and so how many
steps a base needs before its accuracy is set by the data rather than by the trajectory
(docs/learning.md, part 1).

One thread by default, so two studies can share a 2-core machine:

  python benchmarks/study_sft_curve.py --every 50 --start 300 --out /tmp/curve.json [--sft.FIELD value ...]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch

from swarmrl.config import load_config
from swarmrl.eval.training import evaluate
from swarmrl.model.checkpoint import build_tiny_policy
from swarmrl.rewards.pool import VerifierPool
from swarmrl.sft.warmstart import _accumulate, _sft_target, encode_example
from swarmrl.tasks import arithmetic
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
    cfg = load_config(None, overrides)
    s = cfg.sft
    torch.set_num_threads(args.threads)
    # What train_sft does, step for step, with an evaluation between steps.
    torch.manual_seed(s.seed)
    model, tokenizer = build_tiny_policy(seed=s.seed)
    model.train()
    rows = arithmetic.generate(s.examples, digits=cfg.tasks.digits, ops=cfg.tasks.ops, split="train",
                               seed=s.seed + 1000, with_trace=True, slip_rate=s.slip_rate,
                               verbosity=tuple(s.verbosity))
    target_rng = random.Random(s.seed + 2000)
    examples = [encode_example(tokenizer, r["prompt"], r["trace"], _sft_target(tokenizer, r["trace"], cfg, target_rng))
                for r in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.99), weight_decay=0.01)
    warmup = max(1, s.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, s.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng = random.Random(s.seed)
    held_out = task_rows(cfg, log=lambda *_: None)[1]
    curve, train_seconds = [], 0.0
    with VerifierPool(1, cfg.rewards.verify_timeout_s) as pool:
        for step in range(1, s.steps + 1):
            t0 = time.perf_counter()
            batch = [examples[rng.randrange(len(examples))] for _ in range(s.batch_size)]
            opt.zero_grad(set_to_none=True)
            loss = _accumulate(model, batch, s.micro_batches, tokenizer.pad_token_id)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            train_seconds += time.perf_counter() - t0
            if (step >= args.start and step % args.every == 0) or step == s.steps:
                model.eval()
                accuracy = evaluate(model, tokenizer, held_out, cfg, pool)["eval/accuracy"]
                model.train()
                curve.append({"step": step, "accuracy": accuracy, "loss": float(loss),
                              "train_seconds": round(train_seconds, 1)})
                print(json.dumps(curve[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"overrides": overrides, "threads": args.threads,
                   "cpu_capability": torch.backends.cpu.get_cpu_capability(), "curve": curve}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
