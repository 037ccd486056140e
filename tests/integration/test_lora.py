"""LoRA (trainer.lora) with adapter-only policy versions, on real parts: peft adapters trained by
real steps, versions signed and sharded by the broadcast origin, fetched over HTTP on 127.0.0.1
by a real worker, which merges them into the base it holds and submits to a real orchestrator
whose validator re-runs the merged policy (TOPLOC, seeded sampling, logprobs).

Covers: a bad `trainer.lora.target_modules` fails before any process starts, naming the field;
adapter versions are over 10x smaller than full ones; a worker given only adapters produces work
the validator passes; a base other than the one the adapter's signed manifest names is refused;
the trainer trains adapters only and its checkpoints hold them and their optimizer state.
`swarmrl rl --trainer.lora.rank 8` end to end is in tests/e2e/test_rl_e2e.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from swarmrl.config import ConfigError, LoRAConfig, load_config
from swarmrl.inference.worker import Worker
from swarmrl.model.checkpoint import (
    build_tiny_policy,
    is_adapter,
    load_policy,
    save_policy,
)
from swarmrl.model.lora import (
    adapter_parameters,
    apply_lora,
    check_lora_config,
    save_adapter,
)
from swarmrl.protocol.client import TrainerClient
from swarmrl.protocol.manifest import content_digest
from swarmrl.protocol.signing import public_key_hex
from swarmrl.trainer.checkpoint import load_checkpoint, save_checkpoint
from swarmrl.trainer.grpo import GRPOTrainer
from swarmrl.transport.broadcast import (
    BroadcastError,
    ShardRequestHandler,
    ShardServer,
    fetch_base,
    publish_version,
)
from swarmrl.validator.core import Validator

from harness import judged, verdicts
from orchestrator_harness import (
    TRAINER_KEY,
    OrchestratorProcess,
    closed_clean,
    fit_worked_answers,
    make_run_dir,
    signed_version,
)

pytestmark = pytest.mark.timeout(300)

ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]


def train_adapter(base: Path, out: Path, steps: int = 8, lr: float = 3e-3, rank: int = 8):
    """A later policy version of a LoRA run: real AdamW steps on the adapters (next-token loss on
    worked answers), saved adapter-only. Returns the peft model (the trainer's view of it)."""
    model, tok = load_policy(base)
    model = apply_lora(model, LoRAConfig(rank=rank))
    fit_worked_answers(model, tok, steps, lr)
    save_adapter(model, out)
    return model.eval()


# ---- config -------------------------------------------------------------------------------------


def test_missing_target_modules_fail_before_anything_starts(tmp_path):
    cfg = load_config(None, ["--trainer.lora.rank", "8", "--trainer.lora.target_modules", "q_proj,c_attn"])
    with pytest.raises(
        ValueError,
        match=r"trainer\.lora\.target_modules: the built-in tiny Qwen2 has no linear "
        r"layer named 'c_attn'.*down_proj",
    ):
        check_lora_config(cfg)
    check_lora_config(load_config(None, ["--trainer.lora.rank", "8"]))  # the defaults fit the built-in model
    check_lora_config(load_config(None, ["--trainer.lora.target_modules", "c_attn"]))  # rank 0: LoRA is off

    # model.path: the folder's architecture (config.json only: nothing is loaded), here GPT-2's names.
    from transformers import GPT2Config

    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300).save_pretrained(gpt2)
    with pytest.raises(
        ValueError,
        match=r"trainer\.lora\.target_modules: model\.path .* has no linear layer named "
        r"'q_proj', .*its linear layers are c_attn, c_fc, c_proj, lm_head",
    ):
        check_lora_config(load_config(None, ["--trainer.lora.rank", "8", "--model.path", str(gpt2)]))

    # `swarmrl rl` stops on it before building a base or starting a child process.
    from runs import swarmrl

    run = tmp_path / "run"
    proc = swarmrl(
        "rl",
        "--run-dir",
        str(run),
        "--trainer.lora.rank",
        "8",
        "--trainer.lora.target_modules",
        "qkv",
        "--logging.progress",
        "false",
        check=False,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "trainer.lora.target_modules" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert not (run / "policies" / "v000000").exists() and not list(run.glob("logs/*.log"))

    # One trainer rank only, said at config load.
    with pytest.raises(ConfigError, match=r"trainer\.lora\.rank=8 needs a single trainer rank"):
        load_config(None, ["--trainer.lora.rank", "8", "--trainer.nproc", "2"])


# ---- size ---------------------------------------------------------------------------------------


def test_adapter_versions_are_over_10x_smaller_than_full_ones(tmp_path):
    model, tok = build_tiny_policy(seed=0)  # the shape of the built-in base, the default task's model
    save_policy(model, tok, tmp_path / "policies" / "v000000")
    peft_model = apply_lora(model, LoRAConfig(rank=8))
    save_adapter(peft_model, tmp_path / "policies" / "v000001")
    assert sorted(p.name for p in (tmp_path / "policies" / "v000001").iterdir()) == ADAPTER_FILES
    full = publish_version(tmp_path / "policies" / "v000000", tmp_path / "broadcast", 0, key=TRAINER_KEY)
    adapter = publish_version(
        tmp_path / "policies" / "v000001",
        tmp_path / "broadcast",
        1,
        key=TRAINER_KEY,
        parent=0,
        base={"version": 0, "digest": content_digest(full)},
    )
    ratio = full["total_size"] / adapter["total_size"]
    print(f"full {full['total_size']} bytes, adapter {adapter['total_size']} bytes: {ratio:.1f}x")
    assert ratio >= 10, (full["total_size"], adapter["total_size"])
    assert adapter["base"] == {"version": 0, "digest": content_digest(full)}

    # The same count on real shapes, from their configs on the meta device (no weights): rank 8 on
    # every projection is ~1% of a 0.5B Qwen2 and ~0.2% of a 32B one.
    from transformers import AutoModelForCausalLM, Qwen2Config

    names = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    for sizes, vocab_size, at_least in (
        ((896, 4864, 24, 14, 2), 151936, 100),  # Qwen2.5-0.5B
        ((5120, 27648, 64, 40, 8), 152064, 400),  # Qwen2.5-32B
    ):
        shape = dict(zip(names, sizes, strict=True), vocab_size=vocab_size)
        with torch.device("meta"):
            tied = shape["hidden_size"] < 1000  # 0.5B ties its embeddings, 32B does not
            big = AutoModelForCausalLM.from_config(Qwen2Config(**shape, tie_word_embeddings=tied))
        total = sum(p.numel() for p in big.parameters())
        lora = adapter_parameters(big, LoRAConfig(rank=8))
        assert total / lora >= at_least, (total, lora)


def test_relays_keep_the_base_their_adapters_name(tmp_path):
    from swarmrl.transport.relay import Relay

    model, tok = build_tiny_policy(seed=0, hidden_size=32, num_layers=1, intermediate_size=64)
    save_policy(model, tok, tmp_path / "v000000")
    save_adapter(apply_lora(model, LoRAConfig(rank=2)), tmp_path / "adapter")
    root = tmp_path / "broadcast"
    base = {"version": 0, "digest": content_digest(publish_version(tmp_path / "v000000", root, 0, key=TRAINER_KEY))}
    for v in (1, 2, 3):
        publish_version(tmp_path / "adapter", root, v, key=TRAINER_KEY, parent=v - 1, base=base)
    with ShardServer(root) as origin:
        relay = Relay(
            [origin.url], tmp_path / "relay", public_key=public_key_hex(TRAINER_KEY), keep=1, log=lambda *_: None
        )
        try:
            relay.sync_once()
            relay.sync_once()  # and pruning keeps it
        finally:
            relay.server.close()
    assert sorted(p.name for p in (tmp_path / "relay").iterdir() if not p.name.startswith(".")) == [
        "v000000",
        "v000003",
    ]


# ---- a worker given only adapters, and the validator ---------------------------------------------


class Logged(ShardRequestHandler):
    paths: list[str] = []

    def do_GET(self):
        Logged.paths.append(self.path)
        super().do_GET()


class LoggingServer(ShardServer):
    handler_class = Logged


class World:
    def __init__(self, root: Path):
        self.run = make_run_dir(
            root / "run",
            "--validator.ban_after",
            "1000",
            "--async.max_pending_groups",
            "10000",
            "--sampling.prompts_per_step",
            "1000",
            "--trainer.lora.rank",
            "8",
        )
        policies = self.run / "policies"
        self.peft_model = train_adapter(policies / "v000000", policies / "v000001")
        m0 = signed_version(self.run, 0)
        self.base = {"version": 0, "digest": content_digest(m0)}
        m1 = publish_version(policies / "v000001", self.run / "broadcast", 1, key=TRAINER_KEY, parent=0, base=self.base)
        self.server = LoggingServer(self.run / "broadcast").start()
        self.orch = OrchestratorProcess(self.run).start()
        self.trainer = TrainerClient(self.orch.url, (self.run / "trainer.token").read_text().strip())
        self.policy = {}
        for v, manifest in ((0, m0), (1, m1)):
            self.trainer.publish(v, self.server.url, manifest)
            self.policy[v] = {"version": v, "url": self.server.url, "manifest": manifest}
        self.logs: list[str] = []

    def worker(self, name: str) -> Worker:
        d = self.run.parent / "workers" / name
        w = Worker(
            self.orch.url,
            key_file=d / "key.pem",
            cache_dir=d,
            name=name,
            log=self.logs.append,
            trainer_key=public_key_hex(TRAINER_KEY),
        )
        w.client.register(name)
        return w

    def close(self) -> None:
        self.orch.stop()
        self.server.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    yield from closed_clean(World(tmp_path_factory.mktemp("lora")))


def test_a_worker_given_only_adapters_produces_work_the_validator_passes(world):
    w = world.worker("honest")
    assert w._ensure_policy(world.policy[0])  # the base, once, as every worker starts
    Logged.paths.clear()
    assert w._ensure_policy(world.policy[1]), world.logs
    # Only the adapter crossed the network: its shards and nothing of the base's.
    shards = [p for p in Logged.paths if "/shards/" in p]
    assert shards and all(p.startswith("/v000001/") for p in shards), Logged.paths
    cache = w.cache / "policies"
    assert sorted(p.name for p in (cache / "v000001").iterdir() if not p.name.startswith(".")) == ADAPTER_FILES
    assert is_adapter(cache / "v000001") and (cache / "v000000" / "model.safetensors").is_file()

    # The worker samples with plain merged weights that compute what the trainer trained.
    merged = w.sampler.model
    assert not any("lora" in name for name, _ in merged.named_parameters())
    base, _ = load_policy(world.run / "policies" / "v000000")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (merged.state_dict()[q] - base.state_dict()[q]).abs().max() > 1e-4  # the adapter is in it
    ids = torch.tensor([list(range(5, 40))])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=ids).logits, world.peft_model(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )

    # Real leases, real sampling with proofs; the validator (in the orchestrator) fetches the same
    # adapter and base and re-runs the merged policy: every group passes the full check.
    for _ in range(2):
        lease = w.client.lease(1)["lease"]
        assert lease is not None
        result = w.client.submit(w.generate(lease))
        assert result["rejected"] == [] and len(result["accepted"]) == 2, result
    me = judged(w.client, 120)
    assert me["accepted"] >= 4 and me["rejected"] == 0 and me["fraud"] == 0 and not me["banned"], me
    judgements = verdicts(world.run)
    assert len(judgements) >= 4 and all(v["reason"] is None for v in judgements), judgements
    assert all(v["stats"]["chunks"] > 0 for v in judgements)  # TOPLOC proofs were compared


def test_a_base_other_than_the_signed_one_is_refused(world, tmp_path):
    key = public_key_hex(TRAINER_KEY)
    sources = [world.server.url]
    policies = world.run / "policies"
    # The trainer's own signature over an adapter naming another base (a stale cache, a mixed-up
    # run): workers and validators refuse to merge it into the v0 they can get.
    wrong = publish_version(
        policies / "v000001",
        world.run / "broadcast",
        2,
        key=TRAINER_KEY,
        parent=1,
        base={"version": 0, "digest": "ab" * 32},
    )
    with pytest.raises(BroadcastError, match="refusing to merge the adapter"):
        fetch_base(wrong, sources, tmp_path / "cache", public_key=key)
    w = world.worker("fooled")
    world.logs.clear()
    assert not w._ensure_policy({"version": 2, "url": world.server.url, "manifest": wrong})
    assert any("refusing to merge the adapter" in line for line in world.logs), world.logs
    cfg = load_config(world.run / "config.toml")
    with pytest.raises(BroadcastError, match="refusing to merge the adapter"):
        Validator(cfg.validator, tmp_path / "validator", log=lambda *_: None).model(
            2, {"version": 2, "url": world.server.url, "manifest": wrong}
        )

    # A relay that rewrites the base an adapter names breaks the trainer's signature.
    forged = copy.deepcopy(world.policy[1]["manifest"])
    forged["base"]["digest"] = "cd" * 32
    with pytest.raises(BroadcastError, match="bad signature"):
        fetch_base(forged, sources, tmp_path / "cache", public_key=key)
    # A full version names no base.
    assert fetch_base(world.policy[0]["manifest"], sources, tmp_path / "cache", public_key=key) is None


def test_run_dir_adapters_load_with_their_base_beside_them(world, tmp_path):
    """`swarmrl eval`, `swarmrl serve` and the trainer's evaluation load a run's policies/vN;
    an adapter there is merged with policies/v000000, and without it the error says what to do."""
    model, tok = load_policy(world.run / "policies" / "v000001")
    assert type(model).__name__ == "Qwen2ForCausalLM" and tok.eos_token_id is not None
    lonely = tmp_path / "v000001"
    lonely.mkdir()
    for name in ADAPTER_FILES:
        (lonely / name).write_bytes((world.run / "policies" / "v000001" / name).read_bytes())
    with pytest.raises(FileNotFoundError, match="needs its base model, policy version 0"):
        load_policy(lonely)


def test_limits_measured_on_an_adapter_version_are_what_its_run_takes(tmp_path):
    """The drift watch asks for limits measured near the current version; in a LoRA run that is an
    adapter: `calibrate` merges it as workers and validators do (in the run's dtype, not the
    float32 merge rounded), stamps the version and its base, and the run whose policies/ hold that
    adapter takes the file (another run, or none, does not)."""
    import torch

    from swarmrl.orchestrator.limits_reload import published_by
    from swarmrl.proofs.limits import LimitsError, model_digest, run_limits
    from swarmrl.validator.calibrate import Calibration, calibrate

    model, tok = build_tiny_policy(seed=0)
    base, adapter = tmp_path / "run" / "policies" / "v000000", tmp_path / "run" / "policies" / "v000004"
    save_policy(model, tok, base)
    train_adapter(base, adapter, steps=4, lr=1e-2)
    prompts = [f"What is {a} + {a + 1}?" for a in range(32)]
    cal = Calibration(str(adapter), prompts, dtype="bfloat16", group_size=2, max_new_tokens=8, temperature=1.0,
                      batch_groups=4, seed=0, work_dir=tmp_path / "work")  # fmt: skip
    merged_in_bf16 = load_policy(adapter, dtype=torch.bfloat16)[0].state_dict()
    rounded = {k: v.to(torch.bfloat16) for k, v in cal.full.state_dict().items()}
    assert all(torch.equal(v, merged_in_bf16[k]) for k, v in cal.model.state_dict().items())
    assert any(not torch.equal(v, rounded[k]) for k, v in merged_in_bf16.items())  # the difference is real
    data = calibrate(str(adapter), prompts, dtype="bfloat16", engines=["builtin"], groups=16, cheat_groups=4,
                     group_size=2, max_new_tokens=8, cheats=("int4_per_32",), work_dir=tmp_path / "work",
                     log=lambda *_: None)  # fmt: skip
    assert data["model"] | {"folder": None} == {
        "digest": model_digest(adapter),
        "folder": None,
        "layers": model.config.num_hidden_layers,
        "version": 4,
        "base_digest": model_digest(base),
    }
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps(data))
    cfg = load_config(None, ["--sampling.dtype", "bfloat16", "--model.path", str(base),
                             "--sampling.group_size", "2", "--sampling.max_new_tokens", "8",
                             "--sampling.temperature", "1.0", "--validator.limits_file", str(limits)])  # fmt: skip
    assert run_limits(cfg, base, tmp_path / "run", published_by(tmp_path / "run"))["model"]["version"] == 4
    with pytest.raises(LimitsError, match="another model"):
        run_limits(cfg, base)


# ---- the trainer --------------------------------------------------------------------------------


def test_the_trainer_trains_adapters_only_and_checkpoints_them(tmp_path):
    from tiny_trainer import make_model, prepare

    cfg, model, _, _, batch = prepare("--trainer.lora.rank", "4", "--trainer.lr", "1e-2")
    n_base = len(list(model.parameters()))
    trainer = GRPOTrainer(model, cfg)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(trainable)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    assert len(frozen) == n_base  # every weight of the base, none trainable
    trainer.train_step(batch)
    for n, p in trainer.model.named_parameters():
        if p.requires_grad:
            assert n.endswith("lora_A.default.weight") or p.abs().max() > 0, n  # B moved off its zero init
        else:
            torch.testing.assert_close(p, frozen[n], rtol=0, atol=0)  # the base is frozen: bitwise the same

    save_checkpoint(trainer, tmp_path, 1, {})
    state = torch.load(tmp_path / "step_000001" / "trainer.pt", weights_only=False)
    assert len(state["model"]) == len(trainable)  # adapters only: the base is policy version 0
    m2 = trainer.train_step(batch)
    expected = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    fresh = GRPOTrainer(make_model(seed=0)[0], cfg)
    load_checkpoint(fresh, tmp_path)
    assert fresh.train_step(batch) == m2
    for n, p in fresh.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p, expected[n], rtol=0, atol=0)

    # A checkpoint of other adapters (here on fewer modules) is refused, not half loaded.
    other = prepare("--trainer.lora.rank", "4", "--trainer.lora.target_modules", "q_proj,v_proj")[0]
    with pytest.raises(ValueError, match="does not match this trainer's LoRA adapters"):
        load_checkpoint(GRPOTrainer(make_model(seed=0)[0], other), tmp_path)
