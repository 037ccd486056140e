"""Free-key attackers against an orchestrator, as a separate process (tests/test_hostile.py,
benchmarks/bench_orchestrator.py --attack).

    python tests/hostile_attackers.py URL SECONDS OUT.json [--keys 20]

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
import threading
import time
from collections import Counter

import httpx
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmrl.proofs.toploc import build_proofs, encode
from swarmrl.protocol.client import Refused, Unavailable, WorkerClient

# Answers a grader can burn its whole time limit (or memory) on: power towers, huge factorials
# and fractions, deep nesting.
WORST = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{1000000!}", r"\boxed{\frac{10^{10^{9}}}{7}}",
         r"\boxed{((((((((((1))))))))))^{99999}}", r"\boxed{2^{x^{x^{x}}}}"]


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
            proofs = encode(build_proofs(torch.randn(len(ids), hidden), chunk_size=lease["proof"]["chunk_size"],
                                         topk=lease["proof"]["topk"]))
            samples.append({"token_ids": ids, "logprobs": [-0.1] * len(ids), "finish_reason": "stop", "proofs": proofs})
        groups.append({"slot": p["slot"], "policy_version": lease["max_version"], "samples": samples})
    return {"lease_id": lease["lease_id"], "groups": groups}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("seconds", type=float)
    ap.add_argument("out")
    ap.add_argument("--keys", type=int, default=20)
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds to wait after the attack before the final lease attempts (let leases expire)")
    ap.add_argument("--tokenizer", required=True, help="a policy folder (the garbage's token ids, hidden size)")
    args = ap.parse_args()
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
                WorkerClient(args.url, Ed25519PrivateKey.generate(), timeout_s=10,
                             local_address="127.0.0.3").register(f"flood-{n}")
                note("flood", "registered")
            except (Refused, Unavailable) as e:
                note("flood", code_of(e))
            time.sleep(0.01)

    def junk() -> None:
        http = httpx.Client(timeout=10, transport=httpx.HTTPTransport(local_address="127.0.0.4"))
        body = os.urandom(4096)
        while time.monotonic() < deadline:
            try:
                r = http.post(args.url + "/v1/rollouts", content=body,
                              headers={"x-swarmrl-run": status["run_id"], "x-swarmrl-key": "ab" * 32,
                                       "x-swarmrl-timestamp": f"{time.time():.3f}", "x-swarmrl-nonce": os.urandom(8).hex(),
                                       "x-swarmrl-signature": "cd" * 64})
                note("junk", str(r.status_code))
            except httpx.HTTPError as e:
                note("junk", type(e).__name__)
            time.sleep(0.01)

    threads = [threading.Thread(target=hoarder if i % 2 == 0 else spammer, args=(i, w), daemon=True)
               for i, w in enumerate(clients)]
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
        json.dump({"seen": {k: dict(v) for k, v in seen.items()}, "final": final,
                   "roles": {f"key{i}": "hoarder" if i % 2 == 0 else "garbage" for i in range(len(clients))}}, f,
                  indent=1)


if __name__ == "__main__":
    main()
