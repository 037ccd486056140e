"""Hostile load: free-key attackers against an orchestrator with honest workers running
(tests/test_hostile.py asserts on it, benchmarks/bench_orchestrator.py --attack reports it).

`scenario()` sets up real processes on loopback only: one orchestrator (in-process validator,
every group checked), a broadcast origin serving the policy, honest `Worker`s sampling with the
real sampler in this process, a trainer thread consuming batches as they fill, and the attackers
in their own process (this file run as a script, from other loopback addresses: 127.0.0.2-4).
It measures honest groups accepted per second without and then with the attack, side by side.

    python tests/hostile.py URL SECONDS OUT.json --tokenizer POLICY_DIR [--keys 20]

Each attacker key costs nothing: half of them hoard leases (lease, never submit), half submit
garbage for their leases (random token ids spelling worst-case answers for the grader, with
well-formed proofs of random activations); one more thread floods registrations with fresh keys
and one sends unsigned junk bodies. Attackers ignore Retry-After: they retry after 50 ms whatever
they are told. Every key and every refusal it met is written to OUT.json, with the key's
standing at the end (what a lease attempt gets once the attack stops).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmrl.proofs.toploc import build_proofs, encode
from swarmrl.protocol.client import Refused, TrainerClient, Unavailable, WorkerClient

if TYPE_CHECKING:  # at run time scenario() imports it (the attacker process, main(), never does)
    from swarmrl.inference.worker import Worker

# Answers a grader can burn its whole time limit (or memory) on: power towers, huge factorials
# and fractions, deep nesting.
WORST = [
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{1000000!}",
    r"\boxed{\frac{10^{10^{9}}}{7}}",
    r"\boxed{((((((((((1))))))))))^{99999}}",
    r"\boxed{2^{x^{x^{x}}}}",
]


def code_of(e: Exception) -> str:
    if isinstance(e, Refused):
        return e.code
    text = str(e)
    for code in ("allowance_exhausted", "grading_busy", "rate_limited", "too_slow"):
        if code in text:
            return code
    return type(e).__name__


def garbage(lease: dict, tokenizer_ids: list[list[int]], max_new: int, eos: int, hidden: int) -> dict:
    groups = []
    for p in lease["prompts"]:
        samples = []
        for _ in range(lease["group_size"]):
            ids = random.choice(tokenizer_ids)[: max_new - 1] + [eos]
            proofs = encode(
                build_proofs(
                    torch.randn(len(ids), hidden), chunk_size=lease["proof"]["chunk_size"], topk=lease["proof"]["topk"]
                )
            )
            samples.append({"token_ids": ids, "logprobs": [-0.1] * len(ids), "finish_reason": "stop", "proofs": proofs})
        groups.append({"slot": p["slot"], "policy_version": lease["max_version"], "samples": samples})
    return {"lease_id": lease["lease_id"], "groups": groups}


# ---- the scenario (honest side) ----------------------------------------------------------------
#: The run's settings: small leases, a tight back-pressure limit (so hoarding would bite), every
#: group validated, short leases so hoarded ones expire within the test.
CONFIG = (
    "--sampling.max_new_tokens",
    "48",
    "--async.bound",
    "1000",
    "--async.max_pending_groups",
    "16",
    "--sampling.prompts_per_step",
    "2",
    "--orchestrator.new_key_slots",
    "2",
    "--orchestrator.proven_after",
    "2",
    "--orchestrator.lease_timeout_s",
    "3",
    "--orchestrator.registrations_per_min",
    "30",
    "--validator.ban_after",
    "3",
)


class Honest:
    """Honest workers in threads: lease, sample, submit, count accepted groups (and where the
    time went: `stats` counts lease refusals by reason and seconds spent per stage).

    The rate is counted over whole cycles (one lease, refused or not, through its submission)
    that start and end inside the phase: accepted groups over the cycles' worker-seconds, times
    the workers. Counting groups accepted between two clock readings instead moved a 12 s phase's
    figure by one submission (8 groups: ~5%) either way depending on where the phase cut a cycle.
    """

    def __init__(self, workers: list[Worker]):
        self.workers, self.rejected = workers, []
        self.groups, self.busy_s, self.phase_t0 = 0, 0.0, 0.0
        self.stats: Counter = Counter()
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.loop, args=(w,), daemon=True) for w in workers]
        for t in self.threads:
            t.start()

    def _note(self, what: str, by: float = 1.0) -> None:
        with self.lock:
            if self.running.is_set():
                self.stats[what] += by

    def _cycle(self, t0: float, groups: int) -> None:
        """A cycle begun at ``t0`` ended now with ``groups`` accepted: counted if inside the phase."""
        with self.lock:
            if self.running.is_set() and t0 >= self.phase_t0:
                self.groups += groups
                self.busy_s += time.monotonic() - t0

    def loop(self, w: Worker) -> None:
        while not self.stop.is_set():
            if not self.running.wait(0.1):
                continue
            t0 = time.monotonic()
            try:
                got = w.client.lease(w.version)
            except Unavailable as e:  # an honest worker honours Retry-After
                self._note("lease_429")
                time.sleep(min(2.0, e.retry_after or 0.2))
                self._cycle(t0, 0)
                continue
            if got["lease"] is None:
                self._note("no_lease: " + str(got.get("reason", ""))[:90])
                time.sleep(min(0.5, got.get("retry_after_s") or 0.1))
                self._note("s_waiting", time.monotonic() - t0)
                self._cycle(t0, 0)
                continue
            t1 = time.monotonic()
            sub = w.generate(got["lease"])
            t2 = time.monotonic()
            while True:
                try:
                    reply = w.client.submit(sub)
                    break
                except Unavailable as e:
                    self._note("submit_429")
                    time.sleep(min(1.0, e.retry_after or 0.2))
            self._note("s_lease", t1 - t0)
            self._note("s_generate", t2 - t1)
            self._note("s_submit", time.monotonic() - t2)
            self._cycle(t0, len(reply["accepted"]))
            with self.lock:
                self.rejected += reply["rejected"]

    def measure(self, seconds: float) -> tuple[float, dict]:
        """Honest groups accepted per second over a phase of ``seconds`` (see the class)."""
        with self.lock:
            self.groups, self.busy_s, self.phase_t0 = 0, 0.0, time.monotonic()
            self.stats = Counter()
        self.running.set()
        time.sleep(seconds)
        self.running.clear()
        with self.lock:
            stats = {k: round(v, 2) for k, v in self.stats.items()}
            stats["cycles_s"] = round(self.busy_s, 2)
            stats["groups"] = self.groups
            return len(self.workers) * self.groups / max(self.busy_s, 1e-9), stats


def trainer_loop(t: TrainerClient, stop: threading.Event) -> None:
    step = 0
    while not stop.is_set():
        try:
            if t.batch(step).ready:
                step += 1
                continue
        except (Refused, Unavailable):
            pass
        time.sleep(0.05)


def healthz_loop(url: str, stop: threading.Event, worst: list[float]) -> None:
    with httpx.Client(timeout=5) as http:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                ok = http.get(url + "/healthz").status_code == 200
            except httpx.HTTPError:
                ok = False
            worst[0] = max(worst[0], time.monotonic() - t0 if ok else 99.0)
            time.sleep(0.2)


def scenario(root: Path, *, phase_s: float = 12.0, keys: int = 20, honest_workers: int = 2, log=print) -> dict:
    """Run the calm phase then the attacked phase; return what was measured."""
    from swarmrl.inference.worker import Worker
    from swarmrl.protocol.signing import public_key_hex
    from swarmrl.transport.broadcast import ShardServer

    from harness import wait_for
    from orchestrator_harness import (
        TRAINER_KEY,
        OrchestratorProcess,
        make_run_dir,
        signed_version,
    )

    run = make_run_dir(root / "run", *CONFIG)
    manifest = signed_version(run, 0)
    server = ShardServer(run / "broadcast").start()
    orch = OrchestratorProcess(run).start()
    stop = threading.Event()
    honest = None
    try:
        trainer = TrainerClient(orch.url, (run / "trainer.token").read_text().strip())
        trainer.publish(0, server.url, manifest)
        policy = {"version": 0, "url": server.url, "manifest": manifest}
        workers = []
        for i in range(honest_workers):
            d = root / f"honest-{i}"
            w = Worker(
                orch.url,
                key_file=d / "key.pem",
                cache_dir=d,
                name=f"honest-{i}",
                log=lambda *_: None,
                trainer_key=public_key_hex(TRAINER_KEY),
            )
            w.client.register(f"honest-{i}")
            assert w._ensure_policy(policy)
            workers.append(w)
        threading.Thread(target=trainer_loop, args=(trainer, stop), daemon=True).start()
        honest = Honest(workers)
        # Warm up until the honest keys are proven (validated work), as in a run under way.
        honest.running.set()
        records = lambda: str([w.client.me() for w in workers])  # noqa: E731
        wait_for(
            lambda: all(w.client.me()["proven"] for w in workers), 120, "honest keys proven", log=records, every=0.5
        )
        honest.running.clear()
        worst = [0.0]
        threading.Thread(target=healthz_loop, args=(orch.url, stop, worst), daemon=True).start()
        calm, calm_stats = honest.measure(phase_s)
        out = root / "attack.json"
        attackers = subprocess.Popen(
            [
                sys.executable,
                __file__,
                orch.url,
                str(phase_s + 3),
                str(out),
                "--keys",
                str(keys),
                "--tokenizer",
                str(run / "policies" / "v000000"),
                "--settle",
                "4",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        time.sleep(3)  # registrations done, the attack under way
        attacked, attacked_stats = honest.measure(phase_s)
        output = attackers.communicate(timeout=120)[0].decode(errors="replace")
        if attackers.returncode != 0:
            raise RuntimeError("the attackers failed:\n" + output)
        report = json.loads(out.read_text())
        return {
            "calm": calm,
            "attacked": attacked,
            "calm_stats": calm_stats,
            "attacked_stats": attacked_stats,
            "worst_healthz_s": worst[0],
            "report": report,
            "honest_rejected": list(honest.rejected),
            "honest_records": [w.client.me() for w in workers],
        }
    finally:
        stop.set()
        if honest is not None:
            honest.stop.set()
        orch.stop()
        server.close()
        text = orch.log()
        if "internal error" in text:
            raise RuntimeError("the orchestrator logged an internal error:\n" + text[-3000:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("seconds", type=float)
    ap.add_argument("out")
    ap.add_argument("--keys", type=int, default=20)
    ap.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds to wait after the attack before the final lease attempts (let leases expire)",
    )
    ap.add_argument("--tokenizer", required=True, help="a policy folder (the garbage's token ids, hidden size)")
    args = ap.parse_args()
    # The attackers' own CPU would be on their machines, not the run's: on a shared loopback
    # machine they yield it, so what is measured is what the server lets them cost.
    os.nice(19)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    hidden = json.load(open(os.path.join(args.tokenizer, "config.json")))["hidden_size"]
    answer_ids = [tok(f"<think>x</think>{w}", add_special_tokens=False)["input_ids"] for w in WORST]
    deadline = time.monotonic() + args.seconds
    seen: dict[str, Counter] = {}
    lock = threading.Lock()

    def note(who: str, what: str) -> None:
        with lock:
            seen.setdefault(who, Counter())[what] += 1

    clients = []
    for i in range(args.keys):
        w = WorkerClient(args.url, Ed25519PrivateKey.generate(), timeout_s=10, local_address="127.0.0.2")
        while time.monotonic() < deadline:
            try:
                w.register(f"free-{i}")
                break
            except (Refused, Unavailable) as e:
                note(f"key{i}", "register:" + code_of(e))
                time.sleep(0.05)
        clients.append(w)
    status = httpx.get(args.url + "/v1/status").json()
    version = status["latest_version"] or 0

    def hoarder(i: int, w: WorkerClient) -> None:
        while time.monotonic() < deadline:
            try:
                got = w.lease(version)
                note(f"key{i}", "lease" if got["lease"] else "no_lease")
            except (Refused, Unavailable) as e:
                note(f"key{i}", code_of(e))
            time.sleep(0.05)

    def spammer(i: int, w: WorkerClient) -> None:
        while time.monotonic() < deadline:
            try:
                got = w.lease(version)
                if got["lease"] is None:
                    note(f"key{i}", "no_lease")
                else:
                    note(f"key{i}", "lease")
                    lease = got["lease"]
                    reply = w.submit(garbage(lease, answer_ids, lease["max_new_tokens"], tok.eos_token_id, hidden))
                    note(f"key{i}", f"submitted:{len(reply['accepted'])}:{len(reply['rejected'])}")
            except (Refused, Unavailable) as e:
                note(f"key{i}", code_of(e))
            time.sleep(0.05)

    def registration_flood() -> None:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            try:
                WorkerClient(args.url, Ed25519PrivateKey.generate(), timeout_s=10, local_address="127.0.0.3").register(
                    f"flood-{n}"
                )
                note("flood", "registered")
            except (Refused, Unavailable) as e:
                note("flood", code_of(e))
            time.sleep(0.01)

    def junk() -> None:
        http = httpx.Client(timeout=10, transport=httpx.HTTPTransport(local_address="127.0.0.4"))
        body = os.urandom(4096)
        while time.monotonic() < deadline:
            try:
                r = http.post(
                    args.url + "/v1/rollouts",
                    content=body,
                    headers={
                        "x-swarmrl-run": status["run_id"],
                        "x-swarmrl-key": "ab" * 32,
                        "x-swarmrl-timestamp": f"{time.time():.3f}",
                        "x-swarmrl-nonce": os.urandom(8).hex(),
                        "x-swarmrl-signature": "cd" * 64,
                    },
                )
                note("junk", str(r.status_code))
            except httpx.HTTPError as e:
                note("junk", type(e).__name__)
            time.sleep(0.01)

    threads = [
        threading.Thread(target=hoarder if i % 2 == 0 else spammer, args=(i, w), daemon=True)
        for i, w in enumerate(clients)
    ]
    threads += [threading.Thread(target=registration_flood, daemon=True), threading.Thread(target=junk, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()) + 15)
    time.sleep(args.settle)
    final = {}
    for i, w in enumerate(clients):
        try:
            got = w.lease(version)
            final[f"key{i}"] = "lease" if got["lease"] else "no_lease: " + str(got.get("reason"))
        except (Refused, Unavailable) as e:
            final[f"key{i}"] = code_of(e)
    with open(args.out, "w") as f:
        json.dump(
            {
                "seen": {k: dict(v) for k, v in seen.items()},
                "final": final,
                "roles": {f"key{i}": "hoarder" if i % 2 == 0 else "garbage" for i in range(len(clients))},
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
