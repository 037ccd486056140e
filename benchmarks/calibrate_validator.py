"""Calibrate the validator's thresholds: what honest workers look like, and what cheats look like.

Honest completions are sampled the way workers sample them (the project's sampler, seeded, with
hidden states, proofs built by the worker code) at several sampler batch sizes and torch thread
counts, from several policy versions of a real run, and checked by the validator's own code
with its own batching (groups of `group_size`, `batch_groups` groups per prefill). For each
TOPLOC chunk we record exp/sign mismatches and mantissa error mean / median; per completion, the
seeded-sampling score gap and the logprob error. The same statistics are then recorded for
cheats: completions of an older version claimed as newer (1, 2, 5 and all versions apart), of
a re-initialised model, and best-of-4 picks with other seeds.

    python benchmarks/calibrate_validator.py --run-dir RUN [--completions 1200] [--out FILE]

RUN is a `swarmrl rl` run directory whose policies/ holds consecutive versions (for example
`swarmrl rl --trainer.steps 12 --trainer.keep_versions 20`). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from pathlib import Path

import torch

from swarmrl.config import ValidatorConfig, load_config
from swarmrl.inference.sampler import Sampler
from swarmrl.model.checkpoint import load_policy
from swarmrl.proofs.toploc import build_proofs_many, encode
from swarmrl.tasks.source import model_input, task_rows
from swarmrl.validator.core import Validator


def sample(model, tok, prompts, seeds, batch, cfg):
    sampler = Sampler(model, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    outs = []
    for i in range(0, len(prompts), batch):
        outs += sampler.generate(prompts[i:i + batch], seeds[i:i + batch], max_new_tokens=cfg.sampling.max_new_tokens,
                                 temperature=cfg.sampling.temperature, return_hidden=True)
    return outs


def to_items(prompts, seeds, outs, version, vcfg, g, temperature):
    proofs = build_proofs_many([o.hidden for o in outs], chunk_size=vcfg.chunk_size, topk=vcfg.topk)
    items = []
    for i in range(0, len(outs), g):
        items.append({"id": len(items), "policy_version": version, "temperature": temperature,
                      "prompt_ids": prompts[i],
                      "samples": [{"token_ids": outs[j].token_ids, "logprobs": outs[j].logprobs, "seed": seeds[j],
                                   "proofs": encode(proofs[j])} for j in range(i, i + g)]})
    return items


def check(validator, model, items, batch_groups):
    """Per-chunk and per-completion statistics, with the validator's own code and batching."""
    chunks, comps = [], []
    for i in range(0, len(items), batch_groups):
        part = items[i:i + batch_groups]
        outs = validator.prefill(model, [(it["prompt_ids"], [s["token_ids"] for s in it["samples"]]) for it in part])
        samples = [s for it in part for s in it["samples"]]
        reports = validator.reports([o for res in outs for o in res], samples,
                                    [it["temperature"] for it in part for _ in it["samples"]])
        for r in reports:
            comps.append({"margin": r.margin_max, "logprob_err": r.logprob_err_max, "proof_error": r.proof_error})
            chunks += [{"exp": c.exp_mismatches, "mean": c.mant_err_mean, "median": c.mant_err_median} for c in r.chunks]
    return chunks, comps


def summary(chunks, comps, vcfg: ValidatorConfig) -> dict:
    def q(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")

    fail_chunk = [not (c["exp"] <= vcfg.exp_mismatches_max and c["mean"] <= vcfg.mant_err_mean_max
                       and c["median"] <= vcfg.mant_err_median_max) for c in chunks]
    out = {"completions": len(comps), "chunks": len(chunks)}
    for key in ("exp", "mean", "median"):
        xs = [c[key] for c in chunks]
        out[f"{key}_max"], out[f"{key}_p50"], out[f"{key}_p99"] = max(xs), q(xs, 0.5), q(xs, 0.99)
    for key in ("margin", "logprob_err"):
        xs = [c[key] for c in comps]
        out[f"{key}_max"], out[f"{key}_p50"], out[f"{key}_min"] = max(xs), q(xs, 0.5), min(xs)
    out["chunks_failing_toploc"] = sum(fail_chunk)
    out["completions_failing_sampling"] = sum(c["margin"] > vcfg.sampling_margin for c in comps)
    out["completions_failing_logprobs"] = sum(c["logprob_err"] > vcfg.logprob_tol for c in comps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--completions", type=int, default=1200, help="honest completions in total")
    ap.add_argument("--out", default="calibration.json")
    args = ap.parse_args()
    rd = Path(args.run_dir)
    cfg = load_config(rd / "config.toml")
    vcfg = cfg.validator
    g = cfg.sampling.group_size
    versions = sorted(int(p.name[1:]) for p in (rd / "policies").glob("v[0-9]*"))
    if len(versions) < 3:
        raise SystemExit(f"{rd}/policies holds {len(versions)} versions; calibration needs consecutive versions")
    models = {v: load_policy(rd / "policies" / f"v{v:06d}")[0].eval() for v in versions}
    tok = load_policy(rd / "policies" / f"v{versions[0]:06d}")[1]
    rows, _ = task_rows(cfg, log=lambda *_: None)
    rng = random.Random(0)
    validator = Validator(vcfg, rd / ".calibration-cache")
    results: dict = {"config": vcfg.model_dump(), "honest": {}, "cheats": {}}

    def prompts_for(n_groups):
        ps = [model_input(tok, rows[rng.randrange(len(rows))]["prompt"], None)[1] for _ in range(n_groups)]
        prompts = [p for p in ps for _ in range(g)]
        return prompts, [rng.getrandbits(63) for _ in prompts]

    # ---- honest: versions x sampler batch sizes x threads --------------------------------------
    settings = [(v, b, t) for v in (versions[0], versions[len(versions) // 2], versions[-1])
                for b, t in ((1, 1), (8, 1), (64, 1), (64, 2), (16, 2))]
    per = max(1, args.completions // (len(settings) * g))
    all_chunks, all_comps = [], []
    t0 = time.time()
    for v, batch, threads in settings:
        torch.set_num_threads(threads)
        prompts, seeds = prompts_for(per)
        outs = sample(models[v], tok, prompts, seeds, batch, cfg)
        torch.set_num_threads(1)  # the validator runs with other settings than the worker
        chunks, comps = check(validator, models[v], to_items(prompts, seeds, outs, v, vcfg, g, cfg.sampling.temperature),
                              vcfg.batch_groups)
        results["honest"][f"v{v}-batch{batch}-threads{threads}"] = summary(chunks, comps, vcfg)
        all_chunks += chunks
        all_comps += comps
    results["honest"]["all"] = summary(all_chunks, all_comps, vcfg)
    torch.set_num_threads(1)

    # ---- cheats --------------------------------------------------------------------------------
    newest = versions[-1]
    for gap in (1, 2, 5, newest - versions[0]):
        old = newest - gap
        if old not in models:
            continue
        prompts, seeds = prompts_for(8)
        outs = sample(models[old], tok, prompts, seeds, 64, cfg)
        chunks, comps = check(validator, models[newest],
                              to_items(prompts, seeds, outs, newest, vcfg, g, cfg.sampling.temperature),
                              vcfg.batch_groups)
        results["cheats"][f"old_version_gap{gap}"] = summary(chunks, comps, vcfg)
    other = copy.deepcopy(models[newest])
    torch.manual_seed(12345)
    for m in other.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    prompts, seeds = prompts_for(8)
    outs = sample(other.eval(), tok, prompts, seeds, 64, cfg)
    chunks, comps = check(validator, models[newest], to_items(prompts, seeds, outs, newest, vcfg, g,
                                                              cfg.sampling.temperature), vcfg.batch_groups)
    results["cheats"]["other_model"] = summary(chunks, comps, vcfg)
    # Cherry-picking: sampled with other seeds, claimed with the lease's.
    prompts, seeds = prompts_for(8)
    outs = sample(models[newest], tok, prompts, [s ^ 0x5DEECE66D for s in seeds], 64, cfg)
    chunks, comps = check(validator, models[newest], to_items(prompts, seeds, outs, newest, vcfg, g,
                                                              cfg.sampling.temperature), vcfg.batch_groups)
    results["cheats"]["other_seeds"] = summary(chunks, comps, vcfg)
    results["seconds"] = time.time() - t0
    Path(args.out).write_text(json.dumps(results, indent=1))

    cols = ["completions", "chunks", "exp_max", "mean_max", "median_max", "margin_max", "logprob_err_max",
            "chunks_failing_toploc", "completions_failing_sampling", "completions_failing_logprobs"]
    print(f"{'':32s}" + "".join(f"{c[:14]:>15s}" for c in cols))
    for part in ("honest", "cheats"):
        for name, s in results[part].items():
            print(f"{part[:6] + ' ' + name:32s}" + "".join(
                f"{s[c]:>15.4g}" if isinstance(s[c], float) else f"{s[c]:>15}" for c in cols))
    print("cheats, median per chunk of the mantissa error mean: " + ", ".join(
        f"{k} {s['mean_p50']:.3g}" for k, s in results["cheats"].items()))


if __name__ == "__main__":
    main()
