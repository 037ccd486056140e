"""`swarmrl serve` throughput: generated tokens/s with 1 and with 8 concurrent clients.

Starts the server as its own process on 127.0.0.1 with the embedded default's tiny model
(untrained weights: the speed is the same, and completions run to max_tokens more often),
then, in one run, has 1 client and then 8 clients each send chat requests back to back.
Each request asks for ``--max-tokens`` tokens at temperature 1 with its own seed. The ratio of
the two rates is what batching buys.

    python benchmarks/bench_serve.py [--requests 12] [--max-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from swarmrl.model.checkpoint import build_tiny_policy, save_policy


def start_server(model: Path, workdir: Path, threads: int) -> tuple[subprocess.Popen, str, str]:
    url_file = workdir / "url.json"
    proc = subprocess.Popen([sys.executable, "-m", "swarmrl.cli", "serve", "--model", str(model), "--port", "0",
                             "--url-file", str(url_file), "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not url_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("swarmrl serve did not start")
        time.sleep(0.05)
    info = json.loads(url_file.read_text())
    return proc, info["url"], info["model"]


def client_run(url: str, model: str, seeds: list[int], max_tokens: int) -> int:
    tokens = 0
    with httpx.Client(timeout=600) as client:
        for seed in seeds:
            reply = client.post(f"{url}/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "What is 123 + 456? Show your work."}],
                "max_tokens": max_tokens, "temperature": 1.0, "seed": seed})
            reply.raise_for_status()
            tokens += reply.json()["usage"]["completion_tokens"]
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=12, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = workdir / "tiny"
        save_policy(*build_tiny_policy(seed=0), model)
        proc, url, name = start_server(model, workdir, args.threads)
        try:
            client_run(url, name, [0], args.max_tokens)  # warm up
            rates = {}
            print(f"{'clients':>8}{'requests':>10}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'max batch':>11}")
            for clients in (1, 8):
                before = httpx.get(f"{url}/stats").json()
                started = time.perf_counter()
                with ThreadPoolExecutor(clients) as pool:
                    seeds = [[1000 * c + r for r in range(args.requests)] for c in range(clients)]
                    tokens = sum(pool.map(lambda s: client_run(url, name, s, args.max_tokens), seeds))
                elapsed = time.perf_counter() - started
                after = httpx.get(f"{url}/stats").json()
                rates[clients] = tokens / elapsed
                rows = after["max_batch_rows"] if clients > 1 else 1
                print(f"{clients:>8}{clients * args.requests:>10}{tokens:>8}{elapsed:>9.2f}{rates[clients]:>10.0f}"
                      f"{rows:>11}  ({after['batches'] - before['batches']} batches)")
            print(f"8 clients / 1 client: {rates[8] / rates[1]:.2f}x the generated tokens per second")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()


if __name__ == "__main__":
    main()
