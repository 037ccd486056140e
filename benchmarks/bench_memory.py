"""Peak memory of one trainer rank for one GRPO train_step, vs sequence length and model size:
padded vs packed micro-batches, activation checkpointing off/on, full training vs LoRA.

    python benchmarks/bench_memory.py                                  # the default CPU grid
    python benchmarks/bench_memory.py --models 1m --seq-lens 128,512 --lora off
    python benchmarks/bench_memory.py --device cuda --models 0.5b --precision mixed --seq-lens 512,2048
    python benchmarks/bench_memory.py --out memory.json

Each configuration runs in a fresh Python process (`--one SPEC`), so one's allocations never
inflate another's peak. It builds a random Qwen2 of the given size, a synthetic GRPO batch, and a
`GRPOTrainer` from the configured fields, then runs one `train_step` (old logprobs recomputed,
then one optimizer step over every micro-batch) and reports:
  CPU:  peak RSS of the process (VmHWM), its RSS before the step, and the step's increase
        (peak - before: activations, gradients, AdamW state, which is allocated on the first step);
        the process baseline (torch + transformers imported, model built) is ~300-400 MB here;
  CUDA: torch.cuda.max_memory_allocated during the step, and memory_allocated before it.

Batch: `--sequences` sequences (groups of 4) of a 16-token prompt and a completion drawn uniformly
from [seq_len / 4, seq_len - 16] tokens, so lengths are mixed as in GRPO. Padded: micro-batches of
`--micro-batch-size` sequences, each padded to its longest. Packed (`trainer.max_tokens_per_micro_batch`):
a budget of micro_batch_size x seq_len tokens, the most a padded micro-batch can hold, so both
compute at most as many tokens per pass. LoRA: `trainer.lora.rank` 8 on every projection.

One rank: under FSDP2 the parameter, gradient and optimizer parts of these figures divide by the
number of ranks (and `trainer.cpu_offload` moves them to host memory); activations do not.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# hidden, layers, heads, kv heads, intermediate, vocab. 1m is the project's tiny default; 0.5b
# is Qwen2-0.5B's shape (random weights), for a CUDA device.
MODELS = {
    "1m": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=261,
    ),
    "8m": dict(
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1024,
        vocab_size=261,
    ),
    "30m": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=261,
    ),
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
    ),
}
PROMPT = 16


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _synthetic_groups(n: int, seq_len: int, vocab: int, seed: int):
    from swarmrl.protocol.rollouts import Group, Sample

    rng = random.Random(seed)
    groups = []
    for g in range(n // 4):
        prompt = [rng.randrange(5, vocab) for _ in range(PROMPT)]
        samples = []
        for s in range(4):
            c = rng.randint(max(1, seq_len // 4), max(1, seq_len - PROMPT))
            samples.append(Sample([rng.randrange(5, vocab) for _ in range(c)], [-1.0] * c, "stop", 4 * g + s))
        rewards = [1.0, 0.0, float(g % 2), 0.0]  # informative: non-zero advantages
        groups.append(
            Group(
                f"p{g}", "synthetic", "", "{}", prompt, samples, 0, "bench", 1.0, rewards=rewards, task_rewards=rewards
            )
        )
    return groups


def measure(spec: dict) -> dict:
    """One configuration, in this process (call it in a fresh one)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from swarmrl.config import load_config
    from swarmrl.trainer.batch import build_train_batch
    from swarmrl.trainer.grpo import GRPOTrainer

    torch.set_num_threads(spec["threads"])
    shape = MODELS[spec["model"]]
    n, mbs, seq_len = spec["sequences"], spec["micro_batch_size"], spec["seq_len"]
    overrides = [
        "--sampling.group_size",
        "4",
        "--sampling.prompts_per_step",
        str(n // 4),
        "--sampling.max_new_tokens",
        str(seq_len - PROMPT),
        "--trainer.optimizer_steps",
        "1",
        "--trainer.micro_batch_size",
        str(mbs),
        "--trainer.precision",
        spec["precision"],
        "--trainer.activation_checkpointing",
        str(spec["ac"]).lower(),
        "--model.device",
        spec["device"],
    ]
    if spec["packed"]:
        overrides += ["--trainer.max_tokens_per_micro_batch", str(mbs * seq_len)]
    if spec["lora"]:
        overrides += ["--trainer.lora.rank", "8"]
    cfg = load_config(None, overrides)
    torch.manual_seed(0)
    config = Qwen2Config(
        **shape, max_position_embeddings=max(2048, seq_len), tie_word_embeddings=True, eos_token_id=2, pad_token_id=0
    )
    model = Qwen2ForCausalLM(config).to(spec["device"])
    batch = build_train_batch(
        _synthetic_groups(n, seq_len, shape["vocab_size"], seed=1), pad_token_id=0, normalize_std=True, adv_eps=1e-6
    )
    trainer = GRPOTrainer(model, cfg)
    cuda = spec["device"].startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _status_kb("VmRSS") * 1024
    t0 = time.perf_counter()
    metrics = trainer.train_step(batch)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else _status_kb("VmHWM") * 1024
    return {
        **spec,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in trainer.optimizer.param_groups[0]["params"]),
        "tokens": int(batch.attention_mask.sum()),
        "before_mb": before / 2**20,
        "peak_mb": peak / 2**20,
        "step_mb": (peak - before) / 2**20,
        "seconds": seconds,
        "finite": all(v == v for v in metrics.values()),
    }


def _switch(text: str) -> list[bool]:
    return [{"off": False, "on": True}[v] for v in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1m,8m", help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--seq-lens", default="128,256,512", help="longest sequence (prompt + completion)")
    ap.add_argument("--sequences", type=int, default=16, help="sequences in the step (a multiple of 4)")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--modes", default="padded,packed")
    ap.add_argument("--ac", default="off,on", help="activation checkpointing: off, on, or off,on")
    ap.add_argument("--lora", default="off,on", help="LoRA rank 8: off, on, or off,on")
    ap.add_argument("--precision", default="fp32", help="trainer.precision values, comma-separated")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one JSON spec, print JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return
    specs = [
        dict(
            model=m,
            seq_len=L,
            packed=mode == "packed",
            ac=ac,
            lora=lora,
            precision=prec,
            sequences=args.sequences,
            micro_batch_size=args.micro_batch_size,
            device=args.device,
            threads=args.threads,
        )
        for m in args.models.split(",")
        for L in map(int, args.seq_lens.split(","))
        for prec in args.precision.split(",")
        for lora in _switch(args.lora)
        for mode in args.modes.split(",")
        for ac in _switch(args.ac)
    ]
    what = "CUDA max_memory_allocated" if args.device.startswith("cuda") else "peak RSS (VmHWM)"
    print(
        f"one GRPO train_step per fresh process; {what}; {args.sequences} sequences, micro-batches of "
        f"{args.micro_batch_size} (packed: {args.micro_batch_size} x seq_len tokens); torch threads {args.threads}; "
        f"{platform.processor() or platform.machine()}"
    )
    head = (
        f"{'model':>5} {'params':>7} {'seq':>5} {'prec':>5} {'train':>5} {'batch':>6} {'ckpt':>4} "
        f"{'tokens':>6} {'before MB':>9} {'peak MB':>8} {'step +MB':>8} {'s':>6}"
    )
    print(head)
    results = []
    for spec in specs:
        proc = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True, cwd=ROOT
        )
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{spec['model']:>5} seq {spec['seq_len']}: failed: {tail}")
            results.append({**spec, "error": tail})
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        print(
            f"{r['model']:>5} {r['parameters'] / 1e6:6.1f}M {r['seq_len']:5d} {r['precision']:>5} "
            f"{'lora' if r['lora'] else 'full':>5} {'packed' if r['packed'] else 'padded':>6} "
            f"{'on' if r['ac'] else 'off':>4} {r['tokens']:6d} {r['before_mb']:9.1f} {r['peak_mb']:8.1f} "
            f"{r['step_mb']:8.1f} {r['seconds']:6.2f}",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
