"""Precision is a run setting (`sampling.dtype`): leases carry it, workers sample in it (or
stop, if pinned to another), the validator prefills in it and judges with that dtype's
thresholds (docs/validation.md, "bfloat16 runs").

In-process checks use the real sampler and the validator's own code on the tiny policy; the
last two tests run a real orchestrator whose run samples in bfloat16.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from swarmrl.adversary.workers import quantised
from swarmrl.config import ValidatorConfig
from swarmrl.inference.sampler import Sampler
from swarmrl.inference.worker import Worker, WrongPrecision
from swarmrl.model.checkpoint import build_tiny_policy
from swarmrl.proofs.toploc import build_proofs_many, encode
from swarmrl.protocol.client import TrainerClient
from swarmrl.protocol.messages import ClaimedGroup, ClaimedSample
from swarmrl.protocol.signing import public_key_hex
from swarmrl.tasks import arithmetic
from swarmrl.tasks.source import model_input
from swarmrl.transport.broadcast import ShardServer
from swarmrl.validator.core import Validator

from harness import judged
from orchestrator_harness import TRAINER_KEY, OrchestratorProcess, make_run_dir, signed_version
from runs import swarmrl

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

G = 8  # completions per group, as in the default run


@pytest.fixture(scope="module")
def policy():
    model, tok = build_tiny_policy(seed=0)
    return model.eval(), tok


def sampled_groups(model, tok, n_groups: int, seed: int) -> list[ClaimedGroup]:
    """Groups as a worker running `model` submits them (seeded sampler, its own proofs), as
    validator items."""
    rng = random.Random(seed)
    rows = arithmetic.generate(40, digits=2, ops="+-", split="train", seed=0)
    prompts = [model_input(tok, rows[rng.randrange(len(rows))]["prompt"], None)[1] for _ in range(n_groups)]
    flat = [p for p in prompts for _ in range(G)]
    seeds = [rng.getrandbits(63) for _ in flat]
    sampler = Sampler(model, stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    outs = sampler.generate(flat, seeds, max_new_tokens=64, temperature=1.0, return_hidden=True)
    proofs = build_proofs_many([o.hidden for o in outs], chunk_size=32, topk=128)
    return [
        ClaimedGroup(
            id=i,
            worker="w",
            policy_version=0,
            temperature=1.0,
            prompt_ids=prompts[i],
            samples=[
                ClaimedSample(
                    token_ids=outs[j].token_ids, logprobs=outs[j].logprobs, seed=seeds[j], proofs=encode(proofs[j])
                )
                for j in range(i * G, (i + 1) * G)
            ],
        )
        for i in range(n_groups)
    ]


def verdicts(model, items: list[ClaimedGroup], dtype: str) -> list:
    """What the validator decides for these groups, prefilling with `model` and judging with the
    thresholds of a run in `dtype`."""
    v = Validator(ValidatorConfig(), "/nonexistent")
    outs = v.prefill(model, [(it.prompt_ids, [s.token_ids for s in it.samples]) for it in items])
    samples = [s for it in items for s in it.samples]
    reports = v.reports([o for res in outs for o in res], samples, [1.0] * len(samples))
    return [v.judge(it, reports[i * G : (i + 1) * G], dtype) for i, it in enumerate(items)]


# ---- the checks, in process -----------------------------------------------------------------------
def test_honest_bf16_work_passes_a_bf16_validator_and_failed_a_float32_one(policy):
    model, tok = policy
    bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()
    items = sampled_groups(bf16, tok, 8, seed=1)
    judged = verdicts(bf16, items, "bfloat16")
    assert all(v.ok for v in judged), [(v.reason, v.detail) for v in judged if not v.ok]
    for v in judged:  # well inside the bf16 limits (docs/validation.md)
        assert v.stats["mant_err_group"] < 0.45 and v.stats["mant_err_median_max"] <= 1, v.stats
    # Before runs declared their precision, a float32 validator judged it: every group failed
    # TOPLOC (bf16 rounding of the hidden states is far above float32's limits).
    before = verdicts(model, items, "float32")
    assert [v.reason for v in before] == ["toploc"] * len(items)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantised_policy_is_refused_in_a_bf16_run(policy, bits):
    model, tok = policy
    bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()
    cheap = quantised(model, bits).to(torch.bfloat16)
    judged = verdicts(bf16, sampled_groups(cheap, tok, 4, seed=2), "bfloat16")
    assert [v.reason for v in judged] == ["toploc"] * 4, [v.stats for v in judged]
    if bits == 8:  # int8 is caught by the group's typical chunk, not by any single one
        assert all("median over the group" in v.detail for v in judged)


def test_thresholds_follow_the_run_dtype():
    cfg = ValidatorConfig()
    assert cfg.limits("float32")["logprob_tol"] == cfg.logprob_tol
    assert cfg.limits("bfloat16")["logprob_tol"] == cfg.bf16_logprob_tol > cfg.logprob_tol
    assert cfg.limits("bfloat16")["group_mant_err_max"] == cfg.bf16_group_mant_err_max


def test_a_declared_engine_selects_no_looser_limit_without_a_calibration(policy):
    """Issue 49: a worker's declaration buys nothing. int8 weights declaring vllm get exactly the
    verdicts they get declaring builtin (they once got vLLM's looser 0.8 group limit)."""
    model, tok = policy
    bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()
    cheat = sampled_groups(quantised(model, 8).to(torch.bfloat16), tok, 4, seed=2)
    as_builtin = verdicts(bf16, cheat, "bfloat16")
    as_vllm = verdicts(bf16, [it.model_copy(update={"engine": "vllm"}) for it in cheat], "bfloat16")
    assert [(v.ok, v.reason, v.detail) for v in as_vllm] == [(v.ok, v.reason, v.detail) for v in as_builtin]
    assert not any(v.ok for v in as_vllm), [v.stats["mant_err_group"] for v in as_vllm]


# ---- a real bf16 run ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16run")
    run = make_run_dir(
        root / "run",
        "--sampling.dtype",
        "bfloat16",
        "--validator.ban_after",
        "1000",
        "--sampling.prompts_per_step",
        "1000",
    )
    manifest = signed_version(run, 0)
    server = ShardServer(run / "broadcast").start()
    orch = OrchestratorProcess(run).start()
    TrainerClient(orch.url, (run / "trainer.token").read_text().strip()).publish(0, server.url, manifest)
    yield root, orch, {"version": 0, "url": server.url, "manifest": manifest}
    orch.stop()
    server.close()
    assert "internal error" not in orch.log()


def worker(root, orch, name: str, policy: dict, **kw) -> Worker:
    d = root / "workers" / name
    w = Worker(
        orch.url,
        key_file=d / "key.pem",
        cache_dir=d,
        name=name,
        log=lambda *_: None,
        trainer_key=public_key_hex(TRAINER_KEY),
        **kw,
    )
    w.client.register(name)
    assert w._ensure_policy(policy)
    return w


def settled(w: Worker, timeout_s: float = 60.0) -> dict:
    return judged(w.client, timeout_s)


def test_workers_follow_the_run_and_the_validator_judges_in_bf16(bf16_run):
    root, orch, policy = bf16_run
    honest = worker(root, orch, "honest", policy)  # no --dtype: loads float32, then follows the lease
    assert honest.dtype == "float32"
    lease = honest.client.lease(0)["lease"]
    assert lease["dtype"] == "bfloat16"
    result = honest.client.submit(honest.generate(lease))
    assert honest.dtype == "bfloat16" and next(honest.sampler.model.parameters()).dtype == torch.bfloat16
    assert result["rejected"] == [] and len(result["accepted"]) == 2
    me = settled(honest)
    assert me["rejected"] == 0 and me["fraud"] == 0 and me["accepted"] == 2, me

    # A quantised model in the same run: refused by the in-process validator, in bf16.
    cheat = worker(root, orch, "int4", policy, dtype="bfloat16")
    cheat.sampler.model = quantised(cheat.sampler.model.float(), 4).to(torch.bfloat16)
    assert cheat.client.submit(cheat.generate(cheat.client.lease(0)["lease"]))["rejected"] == []
    assert settled(cheat)["rejections"] == {"toploc": 2}

    # A worker pinned to float32 refuses the lease instead of producing work that would fail.
    pinned = worker(root, orch, "pinned", policy, dtype="float32")
    with pytest.raises(WrongPrecision, match="restart without --dtype, or with --dtype bfloat16"):
        pinned.generate(pinned.client.lease(0)["lease"])


def test_the_worker_cli_pinned_to_float32_stops_with_a_message(bf16_run):
    root, orch, _ = bf16_run
    d = root / "workers" / "cli"
    home = ("--key-file", str(d / "key.pem"), "--cache-dir", str(d))
    pinned = ("--dtype", "float32", "--trainer-key", public_key_hex(TRAINER_KEY), "--threads", "1")
    proc = swarmrl("worker", "--orchestrator", orch.url, *home, *pinned, timeout=120, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "this run samples in bfloat16 (the lease says so) but this worker was started with --dtype float32: "
        "restart without --dtype, or with --dtype bfloat16"
    ) in proc.stderr
