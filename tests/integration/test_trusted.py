"""Trusted fleets against a real orchestrator (docs/engines.md): an endpoint worker generating
through a real `swarmrl serve` process submits groups without proofs, which the orchestrator
takes from keys in `orchestrator.trusted_keys_file` only; the validator still checks their
logprobs by prefill.

One orchestrator process on 127.0.0.1 (in-process validator; `validator.trusted_rate 1`, so
every proofless group is checked), v0 and v1 = v0 after ten AdamW steps, signed and served by a
real broadcast origin, and one `swarmrl serve` process with its reload endpoint on.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from test_serve import Server

from swarmrl.config import ConfigError, load_config
from swarmrl.inference.backends import OpenAIOptions
from swarmrl.inference.engine import build_engine
from swarmrl.inference.remote import EndpointError
from swarmrl.inference.worker import Worker
from swarmrl.model.checkpoint import load_policy
from swarmrl.protocol.client import TrainerClient
from swarmrl.protocol.signing import load_or_create_key, public_key_hex
from swarmrl.transport.broadcast import ShardServer

from adversary_world import lease_of, settled, train_a_little
from harness import verdicts
from orchestrator_harness import TRAINER_KEY, OrchestratorProcess, closed_clean, make_run_dir, signed_version

pytestmark = pytest.mark.timeout(300)

SHARED = (
    "--validator.ban_after",
    "1000",
    "--async.max_pending_groups",
    "10000",
    "--sampling.prompts_per_step",
    "1000",
    "--validator.trusted_rate",
    "1",
)


class Fleet:
    def __init__(self, root: Path):
        self.root = root
        self.trusted_key = public_key_hex(load_or_create_key(root / "trusted" / "key.pem"))
        self.keys_file = root / "trusted_keys.txt"
        self.keys_file.write_text(f"# the operator's GPU box\n{self.trusted_key}  # gpu-0\n")
        self.run = make_run_dir(root / "run", *SHARED, "--orchestrator.trusted_keys_file", str(self.keys_file))
        policies = self.run / "policies"
        train_a_little(policies / "v000000", policies / "v000001")
        manifests = {v: signed_version(self.run, v, policies / f"v{v:06d}") for v in (0, 1)}
        self.origin = ShardServer(self.run / "broadcast").start()
        self.orch = OrchestratorProcess(self.run).start()
        trainer = TrainerClient(self.orch.url, (self.run / "trainer.token").read_text().strip())
        self.policy = {}
        for v, manifest in manifests.items():
            trainer.publish(v, self.origin.url, manifest)
            self.policy[v] = {"version": v, "url": self.origin.url, "manifest": manifest}
        (root / "serve").mkdir()
        self.token = root / "serve" / "token"
        self.token.write_text("reload-secret\n")
        self.serve = Server(policies / "v000000", root / "serve", "--reload-token-file", str(root / "serve" / "token"))

    def worker(self, name: str) -> Worker:
        """An endpoint worker on the shared server; its key is in the trusted file for "trusted"."""
        d = self.root / name
        options = OpenAIOptions(endpoint=self.serve.url, load="reload", endpoint_key_file=str(self.token))
        w = Worker(
            self.orch.url,
            key_file=d / "key.pem",
            cache_dir=d,
            name=name,
            log=lambda *_: None,
            trainer_key=public_key_hex(TRAINER_KEY),
            engine="openai",
            engine_options=options,
        )
        w.client.register(name)
        return w

    def verdicts(self, key: str) -> list[dict]:
        return verdicts(self.run, key)

    def close(self) -> None:
        self.serve.stop()
        self.orch.stop()
        self.origin.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    yield from closed_clean(Fleet(tmp_path_factory.mktemp("trusted")))


def test_a_trusted_endpoint_workers_groups_round_trip_and_get_the_logprob_check(fleet):
    w = fleet.worker("trusted")
    w._check_trusted()  # would raise for an untrusted key
    assert w._ensure_policy(fleet.policy[1])  # downloaded, checked, and loaded into the server
    served = httpx.get(fleet.serve.url + "/v1/models").json()["data"][0]["root"]
    assert served == str((w.cache / "policies" / "v000001").resolve())
    lease = lease_of(w)
    sub = w.generate(lease)
    for g in sub["groups"]:
        assert g["engine"] == "openai" and g["dtype"] == "float32" and g["policy_version"] == 1
        assert all(s["proofs"] == [] for s in g["samples"])
    # Generated with the lease's seeds: swarmrl serve samples as the built-in engine does.
    model, tok = load_policy(fleet.run / "policies" / "v000001")
    p = lease["prompts"][0]
    local = build_engine(model.eval(), tok).generate(
        [p["prompt_ids"]] * len(p["seeds"]), p["seeds"], max_new_tokens=lease["max_new_tokens"]
    )
    assert [s["token_ids"] for s in sub["groups"][0]["samples"]] == [c.token_ids for c in local]
    result = w.client.submit(sub)
    assert result["rejected"] == [] and len(result["accepted"]) == len(lease["prompts"])
    assert all(a["validation"] == "pending" for a in result["accepted"])  # trusted_rate 1
    me = settled(w)
    assert me["trusted"] and me["proven"] and me["fraud"] == 0 and me["rejected"] == 0, me
    verdicts = fleet.verdicts(fleet.trusted_key)
    assert verdicts and all(v["ok"] and v["stats"]["chunks"] == 0 for v in verdicts)
    assert max(v["stats"]["logprob_err_max"] for v in verdicts) < 1e-3


def test_an_untrusted_key_without_proofs_is_refused(fleet):
    w = fleet.worker("stranger")
    with pytest.raises(EndpointError, match="not trusted by the orchestrator") as info:
        w._check_trusted()
    assert w.client.key_hex in str(info.value) and "trusted_keys_file" in str(info.value)
    # Sending anyway: every group is refused as fraud, with the reason and the fix.
    assert w._ensure_policy(fleet.policy[1])
    result = w.client.submit(w.generate(lease_of(w)))
    assert result["accepted"] == [] and {r["reason"] for r in result["rejected"]} == {"proofs_missing"}
    assert all("trusted_keys_file" in r["detail"] for r in result["rejected"])
    me = w.client.me()
    assert not me["trusted"] and me["fraud"] == len(result["rejected"])


def test_a_server_serving_another_version_fails_the_logprob_check(fleet):
    w = fleet.worker("trusted")
    assert w._ensure_policy(fleet.policy[1])
    # The server is put back on v0 behind the worker's back; its work still claims v1.
    reply = httpx.post(
        fleet.serve.url + "/v1/reload",
        json={"model_path": str(fleet.run / "policies" / "v000000")},
        headers={"authorization": "Bearer reload-secret"},
        timeout=60,
    )
    assert reply.status_code == 200
    before = len(fleet.verdicts(fleet.trusted_key))
    result = w.client.submit(w.generate(lease_of(w)))
    assert result["rejected"] == []  # the cheap checks cannot tell
    settled(w)
    failed = [v for v in fleet.verdicts(fleet.trusted_key)[before:] if not v["ok"]]
    assert failed and {v["reason"] for v in failed} == {"logprobs"}
    w.version = None  # load v1 into the server again for the tests that follow
    assert w._ensure_policy(fleet.policy[1])


def test_a_key_taken_off_the_trusted_file_must_prove_again(fleet):
    w = fleet.worker("trusted")
    assert w._ensure_policy(fleet.policy[1])
    lease = lease_of(w)
    original = fleet.keys_file.read_text()
    fleet.keys_file.write_text("# nobody\n")
    try:
        result = w.client.submit(w.generate(lease))
        assert {r["reason"] for r in result["rejected"]} == {"proofs_missing"} and result["accepted"] == []
        assert not w.client.me()["trusted"]
    finally:
        fleet.keys_file.write_text(original)
    assert w.client.me()["trusted"]


def test_trusted_keys_file_problems_fail_at_config_load(tmp_path):
    with pytest.raises(ConfigError, match=r"orchestrator\.trusted_keys_file.*cannot read"):
        load_config(None, ["--orchestrator.trusted_keys_file", str(tmp_path / "none.txt")])
    bad = tmp_path / "keys.txt"
    bad.write_text("# ok\n" + "ab" * 32 + "\nnot-a-key  # typo\n")
    with pytest.raises(ConfigError, match=r"orchestrator\.trusted_keys_file.*line 3: 'not-a-key'"):
        load_config(None, ["--orchestrator.trusted_keys_file", str(bad)])
    bad.write_text("AB" * 32 + "  # upper case is the same key\n")
    cfg = load_config(None, ["--orchestrator.trusted_keys_file", str(bad)])
    assert cfg.orchestrator.trusted_keys_file == str(bad)
