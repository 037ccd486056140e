"""Throughput of the project's Sampler against Hugging Face `model.generate`.

    python benchmarks/bench_sampler.py                      # CPU, 2 threads, batch 1/16/64
    python benchmarks/bench_sampler.py --device cuda --out bench.json

How the comparison is kept fair:
- Same model object (the ~1M-parameter `build_tiny_policy()` Qwen2, float32), same prompts
  (random ids, lengths spread around --prompt-len so both paths left-pad), same batch size, same
  temperature, full-vocabulary sampling on both sides (HF: do_sample=True, top_k=0, top_p=1.0).
- Exactly the same number of new tokens per row on both sides, checked after every run:
  * HF: min_new_tokens = max_new_tokens = N, so eos is masked until N tokens exist and generation
    ends at N.
  * Ours: the only stop id is `vocab_size`, an id the model can never emit, so every row runs to
    N tokens ("length"). Eos may be sampled mid-sequence; it is just another token here.
- Each timed call includes prefill + N decode steps and everything either API does per call
  (our left-padding, HF's input preparation and logits processors). HF's input tensors are built
  outside the timer; ours builds them inside `generate`.
- Ours does extra work HF does not: it computes the per-token logprob and the seeded Gumbel noise
  (hash over the vocabulary) every step. Hidden states are not returned (return_hidden=False).
- One untimed warm-up call per batch size and side, then the median of --runs timed calls.
  On CUDA the timer brackets torch.cuda.synchronize().
tok/s counts new tokens only: batch * N / seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmrl.inference.sampler import Sampler  # noqa: E402
from swarmrl.model.checkpoint import build_tiny_policy  # noqa: E402


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, prompt_len - 4), prompt_len + 5, (batch,), generator=g)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lengths]


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, object]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (CPU)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per point (median reported)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.temperature <= 0:
        ap.error("--temperature must be > 0 (HF do_sample needs a positive temperature)")

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, tok = build_tiny_policy()
    model.to(device).eval()
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    N = args.new_tokens

    # No id >= vocab_size can be sampled, so this stop id forces exactly N tokens per row.
    ours = Sampler(model, stop_token_ids=[vocab], pad_token_id=tok.pad_token_id)

    def run_ours(prompts, call):
        seeds = [call * 1_000_003 + i for i in range(len(prompts))]
        out = ours.generate(prompts, seeds, max_new_tokens=N, temperature=args.temperature)
        assert all(len(c.token_ids) == N and c.finish_reason == "length" for c in out)
        return out

    def run_hf(ids, mask, call):
        torch.manual_seed(call)
        with torch.inference_mode():
            seq = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=args.temperature,
                top_k=0, top_p=1.0, min_new_tokens=N, max_new_tokens=N,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            )
        assert seq.shape[1] - ids.shape[1] == N
        assert not (seq[:, ids.shape[1]:] == tok.eos_token_id).any()
        return seq

    rows = []
    print(f"model: tiny Qwen2, {n_params / 1e6:.2f}M params, vocab {vocab}; device {device}; "
          f"threads {torch.get_num_threads()}; {N} new tokens; prompts ~{args.prompt_len} tokens; "
          f"T={args.temperature}; median of {args.runs} after a warm-up", flush=True)
    for B in args.batch_sizes:
        prompts = make_prompts(B, args.prompt_len, vocab, seed=B)
        ids, mask = left_pad(prompts, tok.pad_token_id, device)
        run_ours(prompts, 0)  # warm-up
        run_hf(ids, mask, 0)
        t_ours, t_hf = [], []
        for r in range(1, args.runs + 1):  # interleave so drift hits both sides alike
            t_ours.append(timed(lambda: run_ours(prompts, r), device)[0])
            t_hf.append(timed(lambda: run_hf(ids, mask, r), device)[0])
        m_ours, m_hf = statistics.median(t_ours), statistics.median(t_hf)
        row = {
            "batch": B,
            "ours_tok_s": B * N / m_ours,
            "hf_tok_s": B * N / m_hf,
            "ratio": m_hf / m_ours,
            "ours_seconds": t_ours,
            "hf_seconds": t_hf,
        }
        rows.append(row)
        print(f"  batch {B}: ours {row['ours_tok_s']:.0f} tok/s, HF {row['hf_tok_s']:.0f} tok/s",
              flush=True)

    print()
    print(f"{'batch':>5} | {'ours tok/s':>10} | {'HF tok/s':>10} | {'ours/HF':>7}")
    print(f"{'-' * 5}-+-{'-' * 10}-+-{'-' * 10}-+-{'-' * 7}")
    for row in rows:
        print(f"{row['batch']:>5} | {row['ours_tok_s']:>10.0f} | {row['hf_tok_s']:>10.0f} | "
              f"{row['ratio']:>7.2f}")

    if args.out:
        import transformers

        report = {
            "config": {
                "device": str(device), "threads": torch.get_num_threads(), "new_tokens": N,
                "prompt_len": args.prompt_len, "temperature": args.temperature, "runs": args.runs,
                "model_params": n_params, "vocab_size": vocab,
                "torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version(), "machine": platform.machine(),
            },
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
