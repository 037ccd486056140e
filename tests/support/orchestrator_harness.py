"""Helpers for tests that run a real orchestrator process on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarmrl.config import load_config
from swarmrl.model.checkpoint import build_tiny_policy, save_policy
from swarmrl.protocol.client import TrainerClient, WorkerClient
from swarmrl.tasks import arithmetic
from swarmrl.transport.broadcast import publish_version

from harness import free_port, read_url_file, wait_for
from runs import TINY_GROUPS

TRAINER_KEY = Ed25519PrivateKey.generate()  # signs the versions tests publish

# runs.TINY_GROUPS, with one optimizer step a batch and leases that outlast a slow test's pauses.
SMALL = [*TINY_GROUPS, "--trainer.optimizer_steps", "1", "--orchestrator.lease_timeout_s", "30"]


def make_run_dir(root: Path, *overrides: str) -> Path:
    """A run directory as `swarmrl rl` prepares it: config.toml and an (untrained) policy v0."""
    cfg = load_config(None, [*SMALL, *overrides])
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.toml").write_text(cfg.model_copy(update={"run_dir": str(root)}).to_toml())
    model, tok = build_tiny_policy(seed=0)
    save_policy(model, tok, root / "policies" / "v000000")
    return root


def signed_version(run_dir: Path, version: int, policy_dir: Path | None = None) -> dict:
    """Publish a policy folder (default: the run's v0 weights) as broadcast version `version`,
    signed by TRAINER_KEY, the way the trainer does; returns the manifest to announce."""
    folder = policy_dir or run_dir / "policies" / "v000000"
    return publish_version(
        folder, run_dir / "broadcast", version, key=TRAINER_KEY, parent=version - 1 if version else None
    )


class OrchestratorProcess:
    def __init__(self, run_dir: Path, port: int | None = None):
        self.run_dir, self.port = run_dir, port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> OrchestratorProcess:
        info = self.run_dir / "orchestrator.json"
        info.unlink(missing_ok=True)
        log = open(self.run_dir / "orchestrator.log", "ab")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "swarmrl.cli",
                "orchestrator",
                "--run-dir",
                str(self.run_dir),
                "--port",
                str(self.port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            url = wait_for(lambda: read_url_file(info), timeout_s, "orchestrator.json", proc=self.proc, log=self.log)
        except AssertionError as e:
            raise RuntimeError(f"orchestrator did not start: {e}") from None
        assert url == self.url
        return self

    def trainer(self) -> TrainerClient:
        """A client holding the run's trainer token, as the trainer does."""
        return TrainerClient(self.url, (self.run_dir / "trainer.token").read_text().strip())

    def publish_v0(self) -> TrainerClient:
        """Publish the run's signed v0, as its trainer would, at an address nothing serves (the
        tests that use it never download weights); the trainer's client, to publish more."""
        trainer = self.trainer()
        trainer.publish(0, "http://127.0.0.1:9", signed_version(self.run_dir, 0))
        return trainer

    def new_worker(self, name: str) -> WorkerClient:
        """A worker with a key of its own, registered as `name`."""
        worker = WorkerClient(self.url, Ed25519PrivateKey.generate())
        worker.register(name)
        return worker

    def log(self) -> str:
        return (self.run_dir / "orchestrator.log").read_text(errors="replace")

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the verifier pool too
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def closed_clean(world):
    """A module fixture's body for a world of processes around an orchestrator (`world.orch`): it
    is yielded, closed after the module's tests, and its orchestrator's log holds no internal error."""
    yield world
    world.close()
    assert "internal error" not in world.orch.log()


def answers(cfg_overrides=()) -> dict[str, str]:
    """problem_id -> correct answer for the SMALL task set."""
    cfg = load_config(None, [*SMALL, *cfg_overrides])
    rows = arithmetic.generate(
        cfg.tasks.train_size, digits=cfg.tasks.digits, ops=cfg.tasks.ops, split="train", seed=cfg.tasks.seed
    )
    return {r["problem_id"]: json.loads(r["verification_info"])["ground_truth"] for r in rows}


_MODELS: dict = {}


def honest_proofs(
    policy_dir: Path, prompt_ids: list[int], token_ids: list[int], *, chunk_size: int = 32, topk: int = 128
) -> list[str]:
    """The TOPLOC proofs an honest worker running this policy would send for these tokens, built
    from a real prefill (hand-written completions are not sampled, but their proofs are real)."""
    from swarmrl.model.checkpoint import load_policy
    from swarmrl.proofs.toploc import build_proofs, encode
    from swarmrl.validator.core import prefill

    key = str(policy_dir)
    if key not in _MODELS:
        _MODELS[key] = load_policy(policy_dir)[0].eval()
    ((hidden, _),) = prefill(_MODELS[key], [(prompt_ids, [token_ids])])[0]
    return encode(build_proofs(hidden, chunk_size=chunk_size, topk=topk))


def completion_ids(tokenizer, answer: str) -> list[int]:
    return tokenizer(f"<think>ok</think>\\boxed{{{answer}}}<|im_end|>", add_special_tokens=False)["input_ids"]


def fit_worked_answers(model, tok, steps: int, lr: float) -> None:
    """`steps` real AdamW steps of next-token loss on 16 worked answers, on the parameters of
    `model` that require grad (all of them, or a LoRA run's adapters): a later policy version."""
    import torch

    from swarmrl.tasks.source import model_input

    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    texts = []
    for pid, answer in list(answers().items())[:16]:
        _, prompt = model_input(tok, f"What is {pid}?", None)
        texts.append(prompt + completion_ids(tok, answer))
    width = max(len(t) for t in texts)
    ids = torch.tensor([t + [tok.pad_token_id] * (width - len(t)) for t in texts])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in texts])
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
