"""One free key's hostile episodes against everyone else's latency (issue 50), before and after, side by side.

Real processes on loopback: an orchestrator process whose tasks are episodes of the `calculator`
environment with `max_new_tokens` N, one free key (unproven, from 127.0.0.3) that submits a lease
of groups whose every completion is one model turn of N tokens of unclosed `<calc>1+` tags (the
input the calculator's old lazy pattern took quadratic time on) with well-formed proofs of random
activations, and another client (127.0.0.2) polling `/v1/status` and `/healthz` before and while
the hostile submission is judged.

    python benchmarks/bench_episode_flood.py [--tokens 8192,32768] [--env calculator|guess] [--before REF]

`--env guess`: each completion is one number of N digits instead (int() refuses more than 4,300).

With `--before REF` the same probe runs first on a `git worktree` of REF (the orchestrator process
imports that tree), then on this tree, in one sitting. Printed per (code, N): the hostile
submission's round trip, what it was answered, the grading seconds the orchestrator charged to
unproven keys, and the other client's /v1/status and /healthz latency p50/max, calm and during
the submission. A figure, not a test: the machine's load moves every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from swarmrl.proofs.toploc import build_proofs, encode  # noqa: E402
from swarmrl.protocol.client import Refused, TrainerClient, Unavailable, WorkerClient  # noqa: E402

from orchestrator_harness import OrchestratorProcess, make_run_dir, signed_version  # noqa: E402


class Poller:
    """Another address asking `path` in a loop; latencies (s) with the time each was asked."""

    def __init__(self, url: str, path: str):
        self.url, self.path, self.got = url, path, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=transport, timeout=300) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    c.get(self.url + self.path)
                except httpx.HTTPError:
                    pass
                self.got.append((t0, time.monotonic() - t0))
                time.sleep(0.05)

    def between(self, a: float, b: float) -> list[float]:
        return [d for t, d in self.got if a <= t <= b or a <= t + d <= b]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=300)


def stats(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * 1e3:.0f}/{max(values) * 1e3:.0f}"


UNITS = {"calculator": "<calc>1+", "guess": "9"}  # unclosed tool calls; one number of N digits


def hostile_submission(lease: dict, tok, hidden: int, env: str) -> dict:
    n = lease["max_new_tokens"]
    unit = tok(UNITS[env], add_special_tokens=False)["input_ids"]
    ids = (unit * (n // len(unit) + 1))[:n]  # one turn that uses the whole budget: no stop token needed
    groups = []
    for p in lease["prompts"]:
        samples = []
        for _ in range(lease["group_size"]):
            proofs = encode(
                build_proofs(
                    torch.randn(n, hidden), chunk_size=lease["proof"]["chunk_size"], topk=lease["proof"]["topk"]
                )
            )
            samples.append(
                {
                    "token_ids": ids,
                    "logprobs": [-0.1] * n,
                    "finish_reason": "length",
                    "model_mask": [True] * n,
                    "proofs": proofs,
                }
            )
        groups.append({"slot": p["slot"], "policy_version": lease["max_version"], "samples": samples})
    return {"lease_id": lease["lease_id"], "groups": groups}


def grading_seconds(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('swarmrl_total{what="grading_seconds/unproven"}'):
            return float(line.split()[-1])
    return 0.0


def probe(code: Path, tokens: int, root: Path, env: str) -> dict:
    from transformers import AutoTokenizer

    run = make_run_dir(
        Path(tempfile.mkdtemp(prefix=f"run-{env}-{tokens}-", dir=root)),
        "--tasks.source",
        env,
        "--sampling.max_new_tokens",
        str(tokens),
        "--sampling.group_size",
        "2",
        "--orchestrator.max_request_bytes",
        str(64 << 20),
    )
    policy = run / "policies" / "v000000"
    tok = AutoTokenizer.from_pretrained(policy, local_files_only=True)
    hidden = json.loads((policy / "config.json").read_text())["hidden_size"]
    manifest = signed_version(run, 0)
    here = os.getcwd()
    os.chdir(code)  # `python -m` puts the working folder first on sys.path: the process imports that tree's swarmrl
    try:
        orch = OrchestratorProcess(run).start()
    finally:
        os.chdir(here)
    try:
        trainer = TrainerClient(orch.url, (run / "trainer.token").read_text().strip())
        trainer.publish(0, "http://127.0.0.1:9", manifest)
        status, health = Poller(orch.url, "/v1/status"), Poller(orch.url, "/healthz")
        calm_from = time.monotonic()
        time.sleep(3.0)
        calm_to = time.monotonic()
        attacker = WorkerClient(orch.url, Ed25519PrivateKey.generate(), timeout_s=600, local_address="127.0.0.3")
        attacker.register("flood")
        lease = attacker.lease(0)["lease"]
        sub = hostile_submission(lease, tok, hidden, env)
        before = grading_seconds(orch.url)
        t0 = time.monotonic()
        try:
            reply = attacker.submit(sub)
            answer = {
                "accepted": len(reply["accepted"]),
                "rejected": sorted({r["reason"] for r in reply["rejected"]}),
            }
        except (Refused, Unavailable, httpx.HTTPError) as e:
            answer = {"refused": f"{type(e).__name__}: {str(e)[:80]}"}
        t1 = time.monotonic()
        time.sleep(0.5)
        status.close()
        health.close()
        return {
            "episodes": sum(len(g["samples"]) for g in sub["groups"]),
            "submit_s": t1 - t0,
            "answer": answer,
            "charged_s": grading_seconds(orch.url) - before,
            "status_calm": stats(status.between(calm_from, calm_to)),
            "status_during": stats(status.between(t0, t1)),
            "healthz_calm": stats(health.between(calm_from, calm_to)),
            "healthz_during": stats(health.between(t0, t1)),
            "internal_errors": orch.log().count("Traceback"),
        }
    finally:
        orch.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,32768", help="completion lengths to probe, comma-separated")
    ap.add_argument("--env", default="calculator", choices=sorted(UNITS), help="whose episodes to flood")
    ap.add_argument("--before", default=None, help="a git ref to probe first (a worktree of it), e.g. HEAD~1")
    args = ap.parse_args()
    random.seed(0)
    torch.manual_seed(0)
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    print(f"# {platform.node()} {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="episode-flood-") as tmp:
        codes = [("this tree", ROOT)]
        if args.before:
            worktree = Path(tmp) / "before"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(worktree), args.before], check=True
            )
            codes.insert(0, (f"before ({args.before})", worktree))
        try:
            print(
                "code | N tokens | episodes | submit s | answer | charged s | "
                "/v1/status p50/max ms calm -> during | /healthz calm -> during | tracebacks"
            )
            for name, code in codes:
                for n in (int(x) for x in args.tokens.split(",")):
                    (Path(tmp) / name.split()[0]).mkdir(exist_ok=True)
                    r = probe(code, n, Path(tmp) / name.split()[0], args.env)
                    print(
                        f"{name} | {n} | {r['episodes']} | {r['submit_s']:.3f} | {r['answer']} | "
                        f"{r['charged_s']:.2f} | "
                        f"{r['status_calm']} -> {r['status_during']} | {r['healthz_calm']} -> {r['healthz_during']} | "
                        f"{r['internal_errors']}",
                        flush=True,
                    )
        finally:
            if args.before:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)


if __name__ == "__main__":
    main()
