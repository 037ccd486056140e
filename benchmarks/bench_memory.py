"""Peak memory of one trainer rank for one GRPO train_step, vs sequence length and model size:
padded vs packed micro-batches, activation checkpointing off/on, full training vs LoRA.

    python benchmarks/bench_memory.py                                  # the default CPU grid
    python benchmarks/bench_memory.py --models 1m --seq-lens 128,512 --lora off
    python benchmarks/bench_memory.py --device cuda --models 0.5b --precision mixed --seq-lens 512,2048
    python benchmarks/bench_memory.py --out memory.json
    python benchmarks/bench_memory.py --model-path ~/.cache/swarmrl/real/models/smollm2-135m-q4 \
        --seq-lens 128 --prompt-len 60 --sequences 32 --micro-batch-size 8 --ac off --lora-rank 16

Each configuration runs in a fresh Python process (`--one SPEC`), so one's allocations never
inflate another's peak. It builds a random Qwen2 of the given size (or, with `--model-path`, loads a
real Hugging Face causal-LM folder), a synthetic GRPO batch, and a `GRPOTrainer` from the configured
fields, then runs one `train_step` (old logprobs recomputed, then one optimizer step over every
micro-batch) and reports its wall time, the trained tokens per second (real prompt + completion
tokens, padding excluded) and:
  CPU:  peak RSS of the process (VmHWM), its RSS before the step, and the step's increase
        (peak - before: activations, gradients, AdamW state, which is allocated on the first step);
        the process baseline (torch + transformers imported, model built) is ~300-400 MB here,
        ~870 MB with a 135M-parameter float32 folder;
  CUDA: torch.cuda.max_memory_allocated during the step, and memory_allocated before it.
A LoRA configuration also reports the byte size of its adapter-only version (the adapter's
safetensors in `sampling.dtype`, float32 by default); with `--model-path` the header says the size
of a full version (the folder's *.safetensors).

Batch: `--sequences` sequences (groups of 4) of a `--prompt-len`-token prompt (default 16) and a
completion drawn uniformly from [seq_len / 4, seq_len - prompt-len] tokens, so lengths are mixed as
in GRPO; token ids are random below the model's vocabulary size. Padded: micro-batches of
`--micro-batch-size` sequences, each padded to its longest. Packed (`trainer.max_tokens_per_micro_batch`):
a budget of micro_batch_size x seq_len tokens, the most a padded micro-batch can hold, so both
compute at most as many tokens per pass. LoRA: `trainer.lora.rank` (`--lora-rank`, default 8) on
every projection (trainer.lora.target_modules' default).

One rank: under FSDP2 the parameter, gradient and optimizer parts of these figures divide by the
number of ranks (and `trainer.cpu_offload` moves them to host memory); activations do not.
"""

from __future__ import annotations

import argparse
import json
import os
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
PROMPT = 16  # default --prompt-len


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _synthetic_groups(n: int, seq_len: int, vocab: int, seed: int, prompt_len: int = PROMPT):
    from swarmrl.protocol.rollouts import Sample, scored_group

    rng = random.Random(seed)
    groups = []
    for g in range(n // 4):
        prompt = [rng.randrange(5, vocab) for _ in range(prompt_len)]
        samples = []
        for s in range(4):
            c = rng.randint(max(1, seq_len // 4), max(1, seq_len - prompt_len))
            ids = [rng.randrange(5, vocab) for _ in range(c)]
            samples.append(Sample(token_ids=ids, logprobs=[-1.0] * c, finish_reason="stop", seed=4 * g + s))
        rewards = [1.0, 0.0, float(g % 2), 0.0]  # informative: non-zero advantages
        groups.append(scored_group(f"p{g}", prompt, samples, rewards, worker="bench"))
    return groups


def measure(spec: dict) -> dict:
    """One configuration, in this process (call it in a fresh one)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from swarmrl.config import load_config
    from swarmrl.trainer.batch import build_train_batch
    from swarmrl.trainer.grpo import GRPOTrainer, weights_dtype

    torch.set_num_threads(spec["threads"])
    n, mbs, seq_len = spec["sequences"], spec["micro_batch_size"], spec["seq_len"]
    prompt_len = spec.get("prompt_len", PROMPT)
    overrides = [
        "--sampling.group_size",
        "4",
        "--sampling.prompts_per_step",
        str(n // 4),
        "--sampling.max_new_tokens",
        str(seq_len - prompt_len),
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
        overrides += ["--trainer.lora.rank", str(spec.get("lora_rank", 8))]
    cfg = load_config(None, overrides)
    torch.manual_seed(0)
    if spec.get("model_path"):  # a real HF folder: its own weights, vocabulary and pad id
        model = AutoModelForCausalLM.from_pretrained(
            spec["model_path"], local_files_only=True, dtype=weights_dtype(cfg)
        ).to(spec["device"])
        vocab = model.config.vocab_size
        pad = model.config.pad_token_id
        pad = model.config.eos_token_id if pad is None else pad
        pad = pad[0] if isinstance(pad, list) else (0 if pad is None else pad)
    else:
        shape = MODELS[spec["model"]]
        config = Qwen2Config(
            **shape,
            max_position_embeddings=max(2048, seq_len),
            tie_word_embeddings=True,
            eos_token_id=2,
            pad_token_id=0,
        )
        model = Qwen2ForCausalLM(config).to(spec["device"])
        vocab, pad = shape["vocab_size"], 0
    parameters = sum(p.numel() for p in model.parameters())
    batch = build_train_batch(
        _synthetic_groups(n, seq_len, vocab, seed=1, prompt_len=prompt_len),
        pad_token_id=pad,
        normalize_std=True,
        adv_eps=1e-6,
    )
    trainer = GRPOTrainer(model, cfg)
    # from_pretrained memory-maps safetensors: its weights enter RSS only when first read. Read every
    # one now, so "before" holds them (a random model's are resident already) and the step's
    # increase is the step's own, not the folder paged in.
    with torch.no_grad():
        for t in (*trainer.model.parameters(), *trainer.model.buffers()):
            t.sum()
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
    tokens = int(batch.attention_mask.sum())
    adapter_bytes = None
    if spec["lora"]:  # what an adapter-only version's weights file would be (trainer/loop.py, model/lora.py)
        from safetensors.torch import save

        from swarmrl.model.lora import adapter_state_dict

        dtype = getattr(torch, cfg.sampling.dtype)
        sd = {k: v.to(dtype) for k, v in adapter_state_dict(trainer.model).items()}
        adapter_bytes = len(save(sd, metadata={"format": "pt"}))
    return {
        **spec,
        "parameters": parameters,
        "trainable": sum(p.numel() for p in trainer.optimizer.param_groups[0]["params"]),
        "tokens": tokens,
        "completion_tokens": int(batch.loss_mask.sum()),
        "padded_tokens": batch.attention_mask.numel(),
        "before_mb": before / 2**20,
        "peak_mb": peak / 2**20,
        "step_mb": (peak - before) / 2**20,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "torch_threads": torch.get_num_threads(),
        "adapter_bytes": adapter_bytes,
        "finite": all(v == v for v in metrics.values()),
    }


def _switch(text: str) -> list[bool]:
    return [{"off": False, "on": True}[v] for v in text.split(",")]


def _cpu_name() -> str:
    """lscpu's model name (falls back to /proc/cpuinfo, then platform)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1m,8m", help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument(
        "--model-path",
        type=Path,
        help="a local Hugging Face causal-LM folder to measure instead of random --models",
    )
    ap.add_argument("--seq-lens", default="128,256,512", help="longest sequence (prompt + completion)")
    ap.add_argument("--prompt-len", type=int, default=PROMPT, help="prompt tokens of every sequence")
    ap.add_argument("--sequences", type=int, default=16, help="sequences in the step (a multiple of 4)")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--modes", default="padded,packed")
    ap.add_argument("--ac", default="off,on", help="activation checkpointing: off, on, or off,on")
    ap.add_argument("--lora", default="off,on", help="LoRA (rank --lora-rank): off, on, or off,on")
    ap.add_argument("--lora-rank", type=int, default=8, help="trainer.lora.rank when LoRA is on")
    ap.add_argument("--precision", default="fp32", help="trainer.precision values, comma-separated")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one JSON spec, print JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return
    model_path = args.model_path.expanduser().resolve() if args.model_path else None
    models = [model_path.name] if model_path else args.models.split(",")
    specs = [
        dict(
            model=m,
            model_path=str(model_path) if model_path else None,
            seq_len=L,
            prompt_len=args.prompt_len,
            lora_rank=args.lora_rank,
            packed=mode == "packed",
            ac=ac,
            lora=lora,
            precision=prec,
            sequences=args.sequences,
            micro_batch_size=args.micro_batch_size,
            device=args.device,
            threads=args.threads,
        )
        for m in models
        for L in map(int, args.seq_lens.split(","))
        for prec in args.precision.split(",")
        for lora in _switch(args.lora)
        for mode in args.modes.split(",")
        for ac in _switch(args.ac)
    ]
    what = "CUDA max_memory_allocated" if args.device.startswith("cuda") else "peak RSS (VmHWM)"
    print(
        f"one GRPO train_step per fresh process; {what}; {args.sequences} sequences of a {args.prompt_len}-token "
        f"prompt, micro-batches of {args.micro_batch_size} (packed: {args.micro_batch_size} x seq_len tokens); "
        f"LoRA rank {args.lora_rank}"
    )
    print(f"machine: {_cpu_name()}, {os.cpu_count()} CPUs; torch threads {args.threads}")
    if model_path:
        full = sum(f.stat().st_size for f in model_path.glob("*.safetensors"))
        print(f"model: {model_path}; a full version's weights (*.safetensors): {full} bytes ({full / 1e6:.1f} MB)")
    w = max(5, *(len(m) for m in models))
    head = (
        f"{'model':>{w}} {'params':>7} {'seq':>5} {'prec':>5} {'train':>5} {'batch':>6} {'ckpt':>4} "
        f"{'tokens':>6} {'before MB':>9} {'peak MB':>8} {'step +MB':>8} {'s':>6} {'tok/s':>6}"
    )
    print(head)
    results = []
    for spec in specs:
        proc = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True, cwd=ROOT
        )
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{spec['model']:>{w}} seq {spec['seq_len']}: failed: {tail}")
            results.append({**spec, "error": tail})
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(r)
        print(
            f"{r['model']:>{w}} {r['parameters'] / 1e6:6.1f}M {r['seq_len']:5d} {r['precision']:>5} "
            f"{'lora' if r['lora'] else 'full':>5} {'packed' if r['packed'] else 'padded':>6} "
            f"{'on' if r['ac'] else 'off':>4} {r['tokens']:6d} {r['before_mb']:9.1f} {r['peak_mb']:8.1f} "
            f"{r['step_mb']:8.1f} {r['seconds']:6.2f} {r['tokens_per_s']:6.1f}"
            + (f"  adapter version {r['adapter_bytes'] / 1e6:.2f} MB" if r.get("adapter_bytes") else ""),
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
