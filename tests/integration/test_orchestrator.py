"""The orchestrator as a real process on 127.0.0.1, driven over HTTP by real clients.

Completions here are written by hand (right or wrong answers in the task's format), so every
expectation about rewards, refusals and batches is exact; the sampler-driven path is covered by
the end-to-end tests. Their TOPLOC proofs are real (a prefill of policy v0), and the module's
orchestrator runs with `validator.rate 0`: hand-written tokens are not what the seeded sampler
would pick, so the full check is exercised in test_validation.py instead.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmrl.model.tokenizer import build_char_tokenizer
from swarmrl.protocol.client import Refused, TrainerClient, Unavailable, WorkerClient
from swarmrl.protocol.signing import sign_headers
from swarmrl.tasks.source import model_input

from harness import run_store, store_rows
from orchestrator_harness import (
    OrchestratorProcess,
    answers,
    completion_ids,
    honest_proofs,
    make_run_dir,
    signed_version,
)

pytestmark = pytest.mark.timeout(180)

TOK = build_char_tokenizer()
ANSWERS = answers()
# Policy v0 of the newest run made here (every run's v0 is build_tiny_policy(seed=0)): the weights
# the hand-written groups' proofs are built with. Set by hand_run_dir, which every test's run goes
# through, so a test runs alone or first on an xdist worker as well as after the module's fixture.
POLICY: Path = None
# Hand-written completions: cheap checks only, and no bans (many tests here send bad work on purpose).
# Leasing mechanics with hand-made workers: every key counts as proven (the new keys' shared cap
# is tested in tests/test_admission.py), its own allowance still applies.
HAND_WRITTEN = ("--validator.rate", "0", "--validator.ban_after", "1000", "--orchestrator.proven_after", "0")


def stored_groups(orch: OrchestratorProcess, lease: dict) -> list[dict]:
    """The groups the orchestrator stored for a lease, as submitted (with its rewards)."""
    sql = "SELECT payload FROM groups WHERE lease_id = ? ORDER BY id"
    return [json.loads(p) for (p,) in store_rows(orch.run_dir, sql, (lease["lease_id"],))]


def hand_run_dir(root: Path, *overrides: str) -> Path:
    global POLICY
    run = make_run_dir(root, *HAND_WRITTEN, *overrides)
    POLICY = run / "policies" / "v000000"
    return run


@pytest.fixture(scope="module")
def orch(tmp_path_factory):
    # Many tests share this process and leave leases open: back-pressure must not stop the next.
    run = hand_run_dir(
        tmp_path_factory.mktemp("orch") / "run",
        "--async.max_pending_groups",
        "10000",
        "--sampling.prompts_per_step",
        "1000",
    )
    proc = OrchestratorProcess(run).start()
    yield proc
    proc.stop()


def trainer_of(o: OrchestratorProcess) -> TrainerClient:
    return TrainerClient(o.url, (o.run_dir / "trainer.token").read_text().strip())


def publish(o: OrchestratorProcess, version: int) -> None:
    trainer_of(o).publish(version, "http://127.0.0.1:9", signed_version(o.run_dir, version))


def new_worker(o: OrchestratorProcess, name: str = "w") -> WorkerClient:
    w = WorkerClient(o.url, Ed25519PrivateKey.generate())
    w.register(name)
    return w


def group(prompt: dict, version: int, right: int, group_size: int = 2) -> dict:
    """`right` of the `group_size` completions carry the correct answer."""
    good = completion_ids(TOK, ANSWERS[prompt["problem_id"]])
    bad = completion_ids(TOK, str(int(ANSWERS[prompt["problem_id"]]) + 1))
    samples = [
        {
            "token_ids": ids,
            "logprobs": [-0.5] * len(ids),
            "finish_reason": "stop",
            "proofs": honest_proofs(POLICY, prompt["prompt_ids"], ids),
        }
        for ids in [good] * right + [bad] * (group_size - right)
    ]
    return {"slot": prompt["slot"], "policy_version": version, "samples": samples}


def lease_and_submit(w: WorkerClient, version: int, right: int = 1) -> dict:
    lease = w.lease(version)["lease"]
    assert lease is not None
    return w.submit({"lease_id": lease["lease_id"], "groups": [group(p, version, right) for p in lease["prompts"]]})


def run_of(o) -> str:
    return httpx.get(o.url + "/v1/status").json()["run_id"]


def signed_post(o, key, path: str, body: bytes, **overrides) -> httpx.Response:
    headers = {"content-type": "application/json", **sign_headers(key, run_of(o), "POST", path, body), **overrides}
    return httpx.post(o.url + path, content=body, headers=headers)


def test_health_status_metrics_and_openapi(orch):
    assert httpx.get(orch.url + "/healthz").json() == {"ok": True}
    st = httpx.get(orch.url + "/v1/status").json()
    assert st["async_bound"] == 1 and st["next_step"] == 0
    paths = httpx.get(orch.url + "/openapi.json").json()["paths"]
    assert {"/v1/leases", "/v1/rollouts", "/v1/workers/register", "/v1/trainer/batches/{step}"} <= set(paths)
    text = httpx.get(orch.url + "/metrics").text
    assert "swarmrl_requests_total" in text and 'swarmrl_state{what="next_step"}' in text


def test_a_lease_names_problems_seeds_settings_and_versions(orch):
    w = new_worker(orch)
    publish(orch, 0)
    lease = w.lease(0)["lease"]
    assert lease["group_size"] == 2 and lease["max_new_tokens"] == 16 and lease["temperature"] == 1.0
    assert lease["min_version"] == 0 and lease["max_version"] == 0
    assert 25 < lease["expires_in_s"] <= 30
    assert len(lease["prompts"]) == 2
    for p in lease["prompts"]:
        assert p["problem_id"] in ANSWERS
        assert len(p["seeds"]) == 2 and len(set(p["seeds"])) == 2
        # The prompt ids are the chat-templated prompt: a worker cannot alter what it answers.
        assert p["prompt_ids"] == model_input(TOK, p["prompt"], None)[1]
    with pytest.raises(Refused) as e:
        w.lease(5)
    assert e.value.code == "version_not_allowed" and "[0, 0]" in e.value.detail


def test_rewards_are_recomputed_and_claimed_rewards_refused(orch):
    w = new_worker(orch)
    publish(orch, 0)
    # A claimed reward, on the group or on one completion, is refused with its reason (an
    # honest worker never sends one); the orchestrator's own reward is what counts.
    bad_lease = w.lease(0)["lease"]
    claimed = [group(p, 0, right=0) for p in bad_lease["prompts"]]
    claimed[0]["rewards"] = [1.0, 1.0]
    claimed[1]["samples"][1]["task_reward"] = 1.0
    refused = w.submit({"lease_id": bad_lease["lease_id"], "groups": claimed})
    assert refused["accepted"] == []
    assert [(r["reason"], "rewards" in r["detail"] or "task_reward" in r["detail"]) for r in refused["rejected"]] == [
        ("claimed_reward", True),
        ("claimed_reward", True),
    ]
    lease = w.lease(0)["lease"]
    groups = [group(p, 0, right=1) for p in lease["prompts"]]
    result = w.submit({"lease_id": lease["lease_id"], "groups": groups})
    assert [a["rewards"] for a in result["accepted"]] == [[1.0, 0.0], [1.0, 0.0]]
    assert result["rejected"] == []
    stored = stored_groups(orch, lease)
    assert [g["rewards"] for g in stored] == [[1.0, 0.0], [1.0, 0.0]]
    assert all(
        len(g["samples"]) == 2 and g["samples"][0]["seed"] in p["seeds"] for g, p in zip(stored, lease["prompts"])
    )


def test_signatures_nonces_timestamps_and_identity(orch):
    key = Ed25519PrivateKey.generate()
    body = b'{"policy_version": 0}'
    r = signed_post(orch, key, "/v1/leases", body)
    assert r.status_code == 403 and r.json()["error"] == "not_registered"
    WorkerClient(orch.url, key).register("k")
    publish(orch, 0)
    headers = {"content-type": "application/json", **sign_headers(key, run_of(orch), "POST", "/v1/leases", body)}
    assert httpx.post(orch.url + "/v1/leases", content=body, headers=headers).status_code == 200
    replay = httpx.post(orch.url + "/v1/leases", content=body, headers=headers)
    assert replay.status_code == 401 and replay.json()["error"] == "replayed_nonce"
    tampered = httpx.post(
        orch.url + "/v1/leases", content=b'{"policy_version": 1}', headers={**headers, "x-swarmrl-nonce": "a" * 32}
    )
    assert tampered.status_code == 401 and "signature" in tampered.json()["detail"]
    # Signed for one path, sent to another.
    moved = httpx.post(
        orch.url + "/v1/leases",
        content=body,
        headers={
            "content-type": "application/json",
            **sign_headers(key, run_of(orch), "POST", "/v1/workers/register", body),
        },
    )
    assert moved.status_code == 401
    old = {
        "content-type": "application/json",
        **sign_headers(key, run_of(orch), "POST", "/v1/leases", body, now=time.time() - 3600),
    }
    r = httpx.post(orch.url + "/v1/leases", content=body, headers=old)
    assert r.status_code == 401 and r.json()["error"] == "clock_skew" and "clock" in r.json()["detail"]
    r = httpx.post(orch.url + "/v1/leases", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 401 and "missing header" in r.json()["detail"]
    r = signed_post(orch, key, "/v1/leases", body, **{"x-swarmrl-key": "zz"})
    assert r.status_code == 401 and "hex" in r.json()["detail"]
    # The same key spelled in upper case would be another identity (and another nonce space).
    fresh = sign_headers(key, run_of(orch), "POST", "/v1/leases", body)
    r = httpx.post(
        orch.url + "/v1/leases",
        content=body,
        headers={**fresh, "content-type": "application/json", "x-swarmrl-key": fresh["x-swarmrl-key"].upper()},
    )
    assert r.status_code == 401 and "lowercase" in r.json()["detail"]


def test_foreign_unknown_late_and_malformed_submissions(orch):
    a, b = new_worker(orch, "a"), new_worker(orch, "b")
    publish(orch, 0)
    lease = a.lease(0)["lease"]
    ok = [group(p, 0, right=1) for p in lease["prompts"]]
    with pytest.raises(Refused) as e:
        b.submit({"lease_id": lease["lease_id"], "groups": ok})
    assert e.value.status == 403 and e.value.code == "foreign_lease"
    with pytest.raises(Refused) as e:
        a.submit({"lease_id": "0" * 32, "groups": ok})
    assert e.value.status == 404
    p0, p1 = lease["prompts"]
    out_of_range = group(p0, 0, 1)
    out_of_range["samples"][0]["token_ids"][0] = 10_000
    result = a.submit({"lease_id": lease["lease_id"], "groups": [out_of_range, group(p1, 0, 1, group_size=3)]})
    assert [r["reason"] for r in result["rejected"]] == ["token_out_of_range", "group_size"]
    # Rejected slots are not reopened; a second lease shows the rest of the checks.
    lease = a.lease(0)["lease"]
    p0, p1 = lease["prompts"]
    long = group(p0, 0, 1)
    long["samples"][1]["token_ids"] = [5] * 17
    long["samples"][1]["logprobs"] = [-1.0] * 17
    result = a.submit({"lease_id": lease["lease_id"], "groups": [long, group(p1, 3, 1)]})
    assert [r["reason"] for r in result["rejected"]] == ["length", "version_not_in_lease"]
    # Four fraudulent groups used up a's lease allowance (docs/security.md).
    with pytest.raises(Unavailable, match="allowance_exhausted"):
        a.lease(0)
    a = new_worker(orch, "a2")
    lease = a.lease(0)["lease"]
    first = a.submit({"lease_id": lease["lease_id"], "groups": [group(lease["prompts"][0], 0, 1)]})
    assert len(first["accepted"]) == 1
    again = a.submit({"lease_id": lease["lease_id"], "groups": [group(lease["prompts"][0], 0, 1)]})
    # A resubmission (the reply was lost) is answered with what was stored, not held against it.
    assert again["rejected"] == [] and again["accepted"][0]["already_accepted"] is True
    assert again["accepted"][0]["rewards"] == first["accepted"][0]["rewards"]
    twice = a.submit({"lease_id": lease["lease_id"], "groups": [group(lease["prompts"][1], 0, 1)] * 2})
    assert len(twice["accepted"]) == 1  # the same open slot twice in one request: the copy is refused
    assert [r["reason"] for r in twice["rejected"]] == ["duplicate"]


@pytest.mark.parametrize(
    "body, needle",
    [
        (b"{not json", "json"),
        (b'{"lease_id": "x", "groups": []}', "lease_id"),
        (
            b'{"lease_id": "' + b"a" * 32 + b'", "groups": [{"slot": "one", "policy_version": 0, "samples": []}]}',
            "slot",
        ),
        (
            b'{"lease_id": "' + b"a" * 32 + b'", "groups": [{"slot": 0, "policy_version": 0, "samples": '
            b'[{"token_ids": [1], "logprobs": [NaN], "finish_reason": "stop"}]}]}',
            "logprobs",
        ),
        (b"[1, 2, 3]", "body"),
    ],
)
def test_garbage_gets_a_422_naming_the_problem(orch, body, needle):
    key = Ed25519PrivateKey.generate()
    WorkerClient(orch.url, key).register("g")
    r = signed_post(orch, key, "/v1/rollouts", body)
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "invalid_request" and needle in r.json()["detail"].lower()


def test_oversized_bodies_get_413_before_parsing(orch):
    key = Ed25519PrivateKey.generate()
    big = b'{"lease_id": "' + b"a" * (9 << 20) + b'"}'
    r = signed_post(orch, key, "/v1/rollouts", big)
    assert r.status_code == 413 and r.json()["error"] == "too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(100):
            yield b" " * (100 << 10)

    r = httpx.post(orch.url + "/v1/rollouts", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(orch.url + "/healthz").status_code == 200


def test_trainer_endpoints_need_the_token(orch):
    r = httpx.post(orch.url + "/v1/trainer/batches/0")
    assert r.status_code == 401 and r.json()["error"] == "not_trainer"
    bad = TrainerClient(orch.url, "not-the-token")
    with pytest.raises(Refused):
        bad.publish(0, "http://x", {})
    with pytest.raises(Refused) as e:
        trainer_of(orch).publish(0, "http://127.0.0.1:9", {"files": {"../x": {"sha256": "0" * 64, "size": 1}}})
    assert e.value.code == "bad_manifest"


def test_batches_are_fifo_frozen_and_respect_the_bound(tmp_path):
    orch = OrchestratorProcess(hand_run_dir(tmp_path / "run")).start()
    try:
        t, w = trainer_of(orch), new_worker(orch)
        publish(orch, 0)
        assert t.batch(0).ready is False
        a, b = w.lease(0)["lease"], w.lease(0)["lease"]  # v0 can feed batches 0 and 1
        w.submit({"lease_id": a["lease_id"], "groups": [group(p, 0, 1) for p in a["prompts"]]})
        b0 = t.batch(0)
        assert b0.ready and len(b0.groups) == 2
        assert t.batch(0) == b0  # asking again returns the frozen batch
        with pytest.raises(Refused) as e:
            t.batch(5)
        assert e.value.code == "wrong_step"
        publish(orch, 1)
        lease_and_submit(w, 1)
        w.submit({"lease_id": b["lease_id"], "groups": [group(p, 0, 1) for p in b["prompts"]]})  # late, still allowed
        assert w.lease(1)["lease"] is None  # back-pressure: 4 queued cover both batches v1 can feed
        b1 = t.batch(1)  # first in, first out: the v1 groups, submitted before the late v0 ones
        assert b1.ready and b1.metrics["off_policy/max"] == 0.0
        publish(orch, 2)
        assert t.batch(2).ready is False  # the two v0 groups are now too old for batch 2
        lease_and_submit(w, 2)
        b2 = t.batch(2)
        assert b2.metrics["off_policy/dropped"] == 2.0
        assert b2.metrics["off_policy/max"] == 0.0
        ids = b0.group_ids + b1.group_ids + b2.group_ids
        assert len(ids) == len(set(ids)) == 6
        assert store_rows(orch.run_dir, "SELECT COUNT(*) FROM groups WHERE state = 'stale'")[0][0] == 2
        assert store_rows(orch.run_dir, "SELECT step, COUNT(*) FROM groups WHERE state = 'consumed' GROUP BY step") == [
            (0, 2),
            (1, 2),
            (2, 2),
        ]
        # Uninformative groups (all right) are stored and counted, never batched.
        uninformative = lease_and_submit(w, 2, right=2)
        assert [a["informative"] for a in uninformative["accepted"]] == [False, False]
        assert t.batch(3).ready is False
        lease_and_submit(w, 2)
        m3 = t.batch(3).metrics
        assert m3["batch/uninformative_groups"] == 2.0 and m3["batch/scored_groups"] == 4.0
        assert m3["reward/task_mean_all"] == 0.75 and m3["reward/task_mean"] == 0.5
        # A trainer resumed from an older checkpoint announces an older version: work sampled
        # with the abandoned newer versions is dropped, open leases on them expire.
        publish(orch, 3)
        held = w.lease(3)["lease"]
        lease_and_submit(w, 3)
        publish(orch, 2)
        assert store_rows(orch.run_dir, "SELECT COUNT(*) FROM groups WHERE state = 'stale'")[0][0] == 4
        with pytest.raises(Refused) as e:
            w.submit({"lease_id": held["lease_id"], "groups": [group(p, 3, 1) for p in held["prompts"]]})
        assert e.value.code == "lease_expired"
    finally:
        orch.stop()


def test_an_expired_lease_is_reissued_and_a_late_submission_refused(tmp_path):
    orch = OrchestratorProcess(hand_run_dir(tmp_path / "run", "--orchestrator.lease_timeout_s", "1")).start()
    try:
        slow, other = new_worker(orch, "slow"), new_worker(orch, "other")
        publish(orch, 0)
        lease = slow.lease(0)["lease"]
        time.sleep(1.3)
        reissued = other.lease(0)["lease"]
        assert [p["problem_id"] for p in reissued["prompts"]] == [p["problem_id"] for p in lease["prompts"]]
        assert reissued["prompts"][0]["seeds"] != lease["prompts"][0]["seeds"]  # fresh seeds
        with pytest.raises(Refused) as e:
            slow.submit({"lease_id": lease["lease_id"], "groups": [group(p, 0, 1) for p in lease["prompts"]]})
        assert e.value.status == 410 and "reissued" in e.value.detail
    finally:
        orch.stop()


def test_rate_limits_answer_429_with_retry_after(tmp_path):
    orch = OrchestratorProcess(
        hand_run_dir(tmp_path / "run", "--orchestrator.rate_per_s", "1", "--orchestrator.rate_burst", "5")
    ).start()
    try:
        key = Ed25519PrivateKey.generate()
        codes = [signed_post(orch, key, "/v1/workers/register", b'{"name": "x"}') for _ in range(10)]
        assert [r.status_code for r in codes[:5]] == [200] * 5
        limited = [r for r in codes[5:] if r.status_code == 429]
        assert limited and limited[0].json()["error"] == "rate_limited" and "retry-after" in limited[0].headers
        # Another key is not affected.
        assert signed_post(orch, Ed25519PrivateKey.generate(), "/v1/workers/register", b"{}").status_code == 200
    finally:
        orch.stop()


def test_a_finished_group_survives_an_orchestrator_restart(tmp_path):
    """The worker keeps its submission in the outbox while the orchestrator is down and
    delivers it after the restart; the SQLite state (lease, nonces) survives kill -9."""
    from swarmrl.inference.worker import Worker

    orch = OrchestratorProcess(hand_run_dir(tmp_path / "run")).start()
    try:
        worker = Worker(orch.url, key_file=tmp_path / "w" / "key.pem", cache_dir=tmp_path / "w", name="w")
        worker.client.register("w")
        publish(orch, 0)
        lease = worker.client.lease(0)["lease"]
        path = worker.outbox / f"{lease['lease_id']}.json"
        path.write_text(
            json.dumps(
                {
                    "expires_at": lease["expires_at"],
                    "submission": {"lease_id": lease["lease_id"], "groups": [group(p, 0, 1) for p in lease["prompts"]]},
                }
            )
        )
        orch.kill9()
        with pytest.raises(Unavailable):
            worker.client.status()
        results = []
        sender = threading.Thread(target=lambda: results.append(worker.deliver(path)))
        sender.start()
        time.sleep(1.0)
        assert path.exists() and not results  # still retrying, nothing lost
        orch.start()
        sender.join(timeout=60)
        assert results and len(results[0]["accepted"]) == 2
        assert not path.exists()
        assert len(stored_groups(orch, lease)) == 2
    finally:
        orch.stop()


def test_a_lease_over_the_request_limit_goes_in_parts_and_a_dropped_upload_resumes(tmp_path):
    """Two groups that together exceed orchestrator.max_request_bytes: the worker's first request
    (both) is refused 413, it halves its parts and sends one group per request; the orchestrator
    is killed after the first part is accepted, and the outbox entry then holds only the second,
    which is delivered after the restart. Each group is stored exactly once."""
    from swarmrl.inference.worker import Worker

    publish_dir = hand_run_dir(tmp_path / "run", "--orchestrator.lease_timeout_s", "600")  # three starts
    orch = OrchestratorProcess(publish_dir).start()
    try:
        worker = Worker(orch.url, key_file=tmp_path / "w" / "key.pem", cache_dir=tmp_path / "w", name="w")
        worker.client.register("w")
        publish(orch, 0)
        lease = worker.client.lease(0)["lease"]
        groups = [group(p, 0, 1) for p in lease["prompts"]]
        one = max(len(json.dumps({"lease_id": lease["lease_id"], "groups": [g]})) for g in groups)
        both = len(json.dumps({"lease_id": lease["lease_id"], "groups": groups}))
    finally:
        orch.stop()
    limit = (one + both) // 2  # room for one group, not for two
    assert one < limit < both and limit >= 1024
    config = publish_dir / "config.toml"
    config.write_text(config.read_text().replace("max_request_bytes = 8388608", f"max_request_bytes = {limit}", 1))
    orch.start()
    try:
        path = worker.outbox / f"{lease['lease_id']}.json"
        path.write_text(
            json.dumps(
                {"expires_at": time.time() + 600, "submission": {"lease_id": lease["lease_id"], "groups": groups}}
            )
        )
        real, sent, left = worker.client.submit, [], []

        def submit(body: dict) -> dict:
            result = real(body)  # a 413 raises here, before anything is recorded
            sent.append([g["slot"] for g in body["groups"]])
            if len(sent) == 1:  # the connection drops after the first part is answered
                orch.kill9()
                threading.Timer(1.5, orch.start).start()
            else:
                left.append([g["slot"] for g in json.loads(path.read_text())["submission"]["groups"]])
            return result

        worker.client.submit = submit
        result = worker.deliver(path)
        assert sent == [[groups[0]["slot"]], [groups[1]["slot"]]]
        assert left == [[groups[1]["slot"]]]  # after the restart only the unsent group was left
        assert result is not None and len(result["accepted"]) == 2 and not result["rejected"]
        assert not path.exists()
        stored = store_rows(orch.run_dir, "SELECT slot FROM groups WHERE lease_id = ?", (lease["lease_id"],))
        assert sorted(stored) == sorted((g["slot"],) for g in groups)
    finally:
        orch.stop()


def limited_orchestrator(tmp_path, **settings) -> tuple[OrchestratorProcess, Path]:
    """An orchestrator whose config sets `settings` of [orchestrator] (the default.toml lines
    replaced), and its run directory."""
    run = hand_run_dir(tmp_path / "run")
    config = run / "config.toml"
    text = config.read_text()
    for name, value in settings.items():
        text, n = re.subn(rf"(?m)^{name} = .*$", f"{name} = {value}", text, count=1)
        assert n == 1, name
    config.write_text(text)
    return OrchestratorProcess(run).start(), run


def test_a_group_over_the_request_limit_goes_in_pieces_and_resumes_after_a_restart(tmp_path):
    """A lease whose each group is larger than max_request_bytes: the worker's part is refused
    413, it halves until its pieces fit and uploads each group in pieces (POST
    /v1/rollouts/upload); the orchestrator is killed after the first piece is answered and
    restarted, and the worker goes on from the offset the orchestrator kept. Both groups are
    accepted and stored once; nothing is left in the uploads folder."""
    from swarmrl.inference.worker import Worker

    # Three starts of the orchestrator under CI's load took 52 s: a lease of the harness's 30 s ran out.
    orch, run = limited_orchestrator(tmp_path, lease_timeout_s=600.0)
    try:  # the version is published and the lease taken under the default limit (a manifest is > 1 KB)
        worker = Worker(orch.url, key_file=tmp_path / "w" / "key.pem", cache_dir=tmp_path / "w", name="w")
        worker.client.register("w")
        publish(orch, 0)
        lease = worker.client.lease(0)["lease"]
    finally:
        orch.stop()
    config = run / "config.toml"
    config.write_text(re.sub(r"(?m)^max_request_bytes = .*$", "max_request_bytes = 1024", config.read_text(), count=1))
    orch.start()
    try:
        groups = [group(p, 0, 1) for p in lease["prompts"]]
        assert all(len(json.dumps(g)) > 1024 for g in groups)  # each needs pieces
        path = worker.outbox / f"{lease['lease_id']}.json"
        path.write_text(
            json.dumps(
                {"expires_at": time.time() + 600, "submission": {"lease_id": lease["lease_id"], "groups": groups}}
            )
        )
        real, pieces, lost = worker.client.upload, [], []

        def upload(piece: dict) -> dict:
            reply = real(piece)
            pieces.append((piece["slot"], piece["offset"], reply["received"]))
            if len(pieces) == 1:  # the connection drops after the first piece is answered
                orch.kill9()
                threading.Timer(1.5, orch.start).start()
            if piece["slot"] == groups[1]["slot"] and piece["offset"] == 0 and not lost:
                # The orchestrator loses the second group's first piece: the next piece is refused
                # (409 upload_offset) and the worker sends that group again from its start.
                lost.append(piece["slot"])
                for f in (run / "uploads").iterdir():
                    f.unlink()
            return reply

        worker.client.upload = upload
        result = worker.deliver(path)
        assert result is not None and len(result["accepted"]) == 2 and not result["rejected"], result
        first = [p for p in pieces if p[0] == groups[0]["slot"]]
        # After the restart the second piece started where the first ended: nothing sent twice.
        assert first[0][1] == 0 and first[1][1] == first[0][2] and len(first) >= 2
        assert all(b[1] == a[2] for a, b in zip(first, first[1:]))
        second = [offset for slot, offset, _ in pieces if slot == groups[1]["slot"]]
        assert lost and second.count(0) == 2  # started again after the orchestrator lost it
        stored = store_rows(run, "SELECT slot FROM groups WHERE lease_id = ?", (lease["lease_id"],))
        assert sorted(stored) == sorted((g["slot"],) for g in groups)
        assert not list((run / "uploads").iterdir()) and not path.exists()
    finally:
        orch.stop()


def test_unfinished_uploads_are_bounded_per_address_checked_and_dropped_with_their_lease(tmp_path):
    """Pieces only for the key's own open slots; a wrong digest refused and nothing stored; one
    address's unfinished uploads stop at max_upload_bytes_per_source (429), on disk, whichever
    keys send them; an ended lease's upload is deleted at the next piece anyone sends."""
    import hashlib

    orch, run = limited_orchestrator(tmp_path, max_upload_bytes_per_source=2000, lease_timeout_s=4.0)
    try:
        publish(orch, 0)
        a, b = new_worker(orch, "a"), new_worker(orch, "b")
        lease_a, lease_b = a.lease(0)["lease"], b.lease(0)["lease"]
        text = json.dumps(group(lease_a["prompts"][0], 0, 1)).encode()
        assert 1000 < len(text) <= 2000, len(text)
        digest = hashlib.sha256(text).hexdigest()

        def piece(lease: dict, i: int, offset: int, n: int, sha: str = digest) -> dict:
            body = {"lease_id": lease["lease_id"], "slot": lease["prompts"][i]["slot"], "offset": offset}
            return body | {"total": len(text), "sha256": sha, "data": text[offset : offset + n].decode()}

        with pytest.raises(Refused) as foreign:
            b.upload(piece(lease_a, 0, 0, 100))
        assert foreign.value.code == "unknown_lease"
        with pytest.raises(Refused) as bad:
            a.upload(piece(lease_a, 1, 0, len(text), sha="0" * 64))
        assert bad.value.code == "upload_digest"
        assert store_rows(run, "SELECT COUNT(*) FROM groups") == [(0,)]
        assert a.upload(piece(lease_a, 0, 0, 600))["received"] == 600
        assert a.upload(piece(lease_a, 0, 0, 600))["received"] == 600  # a retry: not written again
        assert b.upload(piece(lease_b, 0, 0, 600))["received"] == 600
        with pytest.raises(Unavailable) as full:  # another key, the same address: 1200 held, 2000 allowed
            b.upload(piece(lease_b, 1, 0, 900))
        assert full.value.status == 429 and "uploads_full" in str(full.value)
        assert sum(f.stat().st_size for f in (run / "uploads").glob("*.part")) == 1200
        # The leases end: the next piece anyone sends finds their uploads deleted.
        time.sleep(4.5)
        c = new_worker(orch, "c")
        lease_c = c.lease(0)["lease"]
        assert c.upload(piece(lease_c, 0, 0, 100))["received"] == 100
        kept = [f.name for f in (run / "uploads").glob("*.part")]
        assert kept == [f"{lease_c['lease_id']}-{lease_c['prompts'][0]['slot']}.part"]
    finally:
        orch.stop()


def test_worker_key_file_is_private_and_stable(tmp_path):
    from swarmrl.protocol.signing import AuthError, load_or_create_key, public_key_hex

    path = tmp_path / "keys" / "w.pem"
    a = load_or_create_key(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert public_key_hex(load_or_create_key(path)) == public_key_hex(a)
    path.write_text("garbage")
    with pytest.raises(AuthError, match="delete it"):
        load_or_create_key(path)


def test_orchestrator_refuses_a_run_dir_without_config(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", "orchestrator", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "config.toml" in proc.stderr and "Traceback" not in proc.stderr


def test_wants_more_work_hand_checked():
    from swarmrl.orchestrator.leasing import wants_more_work

    # One batch of 16 still open: 10 queued + 8 leased x 0.75 = 16 expected -> enough.
    assert not wants_more_work(1, 16, 10, 8, 0.75)
    assert wants_more_work(1, 16, 10, 7, 0.75)  # 15.25 expected
    assert wants_more_work(2, 16, 10, 8, 0.75)  # the version can feed two batches: 32 wanted
    assert not wants_more_work(1, 16, 0, 32, None)  # nothing scored yet: half of 32 = 16
    assert wants_more_work(1, 16, 0, 79, 0.01)  # rate floored at 0.2: 79 x 0.2 = 15.8
    assert not wants_more_work(0, 16, 0, 0, 0.5)  # a version that can feed no batch gets no work


def test_concurrent_copies_of_a_submission_are_scored_once(orch):
    w = new_worker(orch, "twice")
    publish(orch, 0)
    lease = w.lease(0)["lease"]
    body = {"lease_id": lease["lease_id"], "groups": [group(p, 0, 1) for p in lease["prompts"]]}
    results = []
    threads = [threading.Thread(target=lambda: results.append(w.submit(body))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    accepted = [a for r in results for a in r["accepted"] if not a.get("already_accepted")]
    reasons = {x["reason"] for r in results for x in r["rejected"]}
    assert len(results) == 4 and len(accepted) == 2 and reasons <= {"in_progress"}
    assert len(stored_groups(orch, lease)) == 2


def test_one_worker_cannot_hoard_leases_or_overfill_one(orch):
    w = new_worker(orch, "hoarder")
    publish(orch, 0)
    first, second = w.lease(0)["lease"], w.lease(0)["lease"]
    third = w.lease(0)
    assert first and second and third["lease"] is None and "2 leases" in third["reason"]
    too_many = [group(p, 0, 1) for p in first["prompts"]] * 2
    with pytest.raises(Refused) as e:
        w.submit({"lease_id": first["lease_id"], "groups": too_many})
    assert e.value.status == 422 and e.value.code == "too_many_groups"
    w.submit({"lease_id": first["lease_id"], "groups": [group(p, 0, 1) for p in first["prompts"]]})
    assert new_worker(orch, "other").lease(0)["lease"] is not None
    assert w.lease(0)["lease"] is not None  # one lease done: room for another


def test_dashboard_document_and_swarmrl_status(orch, tmp_path):
    # Issue 18: the public view of a run (GET /v1/dashboard) and the terminal one (`swarmrl status`).
    import subprocess
    import sys

    publish(orch, 0)
    w = new_worker(orch, "board-me")
    lease_and_submit(w, 0, right=1)
    raw = httpx.get(orch.url + "/v1/dashboard")
    assert raw.status_code == 200
    doc = raw.json()
    assert doc["run"]["run_id"] == run_of(orch) and doc["run"]["latest_version"] == 0
    mine = [x for x in doc["workers"] if x["fingerprint"] == w.key_hex[:16]]
    assert len(mine) == 1 and mine[0]["name"] == "board-me" and mine[0]["accepted"] >= 1
    assert not mine[0]["banned"] and doc["workers_total"] >= 1
    assert sum(doc["validation"]["groups"].values()) >= 1 and doc["broadcast"]["versions"][0]["version"] == 0
    # Nothing secret: no token, no full key, no path of the run folder.
    for secret in (
        (orch.run_dir / "trainer.token").read_text().strip(),
        (orch.run_dir / "validator.token").read_text().strip(),
        w.key_hex,
        str(orch.run_dir),
    ):
        assert secret not in raw.text
    assert "/v1/dashboard" in httpx.get(orch.url + "/openapi.json").json()["paths"]
    out = subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", "status", "--orchestrator", orch.url + "/v1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    assert w.key_hex[:16] in out.stdout and "board-me" in out.stdout and "progress" in out.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", "status", "--orchestrator", orch.url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(as_json.stdout)["run"]["run_id"] == doc["run"]["run_id"]


def test_dashboard_can_be_turned_off(tmp_path):
    run = hand_run_dir(tmp_path / "run", "--orchestrator.dashboard", "false")
    proc = OrchestratorProcess(run).start()
    try:
        r = httpx.get(proc.url + "/v1/dashboard")
        assert r.status_code == 404 and "turned off" in r.json()["detail"]
    finally:
        proc.stop()


def test_trainer_reports_held_out_accuracy_to_the_dashboard(orch):
    trainer = trainer_of(orch)
    assert trainer.report(7, {"eval/accuracy": 0.625, "not/charted": 1.0})["recorded"] == 1
    with pytest.raises(Refused):  # the trainer's token only
        TrainerClient(orch.url, "wrong").report(7, {"eval/accuracy": 1.0})
    import swarmrl.orchestrator.dashboard as dashboard

    with run_store(orch.run_dir) as store, store.read() as db:
        held = store.get_meta(db, "trainer_metrics")
    assert held["7"] == {"eval/accuracy": 0.625}  # only charted keys are kept
    assert "eval/accuracy" in dashboard.PROGRESS_KEYS


def test_a_run_without_signal_is_refused_with_no_signal_after_the_default_bound(tmp_path):
    """Every completion wrong, so every group's rewards are equal: under the default limit for
    groups of 8 and 16 prompts a batch (4 batches' worth, 64 groups in a row) the trainer is told
    how many groups had no signal while it waits, then refused with a message naming the cause."""
    run = hand_run_dir(
        tmp_path / "run",
        "--sampling.group_size",
        "8",
        "--sampling.prompts_per_step",
        "16",
        "--sampling.worker_batch_prompts",
        "8",
        "--async.max_pending_groups",
        "1000",
    )
    orch = OrchestratorProcess(run).start()
    proofs: dict[tuple, list[str]] = {}  # a group's 8 completions are the same wrong answer: one prefill

    def wrong_group(prompt: dict) -> dict:
        ids = completion_ids(TOK, str(int(ANSWERS[prompt["problem_id"]]) + 1))
        key = (tuple(prompt["prompt_ids"]), tuple(ids))
        if key not in proofs:
            proofs[key] = honest_proofs(run / "policies" / "v000000", prompt["prompt_ids"], ids)
        sample = {"token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop", "proofs": proofs[key]}
        return {"slot": prompt["slot"], "policy_version": 0, "samples": [sample] * 8}

    try:
        t, w = trainer_of(orch), new_worker(orch)
        publish(orch, 0)
        t.report(0, {"eval/accuracy": 0.0})  # the trainer's held-out accuracy before RL
        for n in range(8, 65, 8):
            lease = w.lease(0)["lease"]
            reply = w.submit({"lease_id": lease["lease_id"], "groups": [wrong_group(p) for p in lease["prompts"]]})
            assert len(reply["accepted"]) == 8 and not any(a["informative"] for a in reply["accepted"])
            if n < 64:
                waiting = t.batch(0)
                assert not waiting.ready and waiting.queued == 0 and waiting.needed == 16
                assert (waiting.groups_seen, waiting.groups_all_equal) == (n, n)
                assert (waiting.all_equal_streak, waiting.all_equal_limit) == (n, 64)
        with pytest.raises(Refused) as e:
            t.batch(0)
        assert e.value.status == 409 and e.value.code == "no_signal"
        detail = e.value.detail
        assert "the last 64 groups in a row had all-equal rewards across their 8 completions" in detail
        assert "64 of the 64 groups sampled so far, 100%" in detail and "64 in a row, this run's default" in detail
        assert "mean task reward 0.00" in detail and "never earns a reward" in detail
        assert "Held-out accuracy before RL: 0.000" in detail
        for fix in ("easier task", "swarmrl sft", "tasks.types", "sampling.group_size (now 8)"):
            assert fix in detail, fix
    finally:
        orch.stop()
