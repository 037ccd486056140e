"""Benchmark: seconds per warm-start step for each `sft.micro_batches`, side by side.

The same random batches of the default's traces (64 per step) are run as one pass and as
length-sorted micro-batches (swarmrl/sft/warmstart.py), interleaved step by step so that the
machine's noise falls on every setting alike; forward, backward and an AdamW step each.

  python benchmarks/bench_sft.py --threads 2 --parts 1,2,4 --steps 30
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from swarmrl.model.checkpoint import build_tiny_policy
from swarmrl.sft.warmstart import _accumulate, encode_example
from swarmrl.tasks import arithmetic


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parts", default="1,2,4", help="micro_batches settings to compare")
    p.add_argument("--steps", type=int, default=30, help="timed steps per setting (after 3 warm-up steps)")
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    parts = [int(x) for x in args.parts.split(",")]
    if args.threads < 1 or args.steps < 1 or not parts or min(parts) < 1:
        p.error("--threads, --steps and every --parts value must be at least 1")
    torch.set_num_threads(args.threads)
    model, tokenizer = build_tiny_policy(seed=0)
    model.train()
    rows = arithmetic.generate(5000, digits=2, ops="+-", split="train", seed=1000, with_trace=True, slip_rate=0.7)
    examples = [encode_example(tokenizer, r["prompt"], r["trace"]) for r in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(0)
    times: dict[int, list[float]] = {n: [] for n in parts}
    for step in range(args.steps + 3):
        batch = [examples[rng.randrange(len(examples))] for _ in range(args.batch_size)]
        for n in parts:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            _accumulate(model, batch, n, tokenizer.pad_token_id)
            opt.step()
            if step >= 3:
                times[n].append(time.perf_counter() - t0)
    base = statistics.median(times[parts[0]])
    print(
        f"threads {args.threads}, batch {args.batch_size}, {args.steps} steps per setting, "
        f"cpu {torch.backends.cpu.get_cpu_capability()}"
    )
    for n in parts:
        med = statistics.median(times[n])
        print(f"micro_batches {n}: {med:.3f} s per step (median), {med / base:.2f}x micro_batches {parts[0]}")


if __name__ == "__main__":
    main()
