"""How far the proving vLLM worker's submissions are from what the validator recomputes, beside the
built-in engine's own: the statistics the validator's thresholds act on, per group.

    make vllm-env real-assets && .venv/bin/python benchmarks/bench_vllm_proofs.py
    .venv/bin/python benchmarks/bench_vllm_proofs.py --model tiny --dtypes float32,bfloat16 --prompts 16

The same (prompt, seed) rows through both engines: the first --prompts GSM8K test questions under
the checkpoint's chat template (the real assets), --group completions each with their own seeds,
T = 1, up to --new-tokens tokens; "tiny" is the project's ~1M-parameter Qwen2 (fresh weights,
seed 0) on the same questions under its character tokenizer, cut to 64 tokens. vLLM runs in
.venv-vllm (tests/support/vllm_rows.py: `VllmEngine`, a worker's exact engine); the built-in
engine and the validator (`Validator.prefill`, `reports`, `judge`, the production code with the
default `ValidatorConfig`) run here. For each dtype and engine: groups passed, the largest and
median per-group values of the checked statistics, and the thresholds they are held to.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
STATS = ("logprob_err_max", "sampling_margin_max", "exp_mismatches_max", "mant_err_mean_max", "mant_err_group")


def judge_groups(model, prompts, seeds, completions, temperature, group, dtype, engine) -> list:
    """The validator's verdict on each group, as the orchestrator's validator would give it."""
    import torch

    from swarmrl.config import ValidatorConfig
    from swarmrl.proofs.toploc import build_proofs_many, encode
    from swarmrl.protocol.messages import ClaimedGroup, ClaimedSample
    from swarmrl.validator.core import Validator

    cfg = ValidatorConfig()
    validator = Validator(cfg, tempfile.mkdtemp())
    verdicts = []
    for start in range(0, len(prompts), group):
        samples = []
        for i in range(start, start + group):
            c = completions[i]
            hidden = c["hidden"] if isinstance(c["hidden"], torch.Tensor) else torch.tensor(c["hidden"])
            hidden = hidden.to(getattr(torch, dtype))  # a worker builds proofs from the model dtype's states
            proofs = encode(build_proofs_many([hidden], chunk_size=cfg.chunk_size, topk=cfg.topk)[0])
            samples.append(
                ClaimedSample(token_ids=c["token_ids"], logprobs=c["logprobs"], seed=seeds[i], proofs=proofs)
            )
        with torch.no_grad():
            outs = validator.prefill(model, [(prompts[start], [s.token_ids for s in samples])])[0]
        reports = validator.reports(outs, samples, [temperature] * len(samples))
        claimed = ClaimedGroup(
            id=start,
            worker="bench",
            policy_version=0,
            temperature=temperature,
            prompt_ids=prompts[start],
            samples=samples,
            engine=engine,
        )
        verdicts.append(validator.judge(claimed, reports, dtype))
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF folder, or 'tiny' (default: the real assets' SmolLM2-135M)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.exists():
        sys.exit(f"{VLLM_PYTHON} is missing: run `make vllm-env`")

    import torch

    from swarmrl.assets.prepare import MODEL_NAME, default_cache
    from swarmrl.eval.runner import chat_ids
    from swarmrl.inference.engine import build_engine
    from swarmrl.model.checkpoint import build_tiny_policy, load_policy, save_policy

    work = Path(tempfile.mkdtemp(prefix="bench_vllm_proofs_"))
    if args.model == "tiny":
        model, tokenizer = build_tiny_policy(0)
        folder = save_policy(model, tokenizer, work / "tiny")
    else:
        folder = Path(args.model or default_cache() / "models" / MODEL_NAME).expanduser()
        _, tokenizer = load_policy(folder)
    rows = [json.loads(line) for line in (default_cache() / "data" / "gsm8k-test.jsonl").read_text().splitlines()]
    questions = [r["prompt"] for r in rows[: args.prompts]]
    if args.model == "tiny":
        base = [tokenizer.encode(q)[:64] for q in questions]
    else:
        base = [chat_ids(tokenizer, q) for q in questions]
    prompts = [p for p in base for _ in range(args.group)]
    seeds = list(range(5000, 5000 + len(prompts)))
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu if line.startswith("Model name")), platform.processor())
    print(
        f"{folder.name}: {args.prompts} prompts x {args.group} completions, T=1, up to {args.new_tokens} new tokens; "
        f"{cpu}, {os.cpu_count()} cores"
    )
    result: dict = {"cpu": cpu, "model": folder.name, "dtypes": {}}
    for dtype in args.dtypes.split(","):
        spec = {
            "versions": [str(folder)],
            "dtype": dtype,
            "stop": [tokenizer.eos_token_id],
            "phases": [
                {
                    "version": 0,
                    "prompts": prompts,
                    "seeds": seeds,
                    "temperature": 1.0,
                    "max_new_tokens": args.new_tokens,
                }
            ],
        }
        (work / "spec.json").write_text(json.dumps(spec))
        t0 = time.perf_counter()
        proc = subprocess.run(
            [str(VLLM_PYTHON), str(ROOT / "tests" / "support" / "vllm_rows.py"), "--spec", str(work / "spec.json")]
            + ["--out", str(work / "out.json")],
            capture_output=True,
            text=True,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")},
        )
        if proc.returncode != 0:
            sys.exit(f"vLLM side failed ({dtype}):\n{proc.stderr[-4000:]}")
        vllm_rows = json.loads((work / "out.json").read_text())["phases"][0]["completions"]
        vllm_seconds = time.perf_counter() - t0
        model, _ = load_policy(folder, dtype=getattr(torch, dtype))
        model.eval()
        builtin = build_engine(model, tokenizer).generate(
            prompts, seeds, max_new_tokens=args.new_tokens, temperature=1.0, return_hidden=True
        )
        builtin_rows = [{"token_ids": o.token_ids, "logprobs": o.logprobs, "hidden": o.hidden} for o in builtin]
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(vllm_rows, builtin_rows))
        tokens = sum(len(r["token_ids"]) for r in vllm_rows)
        print(
            f"\n{dtype}: {same} of {len(prompts)} completions token for token the built-in engine's; "
            f"{tokens} vLLM tokens (vLLM side {vllm_seconds:.0f} s with start-up)"
        )
        cfg_limits = None
        entry: dict = {"same_tokens": same, "completions": len(prompts), "tokens": tokens, "engines": {}}
        for name, done in (("builtin", builtin_rows), ("vllm", vllm_rows)):
            verdicts = judge_groups(model, prompts, seeds, done, 1.0, args.group, dtype, name)
            from swarmrl.config import ValidatorConfig

            cfg_limits = ValidatorConfig().limits(dtype)  # the same for every engine (issue 49)
            figures = {s: [float(v.stats[s]) for v in verdicts] for s in STATS}
            ok = sum(v.ok for v in verdicts)
            reasons = sorted({v.reason for v in verdicts if not v.ok})
            print(
                f"  {name:<8} groups passed {ok}/{len(verdicts)} (group mantissa limit "
                f"{cfg_limits['group_mant_err_max']})" + (f"; refused: {', '.join(reasons)}" if reasons else "")
            )
            for s in STATS:
                vals = figures[s]
                print(f"    {s:<22} max {max(vals):.3g}  median {statistics.median(vals):.3g}")
            entry["engines"][name] = {"passed": ok, "groups": len(verdicts), "reasons": reasons, "stats": figures}
        limits = {
            "logprob_err_max": cfg_limits["logprob_tol"],
            "sampling_margin_max": cfg_limits["sampling_margin"],
            "exp_mismatches_max": cfg_limits["exp_mismatches_max"],
            "mant_err_mean_max": cfg_limits["mant_err_mean_max"],
            "mant_err_group": cfg_limits["group_mant_err_max"],
        }
        print("  thresholds: " + ", ".join(f"{k} {v}" for k, v in limits.items()))
        entry["limits"] = limits
        result["dtypes"][dtype] = entry
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
