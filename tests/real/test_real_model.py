"""The real pretrained checkpoint (SmolLM2-135M-Instruct de-quantised from Q4_1) through the
roles: the assets' manifest, the built-in engine's Llama path against transformers, eval and
serve with the model's own chat template and stop token, the trainer (full and LoRA), and one
short `swarmrl rl` through orchestrator, workers with proofs, validator and relay."""

from __future__ import annotations

import json
import time

import pytest
import torch

from swarmrl.eval.runner import chat_ids
from swarmrl.inference.batch import BatchEngine
from swarmrl.inference.engine import build_engine
from swarmrl.model.checkpoint import load_policy

from harness import store_rows
from runs import swarmrl
from serving import Server

pytestmark = pytest.mark.timeout(900)

QUESTION = "What is 6 + 3? Answer with only the number."


@pytest.fixture(scope="module")
def policy(real_model):
    torch.manual_seed(0)
    model, tokenizer = load_policy(real_model)
    return model.eval(), tokenizer


def test_the_assets_are_checked_and_not_prepared_twice(assets):
    started = time.monotonic()
    out = swarmrl("assets", "--cache", str(assets)).stdout
    assert "real assets are ready" in out, out  # the manifest matched: nothing was converted again
    assert time.monotonic() - started < 60
    manifest = json.loads((assets / "manifest.json").read_text())
    assert manifest["rows"] == {
        "gsm8k-test.jsonl": 1319,
        "aime2025.jsonl": 30,
        "humaneval.jsonl": 164,
        "ifbench-test.jsonl": 294,
        "ifbench-sample-output.jsonl": 294,
    }


def test_the_folder_is_the_pretrained_llama_with_its_chat_template(policy):
    model, tokenizer = policy
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert cfg.tie_word_embeddings and not hasattr(cfg, "quantization_config")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_the_built_in_engine_runs_the_real_llama_and_agrees_with_transformers(policy):
    """The proof-carrying engine on real weights: greedy tokens equal `model.generate`, and the
    seeded samples with hidden states equal the generic engine's (same rule, same weights)."""
    model, tokenizer = policy
    prompt = chat_ids(tokenizer, QUESTION)
    stop = [tokenizer.eos_token_id]
    builtin = build_engine(model, tokenizer, stop_token_ids=stop, max_batch=4)
    assert isinstance(builtin, BatchEngine)  # not a fallback
    hf = build_engine(model, tokenizer, stop_token_ids=stop, max_batch=4, kind="hf")
    greedy = builtin.generate([prompt], [0], max_new_tokens=12, temperature=0.0)[0]
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=stop, pad_token_id=stop[0]
        )[0, len(prompt) :].tolist()
    assert list(greedy.token_ids) == ref[: len(greedy.token_ids)]
    seeds = [11, 12, 13]
    a = builtin.generate([prompt] * 3, seeds, max_new_tokens=8, return_hidden=True)
    b = hf.generate([prompt] * 3, seeds, max_new_tokens=8, return_hidden=True)
    for x, y in zip(a, b):
        assert list(x.token_ids) == list(y.token_ids)
        assert torch.allclose(torch.as_tensor(x.logprobs), torch.as_tensor(y.logprobs), atol=1e-3)


def test_eval_on_gsm8k_aime_and_humaneval_with_the_models_template(real_model, real_data, tmp_path):
    names = ("gsm8k-test", "aime2025", "humaneval")
    out = tmp_path / "out"
    swarmrl(
        "eval", "--model", str(real_model), "--benchmark", ",".join(str(real_data / f"{n}.jsonl") for n in names),
        "--limit", "2", "--k", "1", "--max-tokens", "24", "--temperature", "0", "--output-dir", str(out),
    )  # fmt: skip
    for name in names:  # one process, the model loaded once
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["errors"] == 0 and summary["problems"] == 2, summary
        rows = [json.loads(line) for line in (out / name / "results.jsonl").read_text().splitlines()]
        assert all(r["completions"][0].strip() for r in rows)  # the model wrote something under its template


def test_serve_answers_with_the_models_template_and_stops_at_its_eos(real_model, policy, tmp_path):
    model, tokenizer = policy
    server = Server(real_model, tmp_path, "--batch-window-ms", "20")
    try:
        reply = server.client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0
        )
    finally:
        server.stop()
    choice = reply.choices[0]
    engine = build_engine(model, tokenizer, stop_token_ids=[tokenizer.eos_token_id], max_batch=1)
    local = engine.generate([chat_ids(tokenizer, QUESTION)], [0], max_new_tokens=24, temperature=0.0)[0]
    text = tokenizer.decode([t for t in local.token_ids if t != tokenizer.eos_token_id])
    assert choice.message.content == text
    assert choice.finish_reason == ("stop" if local.finish_reason == "stop" else "length")
    assert "<|im_end|>" not in choice.message.content


def test_a_short_lora_run_through_every_role(real_model, tmp_path):
    """Orchestrator, a relay, two workers with proofs, the in-process validator and a LoRA
    trainer on the real model: two steps, every group validated and none rejected."""
    run = tmp_path / "run"
    swarmrl(
        "rl", "--config", "configs/smollm2-135m.toml", "--model.path", str(real_model), "--run-dir", str(run),
        "--trainer.steps", "2", "--sampling.prompts_per_step", "2", "--sampling.group_size", "4",
        "--sampling.max_new_tokens", "12", "--sampling.worker_batch_prompts", "2", "--eval.every", "0",
        "--eval.samples", "1", "--tasks.eval_size", "4", "--logging.progress", "false",
        timeout=840,
    )  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2
    verdicts = [json.loads(v) for (v,) in store_rows(run, "SELECT verdict FROM groups WHERE verdict IS NOT NULL")]
    # Every group the workers made was proven and passed the full check on the real model.
    assert len(verdicts) >= 4 and all(v["ok"] and v["stats"]["chunks"] > 0 for v in verdicts), verdicts[:2]
    assert not store_rows(run, "SELECT COUNT(*) FROM groups WHERE state = 'rejected'")[0][0]
    assert store_rows(run, "SELECT SUM(fraud) FROM workers")[0][0] == 0
    # Versions after v0 are adapters of a few MB, carried by the relay to the workers.
    assert (run / "policies" / "v000001" / "adapter_model.safetensors").is_file()
    assert not (run / "policies" / "v000001" / "model.safetensors").exists()
    worker_log = (run / "logs" / "worker-0.log").read_text()
    assert "policy v1 loaded" in worker_log or "policy v2 loaded" in worker_log, worker_log[-2000:]
