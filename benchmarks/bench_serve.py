"""`swarmrl serve` under load: tokens/s and request latency p50/p99, per engine, in one run.

Starts the server as its own process on 127.0.0.1 with the embedded default's tiny model
(untrained weights: the speed is the same, and completions run to max_tokens more often) once
per engine (`--engine builtin`: continuous batching; `--engine hf`: the generic engine's static
batches, what serve did before issue 16), then has 1, 8 and 32 clients send chat requests back
to back. Requests ask for a mix of lengths (max_tokens drawn from --lengths, seeded), at
temperature 1, each with its own seed: with static batches a short request waits for the longest
one in its batch, with continuous batching it leaves as soon as it is done and a waiting request
takes its slot at the next token step.

    python benchmarks/bench_serve.py [--requests 12] [--lengths 16 64 128] [--threads 2] [--engines builtin hf]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx

from swarmrl.model.checkpoint import build_tiny_policy, save_policy


def start_server(model: Path, workdir: Path, threads: int, engine: str) -> tuple[subprocess.Popen, str, str]:
    url_file = workdir / f"url-{engine}.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swarmrl.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            "0",
            "--url-file",
            str(url_file),
            "--threads",
            str(threads),
            "--engine",
            engine,
            "--max-batch-rows",
            "32",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not url_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("swarmrl serve did not start")
        time.sleep(0.05)
    info = json.loads(url_file.read_text())
    return proc, info["url"], info["model"]


def client_run(url: str, model: str, requests: list[tuple[int, int]]) -> tuple[int, list[float]]:
    """Send (seed, max_tokens) requests back to back; the tokens generated and each latency."""
    tokens, latencies = 0, []
    with httpx.Client(timeout=600) as client:
        for seed, max_tokens in requests:
            t0 = time.perf_counter()
            reply = client.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": "What is 123 + 456? Show your work."}],
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "seed": seed,
                },
            )
            reply.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            tokens += reply.json()["usage"]["completion_tokens"]
    return tokens, latencies


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=12, help="requests per client")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 128], help="max_tokens drawn from these")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument("--engines", nargs="+", default=["builtin", "hf"], choices=["builtin", "hf"])
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    rng = random.Random(0)
    plan = {
        c: [[(1000 * i + r, rng.choice(args.lengths)) for r in range(args.requests)] for i in range(c)]
        for c in args.clients
    }
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = workdir / "tiny"
        save_policy(*build_tiny_policy(seed=0), model)
        print(
            f"{'engine':>8}{'clients':>8}{'requests':>10}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}"
            f"{'p50 s':>8}{'p99 s':>8}{'max rows':>9}"
        )
        for engine in args.engines:
            proc, url, name = start_server(model, workdir, args.threads, engine)
            try:
                client_run(url, name, [(0, 16)])  # warm up
                for clients in args.clients:
                    started = time.perf_counter()
                    with ThreadPoolExecutor(clients) as pool:
                        runs = list(pool.map(partial(client_run, url, name), plan[clients]))
                    elapsed = time.perf_counter() - started
                    after = httpx.get(f"{url}/stats").json()
                    tokens = sum(t for t, _ in runs)
                    lat = [x for _, xs in runs for x in xs]
                    row = {
                        "engine": engine,
                        "clients": clients,
                        "requests": len(lat),
                        "tokens": tokens,
                        "seconds": elapsed,
                        "tokens_per_s": tokens / elapsed,
                        "p50_s": percentile(lat, 0.5),
                        "p99_s": percentile(lat, 0.99),
                        "max_rows": after["max_batch_rows"],
                    }
                    results.append(row)
                    print(
                        f"{engine:>8}{clients:>8}{row['requests']:>10}{tokens:>8}{elapsed:>9.2f}"
                        f"{row['tokens_per_s']:>10.0f}{row['p50_s']:>8.2f}{row['p99_s']:>8.2f}{row['max_rows']:>9}",
                        flush=True,
                    )
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
    if args.out:
        args.out.write_text(json.dumps({"threads": args.threads, "lengths": args.lengths, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
