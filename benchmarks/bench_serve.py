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

`--flood` measures instead, side by side in one run on one server (docs/security.md, "`swarmrl
serve` under a disconnecting flood"): calm figures (an honest 8-token request's latency with the
server idle, and tokens/s of 8 clients sending 8 requests of 64 tokens each), then the same honest
client, from 127.0.0.2, while 127.0.0.1 sends `--flood-requests` completions (n = 16, 256 tokens)
keeping at most 32 sockets open and closing each 1 s after sending it, and how many tokens the
server generated for those departed clients; then `/health` from 127.0.0.2 while 127.0.0.1 sends
eight 1 MB `/tokenize` requests. It only uses what every version of the server has (`/stats`,
`/tokenize`), so the same script measures the server before and after a change.

    python benchmarks/bench_serve.py --flood [--flood-requests 128] [--threads 2]
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


HONEST = "127.0.0.2"  # the honest client's own address (all of 127/8 is loopback on Linux)


def honest_request(url: str, model: str, timeout_s: float) -> float:
    """One 8-token completion from HONEST; its latency in seconds (timeout_s when it timed out)."""
    t0 = time.perf_counter()
    transport = httpx.HTTPTransport(local_address=HONEST)
    try:
        with httpx.Client(transport=transport, timeout=timeout_s) as client:
            reply = client.post(
                f"{url}/v1/completions",
                json={"model": model, "prompt": "12+7=", "max_tokens": 8, "temperature": 0},
            )
        reply.raise_for_status()
    except httpx.TimeoutException:
        return timeout_s
    return time.perf_counter() - t0


def departing_flood(url: str, model: str, requests: int, open_max: int = 32, linger_s: float = 1.0) -> int:
    """Send `requests` completions (n = 16, 256 tokens) from 127.0.0.1, at most `open_max` sockets
    open, each closed `linger_s` after its request was sent, whatever came back; the number of
    requests answered before their socket closed with a 429."""
    import socket
    import threading

    host, port = url.split("//", 1)[1].split(":")
    body = json.dumps(
        {"model": model, "prompt": "What is 123 + 456? Show your work.", "max_tokens": 256, "n": 16, "seed": 1}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    gate = threading.Semaphore(open_max)
    refused = [0]

    def one() -> None:
        try:
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(head + body)
                sock.settimeout(linger_s)
                try:
                    first = sock.recv(64)
                    if first.startswith(b"HTTP/1.1 429"):
                        refused[0] += 1
                        time.sleep(linger_s)  # the flood's pace is the same whatever comes back
                except TimeoutError:
                    pass
        except OSError:
            pass
        finally:
            gate.release()

    threads = []
    for _ in range(requests):
        gate.acquire()
        t = threading.Thread(target=one, daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return refused[0]


def flood_run(args) -> dict:
    """The --flood measurements (module doc), on one builtin server."""
    from concurrent.futures import Future

    out: dict = {"threads": args.threads, "flood_requests": args.flood_requests}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = workdir / "tiny"
        save_policy(*build_tiny_policy(seed=0), model)
        proc, url, name = start_server(model, workdir, args.threads, "builtin")
        try:
            honest_request(url, name, 60)  # warm up
            idle = sorted(honest_request(url, name, 60) for _ in range(5))
            out["honest_idle_s"] = idle[len(idle) // 2]
            plan = [[(1000 * i + r, 64) for r in range(8)] for i in range(8)]
            started = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                runs = list(pool.map(partial(client_run, url, name), plan))
            out["calm_tokens_per_s"] = sum(t for t, _ in runs) / (time.perf_counter() - started)
            print(
                f"calm: honest 8-token request {out['honest_idle_s']:.2f} s (median of 5); "
                f"8 clients x 8 x 64 tokens: {out['calm_tokens_per_s']:.0f} tokens/s",
                flush=True,
            )

            before = httpx.get(f"{url}/stats", timeout=30).json()["generated_tokens"]
            with ThreadPoolExecutor(1) as pool:
                flood: Future = pool.submit(departing_flood, url, name, args.flood_requests)
                time.sleep(0.5)  # the flood's first sockets are open and their work queued
                lat = []
                while not flood.done() or not lat:
                    lat.append(honest_request(url, name, args.honest_timeout_s))
                refused = flood.result()
            honest_tokens = 8 * len(lat)
            time.sleep(2.0)  # what is still being generated for the departed clients goes on counting
            after = httpx.get(f"{url}/stats", timeout=60).json()["generated_tokens"]
            out.update(
                honest_flood_median_s=sorted(lat)[len(lat) // 2],
                honest_flood_max_s=max(lat),
                honest_flood_requests=len(lat),
                flood_refused_429=refused,
                departed_tokens=max(0, after - before - honest_tokens),
            )
            print(
                f"disconnecting flood ({args.flood_requests} x n=16 x 256 tokens, <= 32 open, each closed after 1 s; "
                f"{refused} got 429): honest 8-token request median {out['honest_flood_median_s']:.2f} s, "
                f"max {out['honest_flood_max_s']:.2f} s over {len(lat)} requests (timeout "
                f"{args.honest_timeout_s:g} s); ~{out['departed_tokens']} tokens generated for departed "
                "clients by 2 s after the flood",
                flush=True,
            )

            big = json.dumps({"model": name, "prompt": "1+2=" * 250_000})  # ~1 MB, under the 1 MiB limit
            health = []
            with ThreadPoolExecutor(8) as pool:
                posts = [
                    pool.submit(
                        httpx.post,
                        f"{url}/tokenize",
                        content=big,
                        timeout=120,
                        headers={"content-type": "application/json"},
                    )
                    for _ in range(8)
                ]
                with httpx.Client(transport=httpx.HTTPTransport(local_address=HONEST), timeout=120) as client:
                    while not all(p.done() for p in posts):
                        t0 = time.perf_counter()
                        client.get(f"{url}/health")
                        health.append(time.perf_counter() - t0)
                        time.sleep(0.05)
                codes = [p.result().status_code for p in posts]
            out.update(health_during_tokenize_max_s=max(health, default=0.0), tokenize_codes=codes)
            print(
                f"8 x 1 MB /tokenize (status {sorted(set(codes))}): /health from another address took at most "
                f"{out['health_during_tokenize_max_s']:.3f} s over {len(health)} polls",
                flush=True,
            )
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
    return out


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
    parser.add_argument("--flood", action="store_true", help="measure a disconnecting flood instead (module doc)")
    parser.add_argument("--flood-requests", type=int, default=128, help="--flood: completions the flood sends")
    parser.add_argument("--honest-timeout-s", type=float, default=60.0, help="--flood: an honest request's limit")
    args = parser.parse_args()
    if args.flood:
        figures = flood_run(args)
        if args.out:
            args.out.write_text(json.dumps(figures, indent=1))
        return
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
