"""What verification costs: proof building on the worker, and validation throughput.

1. Proof overhead: a worker's lease (worker_batch_prompts x group_size completions) sampled with
   the project's sampler, once plainly and once keeping hidden states and building the TOPLOC
   proofs, alternated over several repeats in one process. Reported: the median extra time as a
   share of plain generation (goal: under 3%).
2. Validation throughput: the same completions checked by the validator (prefill sharing each
   group's prompt, TOPLOC + seeded-sampling + logprob checks), in generated tokens per second,
   against generation tokens per second (goal: at least 10x; issue 49: 1.8x on a real model
   against the built-in engine). Timed twice per repeat, alternated: the sampling and logprob
   checks through the engine's C kernel pass (`checks.seeded_rows`) and through their torch forms.

Both for the default tiny model (the run's base if cached, else a fresh one of the same shape)
and for a wider model, since the ratio depends on how much decoding is bound by compute rather
than by reading weights.

    python benchmarks/bench_validation.py [--repeats 5] [--threads 1] [--out FILE]
    python benchmarks/bench_validation.py --model <HF folder> --config configs/smollm2-135m.toml  (one model)
        [--dtype bfloat16]   (generation and validation both in bf16: fast on CPUs with AMX)
        [--engine builtin]   (generate with the built-in engine workers run, not the generic sampler)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from swarmrl.config import load_config
from swarmrl.inference.engine import build_engine
from swarmrl.inference.sampler import Sampler
from swarmrl.model.checkpoint import build_tiny_policy, load_policy
from swarmrl.proofs.toploc import build_proofs_many, encode
from swarmrl.protocol.messages import ClaimedGroup, ClaimedSample
from swarmrl.sft.warmstart import base_cache_key
from swarmrl.tasks.source import model_input, task_rows
from swarmrl.validator.core import Validator


def lease_prompts(cfg, tok, rng):
    rows, _ = task_rows(cfg, log=lambda *_: None)
    g = cfg.sampling.group_size
    ps = [
        model_input(tok, rows[rng.randrange(len(rows))]["prompt"], None)[1]
        for _ in range(cfg.sampling.worker_batch_prompts)
    ]
    prompts = [p for p in ps for _ in range(g)]
    return prompts, [rng.getrandbits(63) for _ in prompts]


def measure(name, model, tok, cfg, repeats, rng, dtype: str = "float32", engine: str = "sampler") -> dict:
    if engine == "builtin":
        sampler = build_engine(model.eval(), tok, max_batch=64)
    else:
        sampler = Sampler(model.eval(), stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    v = cfg.validator
    g = cfg.sampling.group_size
    plain, proved, build, check, gen_tokens, val_tokens, refused = [], [], [], [], [], [], []
    validator = Validator(v, "/nonexistent")
    kernels = validator.kernels  # None where the C kernels do not build: both rows then time the torch path
    torch_tokens: list[float] = []
    for _ in range(repeats):
        prompts, seeds = lease_prompts(cfg, tok, rng)
        kw = dict(max_new_tokens=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature)
        t0 = time.perf_counter()
        sampler.generate(prompts, seeds, **kw)
        t1 = time.perf_counter()
        outs = sampler.generate(prompts, seeds, return_hidden=True, **kw)
        t2 = time.perf_counter()
        proofs = build_proofs_many([o.hidden for o in outs], chunk_size=v.chunk_size, topk=v.topk)
        t3 = time.perf_counter()
        plain.append(t1 - t0)
        proved.append(t3 - t1)
        build.append(t3 - t2)
        n = sum(len(o.token_ids) for o in outs)
        gen_tokens.append(n / (t1 - t0))
        items = [
            ClaimedGroup(
                id=i // g,
                worker="bench",
                policy_version=0,
                temperature=cfg.sampling.temperature,
                prompt_ids=prompts[i],
                samples=[
                    ClaimedSample(
                        token_ids=outs[j].token_ids, logprobs=outs[j].logprobs, seed=seeds[j], proofs=encode(proofs[j])
                    )
                    for j in range(i, i + g)
                ],
            )
            for i in range(0, len(outs), g)
        ]
        # The validator's two paths for the sampling and logprob checks, alternated: the engine's
        # C kernel pass (what a validator runs where the kernels build) and the torch forms.
        order = [kernels, None] if len(check) % 2 == 0 else [None, kernels]
        for path in order:
            validator.kernels = path
            t4 = time.perf_counter()
            grouped = validator.prefill(model, [(it.prompt_ids, [s.token_ids for s in it.samples]) for it in items])
            reports = validator.reports(
                [o for res in grouped for o in res],
                [s for it in items for s in it.samples],
                [it.temperature for it in items for _ in it.samples],
            )
            verdicts = [validator.judge(it, reports[k * g : (k + 1) * g], dtype) for k, it in enumerate(items)]
            t5 = time.perf_counter()
            refused += [f"{x.reason}: {x.detail}" for x in verdicts if not x.ok]  # honest groups: should be none
            if path is None:
                torch_tokens.append(n / (t5 - t4))
            else:
                check.append(t5 - t4)
                val_tokens.append(n / (t5 - t4))
    overhead = [(p - q) / q for p, q in zip(proved, plain)]
    res = {
        "model": name,
        "dtype": dtype,
        "engine": type(sampler).__name__,
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "completions_per_lease": len(outs),
        "generated_tokens_per_lease": n,
        "generate_s_median": statistics.median(plain),
        "generate_with_proofs_s_median": statistics.median(proved),
        "proof_build_s_median": statistics.median(build),
        "proof_overhead_median": statistics.median(overhead),
        "proof_build_share_median": statistics.median(b / q for b, q in zip(build, plain)),
        "generation_tokens_per_s": statistics.median(gen_tokens),
        "validation_tokens_per_s": statistics.median(val_tokens),
    }
    res["validation_over_generation"] = res["validation_tokens_per_s"] / res["generation_tokens_per_s"]
    res["validation_kernels"] = kernels is not None
    res["validation_torch_checks_tokens_per_s"] = statistics.median(torch_tokens)
    res["validation_torch_checks_over_generation"] = (
        res["validation_torch_checks_tokens_per_s"] / res["generation_tokens_per_s"]
    )
    res["honest_groups_refused"] = refused
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench_validation.json")
    ap.add_argument("--model", help="an HF folder to measure instead of the default and wider tiny models")
    ap.add_argument("--config", help="the run config whose task, lease and sampling the leases use (with --model)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="with --model")
    ap.add_argument("--engine", default="sampler", choices=["sampler", "builtin"], help="with --model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    if args.model:
        model, tok = load_policy(args.model, dtype=getattr(torch, args.dtype))
        results = [
            measure(Path(args.model).name, model, tok, cfg, args.repeats, random.Random(0), args.dtype, args.engine)
        ]
        Path(args.out).write_text(json.dumps({"threads": args.threads, "results": results}, indent=1))
        report(results)
        return
    base = Path(cfg.model.base_cache_dir) / base_cache_key(cfg)
    if (base / "config.json").exists():
        model, tok = load_policy(base)
        name = "default base (trained)"
    else:
        model, tok = build_tiny_policy(seed=0)
        name = "default shape (untrained; no cached base)"
    rng = random.Random(0)
    results = [measure(name, model, tok, cfg, args.repeats, rng)]
    wide, tok = build_tiny_policy(
        seed=0, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=2048
    )
    results.append(measure("wider, untrained (512 x 8 layers)", wide, tok, cfg, max(2, args.repeats // 2), rng))
    Path(args.out).write_text(json.dumps({"threads": args.threads, "results": results}, indent=1))
    report(results)


def report(results: list[dict]) -> None:
    for r in results:
        print(
            f"{r['model']}: {r['params_M']:.1f}M params, {r['completions_per_lease']} completions, "
            f"{r['generated_tokens_per_lease']} tokens per lease"
        )
        print(
            f"  generate {r['generate_s_median']:.3f} s; with hidden states + proofs "
            f"{r['generate_with_proofs_s_median']:.3f} s: overhead {100 * r['proof_overhead_median']:.1f}% "
            f"(proof building alone {100 * r['proof_build_share_median']:.1f}%, {r['proof_build_s_median'] * 1e3:.1f} ms)"  # noqa: E501
        )
        print(
            f"  generation {r['generation_tokens_per_s']:.0f} tok/s, validation {r['validation_tokens_per_s']:.0f} "
            f"tok/s: {r['validation_over_generation']:.2f}x ({r['dtype']}, {r['engine']}); honest groups refused: "
            f"{len(r['honest_groups_refused'])} {r['honest_groups_refused'][:2]}"
        )
        print(
            f"  the same validation with the torch forms of the sampling and logprob checks: "
            f"{r['validation_torch_checks_tokens_per_s']:.0f} tok/s, "
            f"{r['validation_torch_checks_over_generation']:.2f}x"
            + ("" if r["validation_kernels"] else " (no C kernels here: both rows are the torch path)")
        )


if __name__ == "__main__":
    main()
