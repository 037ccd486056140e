"""The orchestrator under many workers: hundreds of lightweight signed clients against one real
`swarmrl orchestrator` process (issue 32). Not a test; prints figures.

Each client is a thread with its own ed25519 key and HTTP connection, spread over a few load
processes. It registers, then loops: lease one prompt, wait `--think-s` (the time a real worker
spends generating), submit a group that passes every cheap check (signature, nonce, lease, sizes,
token ids, proof format, graded by the orchestrator's math-verify pool), lease again. The
validator is off and the clients count as proven, so this measures the service and its SQLite
store, not admission. Offered load = clients / think_s submissions per second; the service keeps
up while the achieved rate follows it and latency stays flat.

Printed per client count: offered and achieved submissions/s, accepted groups/s, lease and submit
latency p50 / p99, refusals, and the SQLite file's size per stored group.

    python benchmarks/bench_many_workers.py [--clients 100,250,500,1000] [--think-s 10] [--seconds 40]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LOGPROB = -0.30102999566398125  # as long in JSON as a real float32 logprob


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _load(
    url: str, clients: int, seconds: float, think_s: float, group_size: int, tokens: int, answers: dict, out
) -> None:
    """One load process: `clients` threads, each one worker key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarmrl.model.tokenizer import build_char_tokenizer
    from swarmrl.proofs.toploc import chunk_count, encode, to_bytes
    from swarmrl.protocol.client import Refused, Unavailable, WorkerClient

    tok = build_char_tokenizer()
    lock = threading.Lock()
    stats = {"lease": [], "submit": [], "groups": 0, "refused": 0, "errors": 0, "submissions": 0}
    start = threading.Barrier(clients + 1)

    def one(i: int) -> None:
        w = WorkerClient(url, Ed25519PrivateKey.generate(), timeout_s=60)
        w.register(f"light-{os.getpid()}-{i}")
        start.wait()
        time.sleep(think_s * i / clients)  # spread the first leases over one think time
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                t0 = time.perf_counter()
                lease = w.lease(0)["lease"]
                dt = time.perf_counter() - t0
                with lock:
                    stats["lease"].append(dt)
                if lease is None:
                    time.sleep(1.0)
                    continue
                time.sleep(think_s)
                groups = []
                for p in lease["prompts"]:
                    right = answers[p["problem_id"]]
                    samples = []
                    for j in range(lease["group_size"]):
                        answer = right if j % 2 == 0 else str(int(right) + 1)
                        pad = "x" * max(0, tokens - 40)  # the char tokenizer: a token per character
                        text = f"<think>{answer} checked{pad}</think>\\boxed{{{answer}}}<|im_end|>"
                        t = tok(text, add_special_tokens=False)["input_ids"]
                        proofs = encode([to_bytes(65497, [7] * 128)] * chunk_count(len(t), 32))
                        samples.append(
                            {"token_ids": t, "logprobs": [LOGPROB] * len(t), "finish_reason": "stop", "proofs": proofs}
                        )
                    groups.append({"slot": p["slot"], "policy_version": 0, "samples": samples})
                t0 = time.perf_counter()
                result = w.submit({"lease_id": lease["lease_id"], "groups": groups})
                dt = time.perf_counter() - t0
                with lock:
                    stats["submit"].append(dt)
                    stats["submissions"] += 1
                    stats["groups"] += len(result["accepted"])
            except (Refused, Unavailable):
                with lock:
                    stats["refused"] += 1
                time.sleep(1.0)
            except Exception:  # noqa: BLE001 - counted: a benchmark reports, it does not stop
                with lock:
                    stats["errors"] += 1
                time.sleep(1.0)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join(seconds + think_s + 120)
    out.put(stats)


def level(clients: int, args, answers: dict, run: Path, url: str) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs_n = min(args.procs, clients)
    shares = [clients // procs_n + (i < clients % procs_n) for i in range(procs_n)]
    procs = [
        ctx.Process(target=_load, args=(url, n, args.seconds, args.think_s, args.group_size, args.tokens, answers, out))
        for n in shares
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=args.seconds + args.think_s + 600) for _ in procs]
    for p in procs:
        p.join()
    lease = [x for r in results for x in r["lease"]]
    submit = [x for r in results for x in r["submit"]]
    db = sqlite3.connect(run / "orchestrator.sqlite")
    stored = db.execute("SELECT COUNT(*) FROM groups").fetchone()[0]
    db.close()
    size = sum(p.stat().st_size for p in run.glob("orchestrator.sqlite*"))
    return {
        "clients": clients,
        "offered_per_s": clients / args.think_s if args.think_s else float("inf"),
        "submissions_per_s": sum(r["submissions"] for r in results) / args.seconds,
        "groups_per_s": sum(r["groups"] for r in results) / args.seconds,
        "tokens_per_s": sum(r["groups"] for r in results) * args.group_size * args.tokens / args.seconds,
        "prompts_per_lease": args.prompts,
        "lease_p50_ms": 1000 * statistics.median(lease) if lease else float("nan"),
        "lease_p99_ms": 1000 * _pct(lease, 0.99),
        "submit_p50_ms": 1000 * statistics.median(submit) if submit else float("nan"),
        "submit_p99_ms": 1000 * _pct(submit, 0.99),
        "refused": sum(r["refused"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "groups_stored": stored,
        "sqlite_bytes": size,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="100,250,500,1000", help="client counts, one level each, in order")
    ap.add_argument("--think-s", type=float, default=10.0, help="seconds a client 'generates' between lease and submit")
    ap.add_argument("--seconds", type=float, default=40.0, help="length of each level")
    ap.add_argument("--procs", type=int, default=4, help="load processes the clients are spread over")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=1, help="prompts (groups) per lease and submission")
    ap.add_argument("--tokens", type=int, default=35, help="tokens per completion (long ones measure per-token costs)")
    ap.add_argument("--out", type=Path, help="append one JSON line per level")
    args = ap.parse_args()

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarmrl.config import load_config
    from swarmrl.model.checkpoint import build_tiny_policy, save_policy
    from swarmrl.protocol.client import TrainerClient
    from swarmrl.tasks.source import task_rows
    from swarmrl.transport.broadcast import publish_version

    overrides = [
        "--sampling.worker_batch_prompts", str(args.prompts),
        "--sampling.group_size", str(args.group_size),
        "--async.max_pending_groups", str(10**9),
        "--sampling.prompts_per_step", str(10**6),
        "--orchestrator.rate_per_s", "1e6",
        "--orchestrator.rate_burst", str(10**6),
        "--orchestrator.requests_per_s_per_source", "1e6",
        "--orchestrator.registrations_per_min", str(10**6),
        "--orchestrator.registrations_per_min_total", str(10**6),
        "--orchestrator.max_connections", "4000",
        "--orchestrator.max_connections_per_source", "4000",
        "--orchestrator.proven_after", "0",
        "--orchestrator.new_key_slots", str(max(8, 2 * args.prompts)),
        "--orchestrator.lease_timeout_s", str(max(120.0, 6 * args.think_s)),
        "--validator.rate", "0",
        "--sampling.max_new_tokens", str(max(64, args.tokens + 16)),
        "--orchestrator.max_request_bytes", str(max(8 << 20, 64 * args.tokens * args.group_size)),
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    rows, _ = task_rows(cfg, log=lambda *_: None)
    answers = {r["problem_id"]: json.loads(r["verification_info"])["ground_truth"] for r in rows}
    print(
        f"{os.cpu_count()} CPUs; think {args.think_s:g} s, {args.seconds:g} s per level, {args.procs} load processes, "
        f"groups of {args.group_size} x ~{args.tokens} tokens"
    )
    print("clients  offered/s  subs/s  groups/s  lease p50/p99 ms  submit p50/p99 ms  refused  errors  KB/group")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        (run / "config.toml").write_text(cfg.model_copy(update={"run_dir": str(run)}).to_toml())
        save_policy(*build_tiny_policy(), run / "policies" / "v000000")
        port = _free_port()
        orch = subprocess.Popen(
            [sys.executable, "-m", "swarmrl.cli", "orchestrator", "--run-dir", str(run), "--port", str(port)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
        )
        try:
            while not (run / "orchestrator.json").exists():
                if orch.poll() is not None:
                    raise SystemExit("the orchestrator failed to start")
                time.sleep(0.05)
            url = f"http://127.0.0.1:{port}"
            manifest = publish_version(
                run / "policies" / "v000000", run / "broadcast", 0, key=Ed25519PrivateKey.generate()
            )
            TrainerClient(url, (run / "trainer.token").read_text().strip()).publish(0, "http://127.0.0.1:9", manifest)
            for n in (int(x) for x in args.clients.split(",")):
                r = level(n, args, answers, run, url)
                per_group = r["sqlite_bytes"] / max(r["groups_stored"], 1) / 1024
                print(
                    f"{n:7d}  {r['offered_per_s']:9.1f}  {r['submissions_per_s']:6.1f}  {r['groups_per_s']:8.1f}  "
                    f"{r['lease_p50_ms']:7.1f} / {r['lease_p99_ms']:7.1f}  {r['submit_p50_ms']:7.1f} / "
                    f"{r['submit_p99_ms']:7.1f}  {r['refused']:7d}  {r['errors']:6d}  {per_group:8.2f}",
                    flush=True,
                )
                print(f"         completion tokens/s accepted: {r['tokens_per_s']:.0f}", flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(r) + "\n")
        finally:
            orch.terminate()
            orch.wait(timeout=30)


if __name__ == "__main__":
    main()
