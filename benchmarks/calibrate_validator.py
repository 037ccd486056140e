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

Any checkpoint (a pretrained model has one version):

    python benchmarks/calibrate_validator.py --model FOLDER --prompts TASK.jsonl [--config RUN.toml]
        [--groups 128] [--group-size 8] [--max-new-tokens 48] [--temperature 1] [--cheat-groups 4]

Honest groups: rows of the task file under the model's chat template (`tasks.source.model_input`,
what the orchestrator leases), sampled by the built-in engine with the lease's seeds, hidden
states and logprobs, proofs built as `inference/worker.py` builds them, at the engine batch sizes
and thread counts of `--settings`; every group is judged by `Validator.judge` after the
validator's own prefill (`validator.batch_groups` groups at a time, `--validator-threads`).
Cheats, each claiming the model: its weights fake-quantised to int8 and int4 (per output
channel, and int8 per 32 inputs), the previous version (the model one AdamW step earlier, full
weights at `--step-lrs` and a LoRA adapter at `--lora-lrs`, on a GRPO-style loss over its own
samples), another model of the same vocabulary (a LoRA-perturbed copy, `--lora-copies`), a
re-initialised model, edited tokens (one per completion, proofs and logprobs rebuilt for them)
and cherry-picking (best of 4 drawn with other seeds, claimed under the lease's). Prints, per
check, the honest groups' maximum and each cheat's minimum against the threshold.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from swarmrl.adversary.workers import quantised, reinitialised
from swarmrl.config import ValidatorConfig, load_config
from swarmrl.config.training import LORA_TARGETS_DEFAULT
from swarmrl.inference.engine import ENGINES, build_engine
from swarmrl.model.checkpoint import load_policy
from swarmrl.proofs.toploc import build_proofs_many, encode
from swarmrl.protocol.messages import ClaimedGroup, ClaimedSample
from swarmrl.tasks.source import model_input, task_rows
from swarmrl.validator.calibrate import edited_tokens, lora_copy, read_prompts
from swarmrl.validator.core import Validator

ENGINE = "builtin"  # --engine: which rollout engine honest workers (and cheats) sample with


def sample(model, tok, prompts, seeds, batch, cfg, streams=1, *, max_new_tokens=None, temperature=None):
    """Completions as a worker samples them; ``batch`` rows at once (the built-in engine gets
    all prompts and keeps ``batch`` slots busy, refilling them; the generic one gets chunks);
    ``streams`` above 1: the built-in engine in that many processes (`worker --streams`).
    The token limit and temperature are the run's (``cfg.sampling``) unless given."""
    max_new_tokens = max_new_tokens or cfg.sampling.max_new_tokens
    temperature = cfg.sampling.temperature if temperature is None else temperature
    sampler = build_engine(model, tok, kind=ENGINE, max_batch=batch, streams=streams)
    if sampler.continuous:
        try:
            return sampler.generate(
                prompts, seeds, max_new_tokens=max_new_tokens, temperature=temperature, return_hidden=True
            )
        finally:
            if hasattr(sampler, "close"):
                sampler.close()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += sampler.generate(
            prompts[i : i + batch],
            seeds[i : i + batch],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            return_hidden=True,
        )
    return outs


def to_items(prompts, seeds, outs, version, vcfg, g, temperature):
    proofs = build_proofs_many([o.hidden for o in outs], chunk_size=vcfg.chunk_size, topk=vcfg.topk)
    items: list[ClaimedGroup] = []
    for i in range(0, len(outs), g):
        items.append(
            ClaimedGroup(
                id=len(items),
                worker="calibration",
                policy_version=version,
                temperature=temperature,
                prompt_ids=prompts[i],
                samples=[
                    ClaimedSample(
                        token_ids=outs[j].token_ids, logprobs=outs[j].logprobs, seed=seeds[j], proofs=encode(proofs[j])
                    )
                    for j in range(i, i + g)
                ],
            )
        )
    return items


def check(validator, model, items, batch_groups):
    """Per-chunk and per-completion statistics, with the validator's own code and batching."""
    chunks, comps = [], []
    for i in range(0, len(items), batch_groups):
        part = items[i : i + batch_groups]
        outs = validator.prefill(model, [(it.prompt_ids, [s.token_ids for s in it.samples]) for it in part])
        samples = [s for it in part for s in it.samples]
        reports = validator.reports(
            [o for res in outs for o in res], samples, [it.temperature for it in part for _ in it.samples]
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


# ---- any model folder and a task file (--model, --prompts) -----------------------------------------
#
# A pretrained checkpoint has one version, so the cheats that need neighbours are made from it:
# the previous version is the model one optimizer step before (AdamW's first step on a GRPO-style
# loss over its own samples, full weights or a rank-8 LoRA adapter), another model of the same
# vocabulary is a LoRA-perturbed copy. Every group is judged by Validator.judge itself.

# Each check's statistic in a verdict, and the threshold (ValidatorConfig.limits) it is held to.
CHECKS = {
    "exp_mismatches_max": "exp_mismatches_max",
    "mant_err_mean_max": "mant_err_mean_max",
    "mant_err_median_max": "mant_err_median_max",
    "mant_err_group": "group_mant_err_max",
    "sampling_margin_max": "sampling_margin",
    "logprob_err_max": "logprob_tol",
}


def verdicts(validator, model, items, batch_groups, dtype):
    """Validator.judge's verdict of every group, prefilled `batch_groups` groups at a time as an
    in-process validator claims them (the steps of Validator.check, minus fetching the version)."""
    out = []
    for i in range(0, len(items), batch_groups):
        part = items[i : i + batch_groups]
        outs = validator.prefill(model, [(it.prompt_ids, [s.token_ids for s in it.samples]) for it in part])
        samples = [s for it in part for s in it.samples]
        reports = validator.reports(
            [o for res in outs for o in res], samples, [it.temperature for it in part for _ in it.samples]
        )
        pos = 0
        for it in part:
            out.append(validator.judge(it, reports[pos : pos + len(it.samples)], dtype).to_dict())
            pos += len(it.samples)
    return out


def verdict_summary(vs: list[dict], limits: dict) -> dict:
    """Per check: the largest and smallest group value (a group's value is its worst completion or
    chunk), and how many groups that check alone would refuse; then groups refused, by reason."""
    out = {"groups": len(vs), "chunks": sum(v["stats"]["chunks"] for v in vs)}
    for key, lim in CHECKS.items():
        xs = [float(v["stats"][key]) for v in vs]
        out[key] = {
            "max": max(xs),
            "min": min(xs),
            "median": statistics.median(xs),
            "fail": sum(x > limits[lim] for x in xs),
        }
    out["rejected"] = sum(not v["ok"] for v in vs)
    reasons: dict = {}
    for v in vs:
        if not v["ok"]:
            reasons[v["reason"]] = reasons.get(v["reason"], 0) + 1
    out["reasons"] = reasons
    return out


def _targets(model):
    """The linear layers trainer.lora adapts by default (every attention and MLP projection)."""
    return [m for name, m in model.named_modules() if name.split(".")[-1] in LORA_TARGETS_DEFAULT]


def policy_gradients(full, prompt: list[int], completions: list[list[int]], temperature: float, seed: int):
    """A copy of `full` holding the gradients of a GRPO-style loss, -sum_i A_i log p(completion_i)
    over the completions' tokens, half of them rewarded 1 at random (GRPO moves only on unequal
    rewards in a group, which a base model's own may not give) and normalised as GRPO does."""
    m = copy.deepcopy(full).float().train()
    gen = random.Random(seed)
    rewards = [float(i % 2) for i in range(len(completions))]
    gen.shuffle(rewards)
    mean = sum(rewards) / len(rewards)
    std = statistics.pstdev(rewards) or 1.0
    adv = [(r - mean) / std for r in rewards]
    total = sum(len(c) for c in completions)
    for i in range(0, len(completions), 4):
        part = completions[i : i + 4]
        width = len(prompt) + max(len(c) for c in part)
        ids = torch.zeros((len(part), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, c in enumerate(part):
            ids[r, : len(prompt) + len(c)] = torch.tensor(prompt + c)
            mask[r, : len(prompt) + len(c)] = 1
        logits = m(input_ids=ids, attention_mask=mask).logits[:, len(prompt) - 1 : -1].float() / temperature
        logp = logits.log_softmax(-1).gather(-1, ids[:, len(prompt) :, None])[..., 0]
        cmask = mask[:, len(prompt) :].float()
        a = torch.tensor(adv[i : i + 4])[:, None]
        (-(a * logp * cmask).sum() / total).backward()
    return m


def adam_step(full, grads_of, lr: float, betas=(0.9, 0.99), weight_decay=0.01, clip=1.0):
    """`full` after the trainer's first optimizer step (AdamW, gradient clipping) with the
    gradients held by `grads_of`: the version before a run's first update, seen from the one after."""
    new = copy.deepcopy(full).float()
    for p, q in zip(new.parameters(), grads_of.parameters()):
        p.grad = None if q.grad is None else q.grad.detach().clone()
    torch.nn.utils.clip_grad_norm_(new.parameters(), clip)
    torch.optim.AdamW(new.parameters(), lr=lr, betas=betas, weight_decay=weight_decay).step()
    for p in new.parameters():
        p.grad = None
    return new.eval()


def lora_step(full, grads_of, lr: float, rank: int = 16, alpha: float = 32.0, seed: int = 0):
    """`full` after the first AdamW step of a trainer.lora adapter (peft's init: A uniform in
    +-1/sqrt(in), B = 0, so only B moves, by lr x sign of its gradient, s (g_W) A^T), merged:
    W + s B A with s = alpha / rank."""
    new = copy.deepcopy(full).float()
    gen = torch.Generator().manual_seed(seed)
    s = alpha / rank
    with torch.no_grad():
        for m, q in zip(_targets(new), _targets(grads_of)):
            fan_in = m.weight.shape[1]
            a = (torch.rand((rank, fan_in), generator=gen) * 2 - 1) / math.sqrt(fan_in)
            g_b = s * q.weight.grad.float() @ a.T  # [out, rank]
            b = -lr * g_b / (g_b.abs() + 1e-8)
            m.weight.add_(s * b @ a)
    return new.eval()


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "unknown"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else "unknown"


def calibrate_model(args) -> None:
    """Honest work and cheats of one model folder (any checkpoint the built-in engine runs)."""
    cfg = load_config(args.config)
    vcfg = cfg.validator
    if args.batch_groups:
        vcfg = vcfg.model_copy(update={"batch_groups": args.batch_groups})
    g, temp, max_new, dtype = args.group_size, args.temperature, args.max_new_tokens, args.dtype
    limits = vcfg.limits(dtype)
    t_start = time.time()
    full, tok = load_policy(args.model, dtype=torch.float32)
    full.eval()
    model = full if dtype == "float32" else copy.deepcopy(full).to(getattr(torch, dtype)).eval()
    texts = read_prompts(Path(args.prompts))
    rng = random.Random(args.seed)
    order = rng.sample(range(len(texts)), len(texts))  # every group its own row while rows last
    validator = Validator(vcfg, Path(args.out).with_suffix(".cache"))
    settings = [[int(x) for x in s.split("x")] for s in args.settings.split(",")]
    even = max(1, args.groups // len(settings))  # "BATCHxTHREADS": an even share of the groups
    settings = [(x[0], x[1], x[2] if len(x) > 2 else even) for x in settings]
    results: dict = {
        "model": str(args.model),
        "prompts": str(args.prompts),
        "dtype": dtype,
        "engine": ENGINE,
        "group_size": g,
        "temperature": temp,
        "max_new_tokens": max_new,
        "limits": limits,
        "config": vcfg.model_dump(),
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "honest": {},
        "cheats": {},
    }
    taken = args.offset  # a second pass over other rows (and other seeds) than a first one
    for _ in range(args.offset * g):
        rng.getrandbits(63)

    def prompts_for(n_groups):
        nonlocal taken
        rows = [order[(taken + i) % len(order)] for i in range(n_groups)]
        taken += n_groups
        ps = [model_input(tok, texts[r], None)[1] for r in rows]
        prompts = [p for p in ps for _ in range(g)]
        return prompts, [rng.getrandbits(63) for _ in prompts]

    def judged(items, judge_model=model):
        torch.set_num_threads(args.validator_threads)  # the validator runs with its own settings
        t0 = time.time()
        vs = verdicts(validator, judge_model, items, vcfg.batch_groups, dtype)
        return vs, time.time() - t0

    def run(name, sampler_model, n_groups, *, picks=1):
        """A cheat's groups: sampled with `sampler_model`, claimed as the model's work (picks > 1:
        `picks` candidates per completion with seeds of its own, the most likely one submitted
        under the lease's seed)."""
        torch.set_num_threads(args.threads)
        prompts, seeds = prompts_for(n_groups)
        t0 = time.time()
        if picks > 1:
            own = [rng.getrandbits(63) for _ in range(len(prompts) * picks)]
            cands = sample(
                sampler_model,
                tok,
                [p for p in prompts for _ in range(picks)],
                own,
                64,
                cfg,
                max_new_tokens=max_new,
                temperature=temp,
            )
            outs = [max(cands[i * picks : (i + 1) * picks], key=lambda o: sum(o.logprobs)) for i in range(len(prompts))]
        else:
            outs = sample(sampler_model, tok, prompts, seeds, 64, cfg, max_new_tokens=max_new, temperature=temp)
        gen_s = time.time() - t0
        vs, val_s = judged(to_items(prompts, seeds, outs, 0, vcfg, g, temp))
        results["cheats"][name] = {
            **verdict_summary(vs, limits),
            "completions": len(outs),
            "generate_s": gen_s,
            "validate_s": val_s,
        }
        say(name, results["cheats"][name])

    def say(name, s):
        print(
            f"{name:30s} groups {s['groups']:4d} refused {s['rejected']:4d} {s['reasons']} "
            + f"({s.get('generate_s', 0):.0f} + {s.get('validate_s', 0):.0f} s) "
            + " ".join(f"{k}={s[k]['min']:.3g}..{s[k]['max']:.3g}" for k in CHECKS),
            flush=True,
        )

    # ---- honest ------------------------------------------------------------------------------------
    all_vs, honest_items, tokens, gen_total, val_total = [], [], 0, 0.0, 0.0
    for batch, threads, per in settings:
        torch.set_num_threads(threads)
        prompts, seeds = prompts_for(per)
        t0 = time.time()
        outs = sample(model, tok, prompts, seeds, batch, cfg, max_new_tokens=max_new, temperature=temp)
        gen_s = time.time() - t0
        items = to_items(prompts, seeds, outs, 0, vcfg, g, temp)
        vs, val_s = judged(items)
        n_tok = sum(len(o.token_ids) for o in outs)
        name = f"batch{batch}-threads{threads}"
        results["honest"][name] = {
            **verdict_summary(vs, limits),
            "completions": len(outs),
            "tokens": n_tok,
            "generate_s": gen_s,
            "validate_s": val_s,
            "tokens_per_s": n_tok / gen_s,
        }
        say("honest " + name, results["honest"][name])
        all_vs += vs
        honest_items += items
        tokens += n_tok
        gen_total += gen_s
        val_total += val_s
    results["honest"]["all"] = {
        **verdict_summary(all_vs, limits),
        "completions": len(all_vs) * g,
        "tokens": tokens,
        "generate_s": gen_total,
        "validate_s": val_total,
    }
    say("honest all", results["honest"]["all"])

    # ---- cheats, each claiming the model ------------------------------------------------------------
    n = args.cheat_groups
    wanted = set(args.cheats.split(","))
    for bits, group in ((8, None), (4, None), (8, 32)):
        if "quantised" in wanted:
            cheap = quantised(full, bits, group).to(getattr(torch, dtype))
            run(f"int{bits}_weights_" + ("per_channel" if group is None else f"group{group}"), cheap, n)
            del cheap
    if "previous" in wanted:
        # The previous version: the gradients of one step on the model's own honest samples.
        first = honest_items[0]
        torch.set_num_threads(args.threads)
        prompt, completions = first.prompt_ids, [s.token_ids for s in first.samples]
        grads = policy_gradients(full, prompt, completions, temp, args.seed)
        for lr in args.step_lrs:
            run(f"previous_version_full_lr{lr:g}", adam_step(full, grads, lr).to(getattr(torch, dtype)), n)
        r, a = args.lora_rank, args.lora_alpha
        for lr in args.lora_lrs:
            stepped = lora_step(full, grads, lr, rank=r, alpha=a).to(getattr(torch, dtype))
            run(f"previous_version_lora{r}_alpha{a:g}_lr{lr:g}", stepped, n)
        del grads
    for rel in args.lora_copies if "lora_copy" in wanted else ():
        run(f"lora_copy_rank16_rel{rel:g}", lora_copy(full, rel).to(getattr(torch, dtype)), n)
    if "reinitialised" in wanted:
        run("reinitialised_model", reinitialised(model), max(1, n // 2))
    if "edited" in wanted:
        # Edited tokens: honest groups, one token changed per completion, proofs and logprobs rebuilt.
        torch.set_num_threads(args.threads)
        t0 = time.time()
        bad = edited_tokens(honest_items[:n], model, tok.eos_token_id, vcfg, temp)
        vs, val_s = judged(bad)
        results["cheats"]["edited_tokens"] = {
            **verdict_summary(vs, limits),
            "completions": n * g,
            "generate_s": time.time() - t0 - val_s,  # the rebuilt proofs' prefill
            "validate_s": val_s,
        }
        say("edited_tokens", results["cheats"]["edited_tokens"])
    if "cherry_pick" in wanted:
        # Cherry-picking: best of 4 drawn with other seeds, claimed under the lease's.
        run("cherry_pick_best_of_4", model, n, picks=4)

    results["seconds"] = time.time() - t_start
    results["cpu_seconds"] = time.process_time()  # all threads; below the wall time x threads on a shared machine
    Path(args.out).write_text(json.dumps(results, indent=1))
    print_margins(results)


def print_margins(results: dict) -> None:
    lim = results["limits"]
    heads = ["exp/sign", "mant mean", "mant median", "group med", "sampling gap", "logprob err"]
    print(
        f"\n{results['model']} ({results['dtype']}, T={results['temperature']}, "
        f"{results['max_new_tokens']} new tokens, {results['seconds']:.0f} s, "
        f"{results.get('cpu_seconds', 0):.0f} s of CPU on {results.get('cpu')})\n"
    )
    print(f"{'':34s}{'groups':>8s}{'refused':>9s}" + "".join(f"{h:>14s}" for h in heads))
    print(f"{'threshold':34s}{'':>17s}" + "".join(f"{lim[v]:>14.4g}" for v in CHECKS.values()))
    h = results["honest"]["all"]
    print(
        f"{'honest, max over groups':34s}{h['groups']:>8d}{h['rejected']:>9d}"
        + "".join(f"{h[k]['max']:>14.4g}" for k in CHECKS)
    )
    for name, s in results["cheats"].items():
        print(
            f"{name + ', min':34s}{s['groups']:>8d}{s['rejected']:>9d}"
            + "".join(f"{s[k]['min']:>14.4g}" for k in CHECKS)
        )
    print("\ngroups each check alone refuses:")
    for name, s in [("honest", h), *results["cheats"].items()]:
        print(f"  {name:32s}" + "".join(f"{s[k]['fail']:>14d}" for k in CHECKS) + f"   reasons {s['reasons']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", help="a run whose policies/ holds consecutive versions")
    ap.add_argument("--model", help="instead of --run-dir: a model folder (any checkpoint the built-in engine runs)")
    ap.add_argument("--prompts", help="with --model: a task file (JSONL rows with a 'prompt'), under the chat template")
    ap.add_argument("--config", help="with --model: the run's config (validator thresholds, proof settings)")
    ap.add_argument("--groups", type=int, default=128, help="with --model: honest groups (prompts)")
    ap.add_argument("--group-size", type=int, default=8, help="with --model: completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="with --model")
    ap.add_argument("--temperature", type=float, default=1.0, help="with --model")
    ap.add_argument(
        "--settings",
        default="64x1,16x1,8x1,64x2",
        help="with --model: honest work in these engine batch sizes x torch threads (x groups; default: "
        "--groups split evenly)",
    )
    ap.add_argument("--threads", type=int, default=1, help="with --model: torch threads of the cheats' sampling")
    ap.add_argument("--validator-threads", type=int, default=1, help="with --model (validator.threads)")
    floats = lambda text: [float(x) for x in text.split(",") if x]  # noqa: E731
    ap.add_argument(
        "--step-lrs",
        type=floats,
        default=[1e-6, 2e-7],
        help="with --model: the previous version is the model one AdamW step (full weights) at these rates before",
    )
    ap.add_argument(
        "--lora-lrs",
        type=floats,
        default=[2.5e-4, 1e-5],
        help="... and one step of a LoRA adapter at these rates (configs/smollm2-135m.toml's first: 2.5e-4)",
    )
    ap.add_argument("--lora-rank", type=int, default=16, help="... of this rank (configs/smollm2-135m.toml: 16)")
    ap.add_argument("--lora-alpha", type=float, default=32.0, help="... and alpha (configs/smollm2-135m.toml: 32)")
    ap.add_argument(
        "--cheats",
        default="quantised,previous,lora_copy,reinitialised,edited,cherry_pick",
        help="with --model: which cheats to run",
    )
    ap.add_argument(
        "--lora-copies",
        type=floats,
        default=[0.01],
        help="with --model: another model of the vocabulary, rank-16 updates of these norms relative to each weight",
    )
    ap.add_argument("--seed", type=int, default=0, help="with --model: prompt order and seeds")
    ap.add_argument("--offset", type=int, default=0, help="with --model: skip the first groups of that order")
    ap.add_argument(
        "--batch-groups",
        type=int,
        help="with --model: groups per validator prefill (validator.batch_groups); its logits take "
        "groups x group size x tokens x vocabulary x 4 bytes, several times over",
    )
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
    if args.model:
        if not args.prompts:
            raise SystemExit("--model needs --prompts (a task file)")
        calibrate_model(args)
        return
    if not args.run_dir:
        raise SystemExit("give --run-dir RUN (a run's consecutive versions) or --model FOLDER --prompts FILE")
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
    other_model = reinitialised(models[newest])
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
