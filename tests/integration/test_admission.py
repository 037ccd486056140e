"""Admission (orchestrator/admission.py) and run-bound signatures: the rules as pure functions
with hand-checked numbers, the grading lanes with threads, and the cross-run and framing
sequences against two real orchestrator processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmrl.config import OrchestratorConfig
from swarmrl.orchestrator.admission import (
    Busy,
    GradingLanes,
    Standing,
    allowance,
    is_proven,
    lease_size,
    lease_timeout,
    unproven_share,
)
from swarmrl.protocol.client import Refused, Unavailable, WorkerClient
from swarmrl.protocol.signing import AuthError, WrongRun, new_run_id, sign_headers, verify_request

from orchestrator_harness import OrchestratorProcess, make_run_dir

pytestmark = pytest.mark.timeout(300)
ORCH = OrchestratorConfig(new_key_slots=8, slots_per_accepted=0.5, max_open_leases=2, proven_after=4)


# ---- the rules, by hand ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "accepted, expired, fraud, expect",
    [
        (0, 0, 0, 8),  # a new key: new_key_slots
        (4, 0, 0, 10),  # 8 + 4 * 0.5
        (100, 0, 0, 16),  # capped at max_open_leases (2) full leases of 8
        (0, 8, 0, 0),  # a new key that let one lease expire holds nothing for a while
        (100, 8, 0, 8),  # a proven worker that crashed once keeps half
        (0, 3, 2, 3),  # 8 - 3 - 2
        (0, 20, 0, 0),  # never negative
    ],
)
def test_allowance(accepted, expired, fraud, expect):
    assert allowance(Standing(accepted, expired, fraud, leased=0), ORCH, lease_prompts=8) == expect


def test_groups_awaiting_validation_count_against_unproven_keys_only():
    assert Standing(0, 0, 0, leased=2, waiting=6).held(ORCH) == 8
    assert Standing(4, 0, 0, leased=2, waiting=6, validated=4).held(ORCH) == 2
    # Accepted on cheap checks alone (validator.rate < 1) is not proven.
    assert Standing(40, 0, 0, leased=2, waiting=6, validated=3).held(ORCH) == 8


def test_lease_size_timeout_and_proven():
    assert lease_size(10, 8, allowed=16) == 8
    assert lease_size(3, 8, allowed=16) == 0  # waits for room for a full lease
    assert lease_size(2, 8, allowed=2) == 2 and lease_size(1, 8, allowed=2) == 0  # a small allowance
    assert lease_size(-2, 8, allowed=0) == 0
    # The new keys' share is never below one lease (bound 0: 4 outstanding, half of it is 2).
    assert unproven_share(ORCH, outstanding=4, lease_prompts=4) == 4
    assert unproven_share(ORCH, outstanding=32, lease_prompts=8) == 16
    assert lease_timeout(120.0, 8, 8) == 120.0
    assert lease_timeout(120.0, 4, 8) == 60.0
    assert lease_timeout(120.0, 1, 8) == 30.0  # floored at a quarter
    assert not is_proven(3, ORCH) and is_proven(4, ORCH)


def test_grading_lanes_one_per_key_and_one_for_all_unproven_keys():
    class Lane:
        def close(self):
            pass

    lanes = GradingLanes([Lane(), Lane()], wait_s=0.2)
    inside = threading.Event()
    release = threading.Event()

    def hold(key, proven):
        with lanes.lane(key, proven):
            inside.set()
            release.wait(5)

    t = threading.Thread(target=hold, args=("new-1", False))
    t.start()
    assert inside.wait(5)
    with pytest.raises(Busy, match="already has a submission"):
        with lanes.lane("new-1", False):
            pass
    t0 = time.monotonic()
    with pytest.raises(Busy, match="new workers"):  # the unproven lane is taken
        with lanes.lane("new-2", False):
            pass
    assert time.monotonic() - t0 < 2
    with lanes.lane("proven", True) as lane:  # a proven key still gets the other lane at once
        assert isinstance(lane, Lane)
    release.set()
    t.join()
    with lanes.lane("new-2", False):
        pass


# ---- run-bound signatures ----------------------------------------------------------------------
def test_a_signature_is_valid_in_its_run_only():
    key = Ed25519PrivateKey.generate()
    run_a, run_b = new_run_id(), new_run_id()
    headers = sign_headers(key, run_a, "POST", "/v1/leases", b"{}")
    assert verify_request(headers, "POST", "/v1/leases", b"{}", run_id=run_a, max_skew_s=60)[0]
    with pytest.raises(WrongRun, match=f"signed for run '{run_a}'.*serves run {run_b}"):
        verify_request(headers, "POST", "/v1/leases", b"{}", run_id=run_b, max_skew_s=60)
    # Claiming run b in the header does not help: the signature covers the run.
    with pytest.raises(AuthError, match="bad signature"):
        verify_request({**headers, "x-swarmrl-run": run_b}, "POST", "/v1/leases", b"{}", run_id=run_b, max_skew_s=60)
    old = {k: v for k, v in headers.items() if k != "x-swarmrl-run"}
    with pytest.raises(WrongRun, match="not bound to a run"):
        verify_request(old, "POST", "/v1/leases", b"{}", run_id=run_a, max_skew_s=60)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    procs = []
    for name in ("a", "b"):
        run = make_run_dir(
            root / name,
            "--validator.rate",
            "0",
            "--validator.ban_after",
            "3",
            "--orchestrator.proven_after",
            "0",
            "--async.max_pending_groups",
            "1000",
            "--sampling.prompts_per_step",
            "100",
        )
        proc = OrchestratorProcess(run).start()
        proc.publish_v0()
        procs.append(proc)
    yield procs
    for p in procs:
        p.stop()


def test_a_request_signed_for_run_a_is_refused_by_run_b(two_runs):
    a, b = two_runs
    key = Ed25519PrivateKey.generate()
    wa, wb = WorkerClient(a.url, key), WorkerClient(b.url, key)
    wa.register("same-key")
    wb.register("same-key")  # one key may join both runs
    assert wa.run() != wb.run()
    body = json.dumps({"policy_version": 0}).encode()
    headers = {"content-type": "application/json", **sign_headers(key, wa.run(), "POST", "/v1/leases", body)}
    assert httpx.post(a.url + "/v1/leases", content=body, headers=headers).status_code == 200
    r = httpx.post(b.url + "/v1/leases", content=body, headers=headers)
    assert r.status_code == 401 and r.json()["error"] == "wrong_run"
    assert wa.run() in r.json()["detail"] and wb.run() in r.json()["detail"]
    # A worker pinned to run a refuses to talk to run b at all.
    with pytest.raises(WrongRun, match="check the orchestrator URL"):
        WorkerClient(b.url, key, run_id=wa.run()).lease(0)


def _submission(lease: dict) -> dict:
    """A well-formed submission (its content does not matter for these refusals)."""
    return {
        "lease_id": lease["lease_id"],
        "groups": [
            {
                "slot": p["slot"],
                "policy_version": 0,
                "samples": [
                    {"token_ids": [5, 6], "logprobs": [-1.0, -1.0], "finish_reason": "length", "proofs": ["AA=="]}
                ],
            }
            for p in lease["prompts"]
        ],
    }


def test_the_framing_sequence_does_not_ban_an_honest_worker(two_runs):
    """A malicious orchestrator (run b) hands the honest worker a lease id of run a (where the
    attacker leased it), and replays the worker's signed submission to run a, three times and
    more; then the attacker feeds it another key's lease id directly. Nothing counts as fraud."""
    a, b = two_runs
    attacker = a.new_worker("attacker")
    honest_key = Ed25519PrivateKey.generate()
    honest_a, honest_b = WorkerClient(a.url, honest_key), WorkerClient(b.url, honest_key)
    honest_a.register("honest")
    honest_b.register("honest")
    stolen = attacker.lease(0)["lease"]
    for _ in range(4):
        body = json.dumps(_submission(stolen), separators=(",", ":")).encode()
        # The honest worker signs for the run it talks to (b); b replays the bytes to a.
        headers = {
            "content-type": "application/json",
            **sign_headers(honest_key, honest_b.run(), "POST", "/v1/rollouts", body),
        }
        r = httpx.post(a.url + "/v1/rollouts", content=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"] == "wrong_run"
        # Fed straight to the honest worker in run a: refused, counted against nobody.
        with pytest.raises(Refused) as e:
            honest_a.submit(_submission(stolen))
        assert e.value.code == "foreign_lease"
    me = honest_a.me()
    assert me["fraud"] == 0 and me["rejected"] == 0 and not me["banned"]
    assert honest_a.lease(0)["lease"] is not None  # and it still gets work


def test_a_hoarder_loses_its_allowance_and_new_keys_share_a_cap(tmp_path):
    run = make_run_dir(
        tmp_path / "run",
        "--validator.rate",
        "0",
        "--orchestrator.lease_timeout_s",
        "1",
        "--orchestrator.new_key_slots",
        "2",
        "--orchestrator.proven_after",
        "2",
        "--async.max_pending_groups",
        "8",
        "--sampling.prompts_per_step",
        "4",
    )
    proc = OrchestratorProcess(run).start()
    try:
        proc.publish_v0()
        keys = [proc.new_worker(f"new-{i}") for i in range(4)]
        # Unproven keys together hold at most unproven_share (0.5) of 8 outstanding = 4 prompts
        # (beyond it, only other addresses get the reserve: admission per source, below).
        got = [w.lease(0) for w in keys]
        leased = [g for g in got if g["lease"] is not None]
        assert sum(len(g["lease"]["prompts"]) for g in leased) == 4
        assert any("new workers hold" in (g.get("reason") or "") for g in got)
        hoarder = keys[0]
        assert got[0]["lease"] is not None
        time.sleep(1.5)  # its lease (2 prompts, floor 0.25 s... scaled: 1 s) runs out unsubmitted
        with pytest.raises(Unavailable, match="allowance_exhausted"):
            hoarder.lease(0)
        me = hoarder.me()
        assert me["expired_slots"] == 2 and me["lease_allowance"] == 0 and not me["proven"]
    finally:
        proc.stop()


def test_hoarded_leases_do_not_take_proven_workers_capacity(tmp_path):
    """Unproven keys' open slots have their own cap (unproven_share), so a proven key's lease is
    held to the back-pressure limit counting proven work only: hoarders holding their whole
    share cost proven workers nothing. (A trusted key counts as proven; proving one for real
    needs validated groups, which other tests do.)"""
    proven = [Ed25519PrivateKey.generate() for _ in range(2)]
    keys_file = tmp_path / "trusted.txt"
    keys_file.write_text("".join(WorkerClient("http://127.0.0.1:9", k).key_hex + "\n" for k in proven))
    run = make_run_dir(
        tmp_path / "run",
        "--validator.rate",
        "0",
        "--orchestrator.new_key_slots",
        "2",
        "--sampling.worker_batch_prompts",
        "2",
        "--async.max_pending_groups",
        "4",
        "--sampling.prompts_per_step",
        "2",
        "--orchestrator.trusted_keys_file",
        str(keys_file),
    )
    proc = OrchestratorProcess(run).start()
    try:
        proc.publish_v0()
        hoarders = [proc.new_worker(f"hoarder-{i}") for i in range(2)]
        # The share: max(one lease = 2, 0.5 * 4) = 2 prompts, taken by the first hoarder (and the
        # reserve beyond it is for other addresses).
        got = [w.lease(0) for w in hoarders]
        assert got[0]["lease"] is not None and got[1]["lease"] is None
        assert "new workers hold 2 of the 2" in got[1]["reason"]
        a, b = (WorkerClient(proc.url, k) for k in proven)
        a.register("proven-a")
        b.register("proven-b")
        assert len(a.lease(0)["lease"]["prompts"]) == 2
        # 4 slots are open now (the limit), 2 of them hoarded: b still gets the other 2.
        assert len(b.lease(0)["lease"]["prompts"]) == 2
        # The proven workers' own 4 are the limit; a new key is still held to it.
        late = proc.new_worker("late")
        assert late.lease(0)["lease"] is None
    finally:
        proc.stop()


# ---- admission per source address, at the shipped sizes ----------------------------------------
# Leases of 8, 16 prompts a step, bound 2: 32 outstanding, unproven keys' share 16 (first come),
# and beyond it a reserve of 4 leases, one per address. Every loopback address (127.0.0.0/8) is its
# own source: hoarders connect from 127.0.0.10 and up, the newcomer from 127.0.0.3.
SHIPPED = ("--sampling.prompts_per_step", "16", "--sampling.worker_batch_prompts", "8", "--async.bound", "2")


def _shipped_run(tmp_path, *overrides: str) -> OrchestratorProcess:
    run = make_run_dir(tmp_path / "run", "--validator.rate", "0", *SHIPPED, *overrides)
    proc = OrchestratorProcess(run).start()
    proc.publish_v0()
    return proc


def _from(proc: OrchestratorProcess, address: str, name: str) -> WorkerClient:
    w = WorkerClient(proc.url, Ed25519PrivateKey.generate(), timeout_s=10, local_address=address)
    w.register(name)
    return w


@pytest.mark.parametrize("spread", [False, True], ids=["one-address", "own-addresses"])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_an_honest_newcomer_gets_a_lease_while_free_keys_hoard(tmp_path, n, spread):
    """N free keys lease and never submit, from one address or each from its own: a newcomer from
    another address gets a full lease at its first ask. Keys of one address hold the share (16)
    at most; five addresses hold 40 prompts, past the share but within share and reserve (48),
    so there is room for one more. The counts are in SQLite: a restart keeps them."""
    proc = _shipped_run(tmp_path)
    try:
        hoarders = [_from(proc, f"127.0.0.{10 + i if spread else 10}", f"hoarder-{i}") for i in range(n)]
        got = [h.lease(0) for h in hoarders]
        assert sum(g["lease"] is not None for g in got) == (n if spread else min(n, 2))
        for g in got[2:] if not spread else ():
            assert "new workers hold 16 of the 16" in g["reason"] and "those from 127.0.0.10 hold 16" in g["reason"]
        newcomer = _from(proc, "127.0.0.3", "honest")
        t0 = time.monotonic()
        lease = newcomer.lease(0)["lease"]
        assert lease is not None and len(lease["prompts"]) == 8, "the newcomer waits"
        assert time.monotonic() - t0 < 5
        if n == 5 and not spread:
            proc.stop()
            proc.start()
            late = _from(proc, "127.0.0.10", "hoarder-5").lease(0)
            assert late["lease"] is None and "those from 127.0.0.10 hold 16" in late["reason"]
            assert _from(proc, "127.0.0.4", "honest-2").lease(0)["lease"] is not None
    finally:
        proc.stop()


def test_more_hoarding_addresses_than_the_reserve_hold_a_newcomer_one_lease_time(tmp_path):
    """Six addresses hoarding one lease each fill the share and the reserve: the newcomer waits.
    When their leases run out, the prompts they let expire count against their addresses for
    penalty_window_s: their fresh keys, asking twenty times a second, may take the share again
    (first come) but not the reserve, which the newcomer gets within one lease time."""
    lease_s = 3.0
    proc = _shipped_run(tmp_path, "--orchestrator.lease_timeout_s", str(lease_s))
    try:
        hoarders = [_from(proc, f"127.0.0.{10 + i}", f"hoarder-{i}") for i in range(6)]
        assert all(h.lease(0)["lease"] is not None for h in hoarders)
        t0 = time.monotonic()
        newcomer = _from(proc, "127.0.0.3", "honest")
        first = newcomer.lease(0)
        assert first["lease"] is None and "new workers hold 48 of the 16" in first["reason"]
        fresh = [_from(proc, f"127.0.0.{10 + i}", f"fresh-{i}") for i in range(6)]
        stop = threading.Event()
        hoarded: list[dict] = []

        def hoard_again(w: WorkerClient) -> None:
            while not stop.is_set():
                got = w.lease(0)
                if got["lease"] is not None:
                    hoarded.append(got)
                time.sleep(0.05)

        threads = [threading.Thread(target=hoard_again, args=(w,), daemon=True) for w in fresh]
        for t in threads:
            t.start()
        lease = None
        while lease is None and time.monotonic() - t0 < lease_s + 5:
            time.sleep(0.2)
            lease = newcomer.lease(0)["lease"]
        waited = time.monotonic() - t0
        stop.set()
        for t in threads:
            t.join(timeout=15)
        assert lease is not None, "the newcomer got no lease after the hoarders' leases ran out"
        assert waited < lease_s + 5
        assert len(hoarded) <= 2, "the hoarders' addresses leased from the reserve again"
        refused = [w.lease(0) for w in fresh]
        assert any("and let 8 expire lately" in (r.get("reason") or "") for r in refused)
    finally:
        proc.stop()


def test_a_closed_run_admits_listed_keys_only(tmp_path):
    allowed = tmp_path / "allowed.txt"
    invited, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    run = make_run_dir(tmp_path / "run", "--orchestrator.allowed_keys_file", str(allowed))
    proc = OrchestratorProcess(run).start()
    try:
        w, stranger = WorkerClient(proc.url, invited), WorkerClient(proc.url, other)
        allowed.write_text(f"# the operator's list\n{w.key_hex}  # my GPU box\n")
        assert w.register("invited")["worker"] == w.key_hex
        with pytest.raises(Refused) as e:
            stranger.register("stranger")
        assert e.value.status == 403 and e.value.code == "not_invited" and stranger.key_hex in e.value.detail
        time.sleep(0.01)
        allowed.write_text(f"{w.key_hex}\n{stranger.key_hex}\n")  # added while the run goes on
        os.utime(allowed, (time.time() + 5, time.time() + 5))  # a new mtime even on a coarse clock
        assert stranger.register("stranger")["worker"] == stranger.key_hex
    finally:
        proc.stop()


def test_a_worker_pinned_to_a_run_refuses_another_orchestrator(two_runs, tmp_path):
    a, b = two_runs
    run_a = WorkerClient(a.url, Ed25519PrivateKey.generate()).run()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarmrl.cli",
            "worker",
            "--orchestrator",
            b.url,
            "--run-id",
            run_a,
            "--key-file",
            str(tmp_path / "key.pem"),
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr  # the CLI's exit code for a refusal it explains
    assert f"not the run {run_a}" in done.stderr and "Traceback" not in done.stderr
