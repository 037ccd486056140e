"""Benchmark (not a test): the orchestrator alone under a loopback load of signed submissions.

A real `swarmrl orchestrator` process; N load-generator processes, each with its own ed25519
key, loop lease -> submit as fast as they can. Every submission is signed, checked (signature,
nonce, lease, sizes, token ids, versions) and scored by the orchestrator's own verifiers
(math-verify in its process pool), then stored in SQLite; half the completions of each group
carry the right answer, so every group is informative and stored as queued. Back-pressure and
rate limits are set out of the way: this measures the service, not its throttles.

Printed: accepted groups/s and completions/s, submissions/s, and p50/p99 latency of the submit
and lease requests as the clients saw them. The load generators share the machine's cores with
the orchestrator, so on 2 cores the figure is a lower bound on what the service does alone.

Usage: python benchmarks/bench_orchestrator.py [--clients 4] [--seconds 20] [--prompts 4]
       [--group-size 8] [--verify-workers 1]

Attack mix (issue 15): `--attack 20 [--repeats 3] [--seconds 12]` runs tests/support/hostile.py's
scenario instead: honest workers sampling with the real sampler against an orchestrator that
validates every group, first alone, then while 20 free keys hoard leases, submit garbage with
worst-case answers, flood registrations and send unsigned junk (from their own process, niced).
Printed per repeat and summarised: honest groups/s without and with the attack, their ratio, the
slowest /healthz seen, and how every attacker key ended.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _client(url: str, seconds: float, answers: dict, out: mp.Queue) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarmrl.model.tokenizer import build_char_tokenizer
    from swarmrl.proofs.toploc import chunk_count, encode, to_bytes
    from swarmrl.protocol.client import WorkerClient

    tok = build_char_tokenizer()
    w = WorkerClient(url, Ed25519PrivateKey.generate())
    w.register("load")
    cache: dict[str, list[int]] = {}

    def ids(text: str) -> list[int]:
        if text not in cache:
            cache[text] = tok(text, add_special_tokens=False)["input_ids"]
        return cache[text]

    def proofs(n: int) -> list[str]:
        # Well-formed proofs (their format is checked on every submission); never verified
        # against hidden states here: the validator is off (validator.rate 0), so this measures
        # the service, not the prefill (benchmarks/bench_validation.py measures that).
        return encode([to_bytes(65497, [7] * 128)] * chunk_count(n, 32))

    submit_lat, lease_lat, groups, completions = [], [], 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        lease = w.lease(0)["lease"]
        lease_lat.append(time.perf_counter() - t0)
        if lease is None:
            continue
        body = {"lease_id": lease["lease_id"], "groups": []}
        for p in lease["prompts"]:
            right = answers[p["problem_id"]]
            samples = []
            for j in range(lease["group_size"]):
                answer = right if j % 2 == 0 else str(int(right) + 1)
                # About the length of the default run's completions (~40 tokens).
                t = ids(f"<think>{answer} checked digit by digit, carry noted</think>\\boxed{{{answer}}}<|im_end|>")
                samples.append(
                    {"token_ids": t, "logprobs": [-0.3] * len(t), "finish_reason": "stop", "proofs": proofs(len(t))}
                )
            body["groups"].append({"slot": p["slot"], "policy_version": 0, "samples": samples})
        t0 = time.perf_counter()
        result = w.submit(body)
        submit_lat.append(time.perf_counter() - t0)
        groups += len(result["accepted"])
        completions += sum(len(body["groups"][0]["samples"]) for _ in result["accepted"])
    out.put({"submit": submit_lat, "lease": lease_lat, "groups": groups, "completions": completions})


def attack_mix(keys: int, repeats: int, seconds: float) -> None:
    """The hostile scenario of tests/support/hostile.py, `repeats` times; a distribution, not one run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from hostile import scenario

    ratios = []
    print(f"{keys} attacker keys, phases of {seconds:.0f} s, {os.cpu_count()} CPUs")
    print("repeat | honest groups/s alone | under attack | ratio | worst /healthz ms | attacker keys at the end")
    for i in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            got = scenario(Path(tmp), phase_s=seconds, keys=keys, log=lambda *_: None)
        ratio = got["attacked"] / got["calm"]
        ratios.append(ratio)
        ends = {}
        for v in got["report"]["final"].values():
            ends[v] = ends.get(v, 0) + 1
        print(
            f"{i + 1} | {got['calm']:.2f} | {got['attacked']:.2f} | {ratio:.2f} | "
            f"{1000 * got['worst_healthz_s']:.0f} | {ends}"
        )
    print(f"ratio mean {statistics.fmean(ratios):.2f}, min {min(ratios):.2f}, max {max(ratios):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--prompts", type=int, default=4, help="prompts (groups) per lease and submission")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--verify-workers", type=int, default=1)
    ap.add_argument(
        "--viewers",
        type=int,
        default=0,
        help="dashboard viewers during the load: threads each polling GET /v1/dashboard twice a second "
        "(run once with 0 and once with N, back to back, to see what the dashboard costs)",
    )
    ap.add_argument("--attack", type=int, default=0, help="attacker keys: run the attack mix instead (see above)")
    ap.add_argument("--repeats", type=int, default=3, help="attack mix: how many times")
    args = ap.parse_args()
    if args.attack:
        return attack_mix(args.attack, args.repeats, args.seconds)

    import torch  # noqa: F401
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from swarmrl.config import load_config
    from swarmrl.model.checkpoint import build_tiny_policy, save_policy
    from swarmrl.protocol.client import TrainerClient
    from swarmrl.tasks.source import task_rows
    from swarmrl.transport.broadcast import publish_version

    overrides = [
        "--sampling.worker_batch_prompts",
        str(args.prompts),
        "--sampling.group_size",
        str(args.group_size),
        # No trainer consumes batches here: make the batch so large that leasing never
        # stops for "the next batches are covered" or back-pressure.
        "--async.max_pending_groups",
        str(10**9),
        "--sampling.prompts_per_step",
        str(10**6),
        "--orchestrator.rate_per_s",
        "1e6",
        "--orchestrator.rate_burst",
        str(10**6),
        "--orchestrator.requests_per_s_per_source",
        "1e6",
        # The validator is off: count the load clients as proven (two grading lanes).
        "--orchestrator.proven_after",
        "0",
        "--rewards.verify_workers",
        str(args.verify_workers),
        "--validator.rate",
        "0",
    ]
    cfg = load_config(None, overrides)
    rows, _ = task_rows(cfg, log=lambda *_: None)
    answers = {r["problem_id"]: json.loads(r["verification_info"])["ground_truth"] for r in rows}
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        (run / "config.toml").write_text(cfg.model_copy(update={"run_dir": str(run)}).to_toml())
        model, tok = build_tiny_policy()
        save_policy(model, tok, run / "policies" / "v000000")
        port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        orch = subprocess.Popen(
            [sys.executable, "-m", "swarmrl.cli", "orchestrator", "--run-dir", str(run), "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        try:
            while not (run / "orchestrator.json").exists():
                if orch.poll() is not None:
                    raise SystemExit("the orchestrator failed to start")
                time.sleep(0.05)
            url = f"http://127.0.0.1:{port}"
            TrainerClient(url, (run / "trainer.token").read_text().strip()).publish(
                0,
                "http://127.0.0.1:9",
                publish_version(run / "policies" / "v000000", run / "broadcast", 0, key=Ed25519PrivateKey.generate()),
            )
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            procs = [ctx.Process(target=_client, args=(url, args.seconds, answers, out)) for _ in range(args.clients)]
            stop = threading.Event()
            polls: list[float] = []

            def viewer() -> None:
                import httpx

                with httpx.Client(timeout=30) as http:
                    while not stop.is_set():
                        t = time.perf_counter()
                        assert http.get(url + "/v1/dashboard").status_code == 200
                        polls.append(time.perf_counter() - t)
                        stop.wait(0.5)

            viewers = [threading.Thread(target=viewer, daemon=True) for _ in range(args.viewers)]
            t0 = time.monotonic()
            for p in procs:
                p.start()
            for v in viewers:
                v.start()
            results = [out.get(timeout=args.seconds + 120) for _ in procs]
            wall = time.monotonic() - t0
            stop.set()
            for v in viewers:
                v.join()
            for p in procs:
                p.join()
        finally:
            orch.terminate()
            orch.wait(timeout=30)
    submit = [x for r in results for x in r["submit"]]
    lease = [x for r in results for x in r["lease"]]
    groups = sum(r["groups"] for r in results)
    completions = sum(r["completions"] for r in results)
    # Clients start at slightly different times; rates use the sum of their own windows.
    window = args.seconds
    print(
        f"clients {args.clients}, {args.prompts} groups x {args.group_size} completions per submission, "
        f"verify_workers {args.verify_workers}, {os.cpu_count()} CPUs, wall {wall:.1f} s"
    )
    print(f"accepted groups/s      {groups / window:8.1f}")
    print(f"accepted completions/s {completions / window:8.1f}")
    print(f"submissions/s          {len(submit) / window:8.1f}")
    print(
        f"submit latency ms      p50 {1000 * statistics.median(submit):7.1f}   p99 {1000 * _percentile(submit, 0.99):7.1f}"  # noqa: E501
    )
    print(
        f"lease latency ms       p50 {1000 * statistics.median(lease):7.1f}   p99 {1000 * _percentile(lease, 0.99):7.1f}"  # noqa: E501
    )
    if polls:
        print(
            f"dashboard viewers {args.viewers}: {len(polls)} polls, latency ms p50 {1000 * statistics.median(polls):7.1f}"  # noqa: E501
            f"   p99 {1000 * _percentile(polls, 0.99):7.1f}"
        )


if __name__ == "__main__":
    main()
