"""Training throughput with padded micro-batches vs sequence packing (`trainer.max_tokens_per_micro_batch`).

    python benchmarks/bench_packing.py                           # mixed lengths, default + 30m models
    python benchmarks/bench_packing.py --models 30m --sequences 16 --runs 3
    python benchmarks/bench_packing.py --run-dir runs/X          # the lengths of a real run's batches
    python benchmarks/bench_packing.py --out bench.json

What is timed: one rank's share of an optimizer step, forward + backward over all its
micro-batches, through the trainer's own code (`GRPOTrainer._micro_batches`, `_logits`,
`_unpacked`, `token_logprobs`), with a masked logprob sum as the loss (the GRPO loss on top costs
the same on both sides). Padded: `--micro-batch-size` sequences per pass, each padded to its
longest. Packed: first-fit-decreasing packs of at most each of `--budgets` tokens (one side per
budget). tok/s counts real tokens only (prompt + completion, no padding), so every side is
credited the same work.

Fairness: same process, same model object, same batch; the sides alternate within every run
(padded, packed..., padded, ...) so drift in machine load hits both; one untimed warm-up per side,
then the median of `--runs`; "x padded" is the median of the per-run ratios. Seconds are this
process's CPU time by default, not wall time: on a machine shared with other jobs a single-thread
process's CPU time is its own work, while its wall time swings with everyone else's (`--wall`
for wall time, e.g. with several threads or on an idle machine). float32, `--threads` torch threads (1: the
trainer's default).

Lengths: by default prompts uniform in [20, 40] and completions in [5, 120] tokens (GRPO groups
mix short answers with ones that ran long). `--run-dir` takes them instead from the batches a run
trained on (its orchestrator.sqlite): the default run's groups are much more uniform.
"""

from __future__ import annotations

import argparse
import json
import platform
import sqlite3
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmrl.algorithm.loss import token_logprobs  # noqa: E402
from swarmrl.config import load_config  # noqa: E402
from swarmrl.model.checkpoint import build_tiny_policy  # noqa: E402
from swarmrl.trainer.batch import TrainBatch  # noqa: E402
from swarmrl.trainer.grpo import GRPOTrainer  # noqa: E402

MODELS = {
    "default": {},  # the project's ~1M-parameter tiny Qwen2
    "30m": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=2048),
}


def synthetic_lengths(n: int, prompt: tuple[int, int], completion: tuple[int, int], seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g)
    c = torch.randint(completion[0], completion[1] + 1, (n,), generator=g)
    return list(zip(p.tolist(), c.tolist()))


def run_lengths(run_dir: Path, n: int) -> list[tuple[int, int]]:
    """(prompt, completion) lengths of the first `n` sequences of a run's middle batch."""
    db = sqlite3.connect(f"file:{run_dir / 'orchestrator.sqlite'}?mode=ro", uri=True)
    steps = [s for (s,) in db.execute("SELECT step FROM batches ORDER BY step")]
    if not steps:
        sys.exit(f"{run_dir} has no batches")
    (ids,) = db.execute("SELECT group_ids FROM batches WHERE step = ?", (steps[len(steps) // 2],)).fetchone()
    out = []
    for gid in json.loads(ids):
        (payload,) = db.execute("SELECT payload FROM groups WHERE id = ?", (gid,)).fetchone()
        g = json.loads(payload)
        if g.get("pruned"):  # trained on and pruned (orchestrator.keep_payload_steps): its summary keeps the lengths
            out += [(g["prompt_tokens"], n) for n in g["lengths"]]
        else:
            out += [(len(g["prompt_ids"]), len(s["token_ids"])) for s in g["samples"]]
    return out[:n]


def make_batch(lengths: list[tuple[int, int]], vocab: int, seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    width = max(p + c for p, c in lengths)
    n = len(lengths)
    ids = torch.zeros((n, width), dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1), dtype=torch.bool)
    for i, (p, c) in enumerate(lengths):
        ids[i, : p + c] = torch.randint(5, vocab, (p + c,), generator=g)
        attention[i, : p + c] = 1
        loss_mask[i, p - 1 : p - 1 + c] = True  # batch.py's alignment: column t predicts token t+1
    return TrainBatch(
        ids, attention, loss_mask, torch.zeros((n, width - 1)), torch.ones(n), torch.zeros(n, dtype=torch.long)
    )


def fwd_bwd(trainer: GRPOTrainer, batch: TrainBatch, clock) -> float:
    """Seconds (by `clock`) for forward + backward over every micro-batch of the batch."""
    trainer.model.zero_grad(set_to_none=True)
    t0 = clock()
    for _, mb, pack in trainer._micro_batches(batch, torch.arange(len(batch))):
        logits, targets = trainer._logits(trainer.model, mb, pack)
        lp = trainer._unpacked(pack, token_logprobs(logits, targets))  # [n, w]
        (-(torch.where(mb.loss_mask, lp, 0.0)).sum()).backward()
    return clock() - t0


def bench_model(name: str, lengths: list[tuple[int, int]], args) -> dict:
    model, tokenizer = build_tiny_policy(0, **MODELS[name])
    model.train()
    batch = make_batch(lengths, len(tokenizer), seed=1)
    real = sum(p + c for p, c in lengths)
    longest = max(p + c for p, c in lengths)
    budgets = [max(int(b), longest) for b in args.budgets.split(",")]
    sides = {"padded": load_config(None, ["--trainer.micro_batch_size", str(args.micro_batch_size)])}
    for b in budgets:
        sides[f"packed {b}"] = load_config(
            None,
            [
                "--trainer.max_tokens_per_micro_batch",
                str(b),
                "--sampling.max_new_tokens",
                str(max(c for _, c in lengths)),
            ],
        )
    trainers = {side: GRPOTrainer(model, cfg) for side, cfg in sides.items()}
    computed = {}
    for side, tr in trainers.items():
        micro = tr._micro_batches(batch, torch.arange(len(batch)))
        computed[side] = (
            len(micro),
            sum(mb.input_ids.numel() if pack is None else pack.input_ids.numel() for _, mb, pack in micro),
        )
        fwd_bwd(tr, batch, args.clock)  # warm-up
    times = {side: [] for side in trainers}
    for _ in range(args.runs):
        for side, tr in trainers.items():
            times[side].append(fwd_bwd(tr, batch, args.clock))
    params = sum(p.numel() for p in model.parameters())
    result = {
        "model": name,
        "parameters": params,
        "sequences": len(lengths),
        "real_tokens": real,
        "longest": longest,
        "micro_batch_size": args.micro_batch_size,
        "sides": {},
    }
    for side in trainers:
        med = statistics.median(times[side])
        result["sides"][side] = {
            "passes": computed[side][0],
            "computed_tokens": computed[side][1],
            "median_s": med,
            "tok_per_s": real / med,
            "vs_padded": times_ratio(times, side),
            "runs_s": [round(t, 3) for t in times[side]],
        }
    return result


def times_ratio(times: dict[str, list[float]], side: str) -> float:
    """Throughput of `side` over padded's: the median of the per-run ratios (each run times both
    back to back, so a load change between runs cancels)."""
    return statistics.median(p / s for p, s in zip(times["padded"], times[side]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="default,30m", help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument(
        "--sequences", type=int, default=64, help="sequences in the share (default run: 64 per optimizer step)"
    )
    ap.add_argument("--micro-batch-size", type=int, default=16, help="padded side: sequences per pass")
    ap.add_argument(
        "--budgets",
        default="256,512,2048",
        help="packed sides: tokens per pass, comma-separated (each raised to the longest sequence)",
    )
    ap.add_argument("--prompt", default="20,40", help="synthetic prompt lengths lo,hi")
    ap.add_argument("--completion", default="5,120", help="synthetic completion lengths lo,hi")
    ap.add_argument("--run-dir", type=Path, help="take the lengths from this run's middle batch instead")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--wall", action="store_true", help="time wall-clock seconds (default: this process's CPU seconds, see above)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.clock = time.perf_counter if args.wall else time.process_time
    if args.run_dir:
        lengths = run_lengths(args.run_dir, args.sequences)
        source = f"batch of {args.run_dir}"
    else:
        lo_hi = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
        lengths = synthetic_lengths(args.sequences, lo_hi(args.prompt), lo_hi(args.completion), args.seed)
        source = f"prompts {args.prompt}, completions {args.completion}"
    total = [p + c for p, c in lengths]
    print(
        f"{len(lengths)} sequences ({source}): {min(total)}-{max(total)} tokens, mean {statistics.fmean(total):.1f}; "
        f"torch {torch.__version__}, {args.threads} thread(s), {platform.processor() or platform.machine()}, "
        f"{'wall' if args.wall else 'CPU'} seconds"
    )
    results = []
    for name in args.models.split(","):
        r = bench_model(name, lengths, args)
        results.append(r)
        print(
            f"\n{name} ({r['parameters'] / 1e6:.1f}M parameters), forward + backward of the share, "
            f"median of {args.runs}:"
        )
        for side, s in r["sides"].items():
            what = f"{args.micro_batch_size} seq/pass" if side == "padded" else f"<= {side.split()[1]} tok/pass"
            print(
                f"  {side.split()[0]:6s} ({what:>16s}): {s['passes']:3d} passes, {s['computed_tokens']:6d} tokens "
                f"computed for {r['real_tokens']} real, {s['median_s']:.3f} s, {s['tok_per_s']:7.0f} tok/s, "
                f"{s['vs_padded']:.2f}x padded  runs {s['runs_s']}"
            )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
