"""A run to attack: a real orchestrator process on 127.0.0.1 (in-process validator, validation
rate 1, no bans), two policy versions signed and served over HTTP by a real broadcast origin
(ShardServer): v0, and v1 = v0 after ten real AdamW steps; and an honest built-in worker whose
work shares the run with every cheat (tests/integration/test_validation.py, and through vLLM
tests/real/test_vllm_adversaries.py)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from swarmrl.adversary.workers import AdversarialWorker
from swarmrl.inference.worker import Worker
from swarmrl.model.checkpoint import load_policy, save_policy
from swarmrl.orchestrator.store import Db
from swarmrl.protocol.client import TrainerClient, Unavailable
from swarmrl.protocol.signing import public_key_hex
from swarmrl.transport.broadcast import ShardServer

from harness import run_store, wait_for
from orchestrator_harness import TRAINER_KEY, OrchestratorProcess, fit_worked_answers, make_run_dir, signed_version

SHARED = ("--validator.ban_after", "1000", "--async.max_pending_groups", "10000", "--sampling.prompts_per_step", "1000")


def train_a_little(src: Path, dst: Path, steps: int = 10, lr: float = 3e-3) -> None:
    """A later policy version: real AdamW steps of next-token loss on worked answers."""
    model, tok = load_policy(src)
    fit_worked_answers(model, tok, steps, lr)
    save_policy(model.eval(), tok, dst)


class World:
    def __init__(self, root: Path, *overrides: str, model: Path | None = None, before_start=None):
        """`model`: another v0 than the tiny policy (a Hugging Face folder), whose v1 is then the
        same weights (no training step on it). `before_start(v0_folder)`: called once the
        versions exist, before the orchestrator starts (to calibrate the run's limits on v0)."""
        self.root = root
        self.run = make_run_dir(root / "run", *SHARED, *overrides)
        policies = self.run / "policies"
        if model is None:
            train_a_little(policies / "v000000", policies / "v000001")
            folders = {v: policies / f"v{v:06d}" for v in (0, 1)}
        else:
            shutil.rmtree(policies / "v000000")
            shutil.copytree(model, policies / "v000000")
            folders = {0: policies / "v000000", 1: policies / "v000000"}
        manifests = {v: signed_version(self.run, v, folder) for v, folder in folders.items()}
        if before_start is not None:
            before_start(folders[0])
        self.server = ShardServer(self.run / "broadcast").start()
        self.orch = OrchestratorProcess(self.run).start()
        self.trainer = TrainerClient(self.orch.url, (self.run / "trainer.token").read_text().strip())
        self.policy = {}
        for v, manifest in manifests.items():
            self.trainer.publish(v, self.server.url, manifest)
            self.policy[v] = {"version": v, "url": self.server.url, "manifest": manifest}
        self.count = 0
        self.honest = self.worker("honest")

    def worker(self, name: str, kind: str | None = None, version: int = 1, **extra) -> Worker:
        self.count += 1
        d = self.root / "workers" / f"{name}-{self.count}"
        args = dict(
            key_file=d / "key.pem",
            cache_dir=d,
            name=name,
            log=lambda *_: None,
            trainer_key=public_key_hex(TRAINER_KEY),
            **extra,
        )
        w = AdversarialWorker(self.orch.url, kind=kind, **args) if kind else Worker(self.orch.url, **args)
        w.client.register(name)
        assert w._ensure_policy(self.policy[version])
        return w

    def close(self) -> None:
        self.orch.stop()
        self.server.close()

    @contextmanager
    def db(self) -> Iterator[Db]:
        """The orchestrator's store, read-only (rows are sqlite3.Row: by index or by name)."""
        with run_store(self.run) as store, store.read() as db:
            yield db


def lease_of(w: Worker) -> dict:
    lease = w.client.lease(w.version)["lease"]
    assert lease is not None
    return lease


def settled(w: Worker, timeout_s: float = 90.0) -> dict:
    """The worker's record once the validator has judged everything it submitted."""
    last: dict = {}

    def judged() -> dict | None:
        try:
            last["me"] = w.client.me()
        except Unavailable as e:  # asking too often (the key's rate limit): wait as told
            assert e.status == 429, e
            time.sleep(e.retry_after or 0.1)
            return None
        return last["me"] if last["me"]["awaiting_validation"] == 0 else None

    return wait_for(
        judged, timeout_s, "validation to finish", log=lambda: f"the worker's record: {last.get('me')}", every=0.1
    )


def honest_round(world: World) -> dict:
    result = world.honest.client.submit(world.honest.generate(lease_of(world.honest)))
    assert result["rejected"] == [] and len(result["accepted"]) == 2
    return result


def honest_clean(world: World) -> None:
    me = settled(world.honest)
    assert me["rejected"] == 0 and me["fraud"] == 0 and me["rejections"] == {} and not me["banned"], me
    assert me["accepted"] >= 2


def attack(world: World, kind: str) -> tuple[dict, dict]:
    """One lease of an adversary, submitted; (submit response, its record once judged)."""
    honest_round(world)  # honest work in flight in the same run, checked by the same validator
    adv = world.worker(f"adv-{kind}", kind)
    result = adv.client.submit(adv.generate(lease_of(adv)))
    record = settled(adv)
    honest_clean(world)
    return result, record
