"""Calibrate the validator's thresholds: what honest workers look like, and what cheats look like.

Honest completions are sampled the way workers sample them (a rollout engine, `--engine`, seeded, with
hidden states, proofs built by the worker code) at several sampler batch sizes and torch thread
counts, from several policy versions of a real run, and checked by the validator's own code
with its own batching (groups of `group_size`, `batch_groups` groups per prefill). For each
TOPLOC chunk we record exp/sign mismatches and mantissa error mean / median; per completion, the
seeded-sampling score gap and the logprob error. The same statistics are then recorded for
cheats: completions of an older version claimed as newer (1, 2, 5 and all versions apart), of
a re-initialised model, of the claimed version with its weights quantised to int8 or int4 (a
cheaper model that is nearly the same), and best-of-4 picks with other seeds.

`--dtype` is the run's inference precision (`sampling.dtype`): honest workers sample in it and
the validator prefills in it, as in a run. The precision mismatches are recorded too: honest
work checked in the other dtype (what a validator with a fixed dtype did before runs declared
one) and work sampled in the other dtype (a worker that ignores the lease's dtype).

    python benchmarks/calibrate_validator.py --run-dir RUN [--dtype bfloat16] [--completions 1200] [--out FILE]

RUN is a `swarmrl rl` run directory whose policies/ holds consecutive versions (for example
`swarmrl rl --trainer.steps 12 --trainer.keep_versions 20`). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import time
from pathlib import Path

import torch

from swarmrl.config import ValidatorConfig, load_config
from swarmrl.inference.engine import ENGINES, build_engine
from swarmrl.model.checkpoint import load_policy
from swarmrl.proofs.toploc import build_proofs_many, encode
from swarmrl.tasks.source import model_input, task_rows
from swarmrl.validator.core import Validator


def quantised(model, bits: int, group: int = 32):
    """A copy of `model` whose decoder linear weights are rounded to `bits`-bit integers
    (symmetric, one scale per `group` consecutive inputs of an output row) and stored back in
    the model's dtype: what a weight-only int8 / int4 (GPTQ, AWQ-style) checkpoint computes.
    Embeddings and the output head stay exact, as those tools leave them."""
    out = copy.deepcopy(model)
    levels = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for layer in out.model.layers:
            for m in layer.modules():
                if isinstance(m, torch.nn.Linear):
                    w = m.weight.float()  # [out, in]
                    g = w.reshape(w.shape[0], -1, group)  # [out, in / group, group]
                    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / levels
                    m.weight.copy_(((g / scale).round().clamp(-levels, levels) * scale).reshape_as(w))
    return out.eval()


ENGINE = "builtin"  # --engine: which rollout engine honest workers (and cheats) sample with


def sample(model, tok, prompts, seeds, batch, cfg, streams=1):
    """Completions as a worker samples them; ``batch`` rows at once (the built-in engine gets
    all prompts and keeps ``batch`` slots busy, refilling them; the generic one gets chunks);
    ``streams`` above 1: the built-in engine in that many processes (`worker --streams`)."""
    sampler = build_engine(model, tok, kind=ENGINE, max_batch=batch, streams=streams)
    if sampler.continuous:
        try:
            return sampler.generate(
                prompts,
                seeds,
                max_new_tokens=cfg.sampling.max_new_tokens,
                temperature=cfg.sampling.temperature,
                return_hidden=True,
            )
        finally:
            if hasattr(sampler, "close"):
                sampler.close()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += sampler.generate(
            prompts[i : i + batch],
            seeds[i : i + batch],
            max_new_tokens=cfg.sampling.max_new_tokens,
            temperature=cfg.sampling.temperature,
            return_hidden=True,
        )
    return outs


def to_items(prompts, seeds, outs, version, vcfg, g, temperature):
    proofs = build_proofs_many([o.hidden for o in outs], chunk_size=vcfg.chunk_size, topk=vcfg.topk)
    items = []
    for i in range(0, len(outs), g):
        items.append(
            {
                "id": len(items),
                "policy_version": version,
                "temperature": temperature,
                "prompt_ids": prompts[i],
                "samples": [
                    {
                        "token_ids": outs[j].token_ids,
                        "logprobs": outs[j].logprobs,
                        "seed": seeds[j],
                        "proofs": encode(proofs[j]),
                    }
                    for j in range(i, i + g)
                ],
            }
        )
    return items


def check(validator, model, items, batch_groups):
    """Per-chunk and per-completion statistics, with the validator's own code and batching."""
    chunks, comps = [], []
    for i in range(0, len(items), batch_groups):
        part = items[i : i + batch_groups]
        outs = validator.prefill(model, [(it["prompt_ids"], [s["token_ids"] for s in it["samples"]]) for it in part])
        samples = [s for it in part for s in it["samples"]]
        reports = validator.reports(
            [o for res in outs for o in res], samples, [it["temperature"] for it in part for _ in it["samples"]]
        )
        for r in reports:
            mine = [{"exp": c.exp_mismatches, "mean": c.mant_err_mean, "median": c.mant_err_median} for c in r.chunks]
            comps.append(
                {"margin": r.margin_max, "logprob_err": r.logprob_err_max, "proof_error": r.proof_error, "chunks": mine}
            )
            chunks += mine
    return chunks, comps


def summary(chunks, comps, vcfg: ValidatorConfig, dtype: str, group_size: int) -> dict:
    def q(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")

    lim = vcfg.limits(dtype)  # what Validator.judge applies in a run sampling in `dtype`

    def chunk_fails(c):
        return not (
            c["exp"] <= lim["exp_mismatches_max"]
            and c["mean"] <= lim["mant_err_mean_max"]
            and c["median"] <= lim["mant_err_median_max"]
        )

    out = {"completions": len(comps), "chunks": len(chunks)}
    for key in ("exp", "mean", "median"):
        xs = [c[key] for c in chunks]
        out[f"{key}_max"], out[f"{key}_p50"], out[f"{key}_p99"] = max(xs), q(xs, 0.5), q(xs, 0.99)
    for key in ("margin", "logprob_err"):
        xs = [c[key] for c in comps]
        out[f"{key}_max"], out[f"{key}_p50"], out[f"{key}_min"] = max(xs), q(xs, 0.5), min(xs)
    out["chunks_failing_toploc"] = sum(chunk_fails(c) for c in chunks)
    out["completions_failing_sampling"] = sum(c["margin"] > lim["sampling_margin"] for c in comps)
    out["completions_failing_logprobs"] = sum(c["logprob_err"] > lim["logprob_tol"] for c in comps)
    # What a run sees: a completion fails when any check does, and one such completion rejects
    # its whole group.
    failed = [
        c["proof_error"] is not None
        or any(chunk_fails(k) for k in c["chunks"])
        or c["margin"] > lim["sampling_margin"]
        or c["logprob_err"] > lim["logprob_tol"]
        for c in comps
    ]
    out["completions_rejected"] = sum(failed)
    # ... and so does a group whose typical chunk is too far off (Validator.judge).
    medians = [
        statistics.median(
            [k["mean"] for c in comps[i : i + group_size] for k in c["chunks"] if not math.isnan(k["mean"])] or [0.0]
        )
        for i in range(0, len(comps), group_size)
    ]
    out["groups"] = len(medians)
    out["group_median_max"], out["group_median_p50"], out["group_median_min"] = (
        max(medians),
        q(medians, 0.5),
        min(medians),
    )
    out["groups_failing_group_check"] = sum(m > lim["group_mant_err_max"] for m in medians)
    out["groups_rejected"] = sum(
        any(failed[i * group_size : (i + 1) * group_size]) or m > lim["group_mant_err_max"]
        for i, m in enumerate(medians)
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the run's inference precision: honest workers sample in it, the validator prefills in it",
    )
    ap.add_argument("--completions", type=int, default=1200, help="honest completions in total")
    ap.add_argument("--cheat-groups", type=int, default=8, help="groups per cheat")
    ap.add_argument(
        "--engine",
        choices=ENGINES,
        default="builtin",
        help="the rollout engine honest workers sample with (hf: the generic one, before issue 16)",
    )
    ap.add_argument(
        "--streams",
        type=int,
        default=1,
        help="also sample honest work with the built-in engine in this many processes "
        "(`swarmrl worker --streams`), batch 64, one thread each",
    )
    ap.add_argument(
        "--only-streams",
        action="store_true",
        help="with --streams: honest work from the streams only (all --completions of it)",
    )
    ap.add_argument("--out", default="calibration.json")
    args = ap.parse_args()
    global ENGINE
    ENGINE = args.engine
    rd = Path(args.run_dir)
    cfg = load_config(rd / "config.toml")
    vcfg = cfg.validator
    g = cfg.sampling.group_size
    dtype, other = args.dtype, "float32" if args.dtype == "bfloat16" else "bfloat16"
    versions = sorted(int(p.name[1:]) for p in (rd / "policies").glob("v[0-9]*"))
    if len(versions) < 3:
        raise SystemExit(f"{rd}/policies holds {len(versions)} versions; calibration needs consecutive versions")

    def load(v, dt):
        return load_policy(rd / "policies" / f"v{v:06d}", dtype=getattr(torch, dt))[0].eval()

    models = {v: load(v, dtype) for v in versions}
    newest = versions[-1]
    tok = load_policy(rd / "policies" / f"v{versions[0]:06d}")[1]
    rows, _ = task_rows(cfg, log=lambda *_: None)
    rng = random.Random(0)
    validator = Validator(vcfg, rd / ".calibration-cache")
    results: dict = {
        "config": vcfg.model_dump(),
        "dtype": dtype,
        "engine": args.engine,
        "limits": vcfg.limits(dtype),
        "honest": {},
        "cheats": {},
        "precision": {},
    }

    def prompts_for(n_groups):
        ps = [model_input(tok, rows[rng.randrange(len(rows))]["prompt"], None)[1] for _ in range(n_groups)]
        prompts = [p for p in ps for _ in range(g)]
        return prompts, [rng.getrandbits(63) for _ in prompts]

    def run(sampler_model, judge_model, prompts, seeds, claimed_seeds=None, batch=64, judged_as=dtype):
        outs = sample(sampler_model, tok, prompts, seeds, batch, cfg)
        items = to_items(prompts, claimed_seeds or seeds, outs, newest, vcfg, g, cfg.sampling.temperature)
        chunks, comps = check(validator, judge_model, items, vcfg.batch_groups)
        return summary(chunks, comps, vcfg, judged_as, g)

    # ---- honest: versions x sampler batch sizes x threads --------------------------------------
    settings = [
        (v, b, t, 1)
        for v in (versions[0], versions[len(versions) // 2], newest)
        for b, t in ((1, 1), (8, 1), (64, 1), (64, 2), (16, 2))
    ]
    if args.streams > 1:
        streamed = [(v, 64, 1, args.streams) for v in (versions[0], versions[len(versions) // 2], newest)]
        settings = streamed if args.only_streams else settings + streamed
    elif args.only_streams:
        raise SystemExit("--only-streams needs --streams 2 or more")
    per = max(1, args.completions // (len(settings) * g))
    all_chunks, all_comps = [], []
    t0 = time.time()
    for v, batch, threads, streams in settings:
        torch.set_num_threads(threads)
        prompts, seeds = prompts_for(per)
        outs = sample(models[v], tok, prompts, seeds, batch, cfg, streams)
        torch.set_num_threads(1)  # the validator runs with other settings than the worker
        chunks, comps = check(
            validator,
            models[v],
            to_items(prompts, seeds, outs, v, vcfg, g, cfg.sampling.temperature),
            vcfg.batch_groups,
        )
        name = f"v{v}-batch{batch}-threads{threads}" + (f"-streams{streams}" if streams > 1 else "")
        results["honest"][name] = summary(chunks, comps, vcfg, dtype, g)
        all_chunks += chunks
        all_comps += comps
    results["honest"]["all"] = summary(all_chunks, all_comps, vcfg, dtype, g)
    torch.set_num_threads(1)

    # ---- cheats (each claims the newest version) -----------------------------------------------
    n = args.cheat_groups
    for gap in (1, 2, 5, newest - versions[0]):
        if newest - gap in models:
            results["cheats"][f"old_version_gap{gap}"] = run(models[newest - gap], models[newest], *prompts_for(n))
    other_model = copy.deepcopy(models[newest])
    torch.manual_seed(12345)
    for m in other_model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    results["cheats"]["other_model"] = run(
        other_model.to(getattr(torch, dtype)).eval(), models[newest], *prompts_for(n)
    )
    # A cheaper model that is nearly the claimed one: its weights quantised (from the full
    # precision weights, as a quantiser would), run in the run's dtype.
    full = load(newest, "float32")
    for bits in (8, 4):
        cheap = quantised(full, bits).to(getattr(torch, dtype))
        results["cheats"][f"int{bits}_weights"] = run(cheap, models[newest], *prompts_for(n))
    # Cherry-picking: sampled with other seeds, claimed with the lease's.
    prompts, seeds = prompts_for(n)
    results["cheats"]["other_seeds"] = run(
        models[newest], models[newest], prompts, [s ^ 0x5DEECE66D for s in seeds], claimed_seeds=seeds
    )

    # ---- precision mismatches --------------------------------------------------------------------
    in_other = load(newest, other)
    # Honest work in this dtype, judged in the other (as a validator with a fixed dtype did).
    results["precision"][f"checked_in_{other}"] = run(models[newest], in_other, *prompts_for(n), judged_as=other)
    # A worker that ignores the lease's dtype.
    results["precision"][f"sampled_in_{other}"] = run(in_other, models[newest], *prompts_for(n))
    results["seconds"] = time.time() - t0
    Path(args.out).write_text(json.dumps(results, indent=1))

    cols = [
        "completions",
        "chunks",
        "exp_max",
        "mean_max",
        "median_max",
        "margin_max",
        "logprob_err_max",
        "group_median_min",
        "group_median_max",
        "chunks_failing_toploc",
        "completions_failing_sampling",
        "completions_failing_logprobs",
        "completions_rejected",
        "groups",
        "groups_rejected",
    ]
    print(f"run dtype {dtype}; thresholds {results['limits']}; {results['seconds']:.0f} s")
    heads = [
        "compl.",
        "chunks",
        "exp max",
        "mean max",
        "median max",
        "gap max",
        "logprob max",
        "grp med min",
        "grp med max",
        "chunks fail",
        "fail sampling",
        "fail logprobs",
        "compl. failed",
        "groups",
        "groups failed",
    ]
    print(f"{'':36s}" + "".join(f"{h:>14s}" for h in heads))
    for part in ("honest", "cheats", "precision"):
        for name, s in results[part].items():
            print(
                f"{part[:6] + ' ' + name:36s}"
                + "".join(f"{s[c]:>14.4g}" if isinstance(s[c], float) else f"{s[c]:>14}" for c in cols)
            )
    print(
        "median per chunk of the mantissa error mean: "
        + ", ".join(f"{k} {s['mean_p50']:.3g}" for part in ("cheats", "precision") for k, s in results[part].items())
    )


if __name__ == "__main__":
    main()
