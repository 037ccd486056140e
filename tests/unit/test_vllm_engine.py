"""What of the proving vLLM engine runs without vLLM (swarmrl/inference/vllm_engine.py): the CPU
lists vLLM pins its threads to, the weights an in-place reload is given, the launcher's split of
cores between vLLM workers. vLLM itself is driven in tests/real/test_vllm_proofs.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from swarmrl.inference.vllm_engine import checkpoint_weights, cpu_list, max_positions
from swarmrl.launch.plan import vllm_cpus


@pytest.mark.parametrize(
    ("cpus", "text"),
    [([0], "0"), ([0, 1], "0-1"), ([3, 0, 1, 2], "0-3"), ([0, 2, 3, 7], "0,2-3,7"), ([5, 5, 6], "5-6")],
)
def test_cpu_lists_are_ranges_joined_by_commas(cpus, text):
    assert cpu_list(cpus) == text


def test_an_empty_cpu_list_is_refused():
    with pytest.raises(ValueError, match="no CPU ids"):
        cpu_list([])


@pytest.mark.parametrize(
    ("index", "threads", "cpus", "expected"),
    [
        (0, 1, [0, 1], [0]),
        (1, 1, [0, 1], [1]),
        (2, 1, [0, 1], [0]),  # more workers than cores: they share, round robin
        (1, 2, [0, 1, 2, 3], [2, 3]),
        (1, 2, [0, 1, 2], [2, 0]),
        (0, 4, [0, 1], [0, 1]),  # more threads than cores: all of them
        (1, 1, [4, 6], [6]),  # the ids of the process's CPU set, not 0..n-1
    ],
)
def test_each_vllm_worker_gets_its_own_block_of_cores(index, threads, cpus, expected):
    assert vllm_cpus(index, threads, cpus) == expected


def test_a_tied_head_is_given_to_the_reload_as_lm_head(tmp_path):
    emb = torch.arange(6.0).reshape(3, 2)
    save_file(
        {"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(2)}, str(tmp_path / "model.safetensors")
    )
    weights = dict(checkpoint_weights(tmp_path))
    assert set(weights) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert torch.equal(weights["lm_head.weight"], emb)


def test_an_untied_head_is_given_as_stored(tmp_path):
    save_file({"model.embed_tokens.weight": torch.zeros(3, 2)}, str(tmp_path / "a.safetensors"))
    save_file({"lm_head.weight": torch.ones(3, 2)}, str(tmp_path / "b.safetensors"))
    weights = dict(checkpoint_weights(tmp_path))
    assert torch.equal(weights["lm_head.weight"], torch.ones(3, 2))  # not replaced by the embedding
    assert len(weights) == 2


def test_a_folder_without_weights_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        list(checkpoint_weights(tmp_path))


def test_max_positions_come_from_the_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert max_positions(tmp_path) == 512
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="--vllm-max-model-len"):
        max_positions(tmp_path)


def test_a_vllm_without_the_hooked_attributes_is_refused_with_the_fallback():
    """Another vLLM release that moved what the hooks use must stop the worker, naming the trusted
    fallback, never let it submit unproven work."""
    from types import SimpleNamespace

    from swarmrl.inference.vllm_engine import VllmUnavailable, _install, _Recorder

    runner = SimpleNamespace(model=SimpleNamespace(compute_logits=lambda h: h), sampler=object(), requests={})
    with pytest.raises(VllmUnavailable, match="model_runner.input_batch.*--engine openai"):
        _install(SimpleNamespace(model_runner=runner), _Recorder())
    with pytest.raises(VllmUnavailable, match="worker.model_runner"):
        _install(SimpleNamespace(), _Recorder())


@pytest.mark.parametrize("engine", ["builtin", "vllm"])
def test_adversaries_start_on_the_engine_the_config_names(engine, monkeypatch, tmp_path):
    """`async.adversary_engine vllm`: each adversary is a proving vLLM worker on vLLM's python,
    pinned after the honest vLLM workers' cores; "builtin" starts them as before."""
    from swarmrl.config import load_config
    from swarmrl.launch.plan import children

    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1, 2, 3})
    cfg = load_config(
        None,
        ["--async.adversaries", "other_model,int8_weights", "--async.adversary_engine", engine]
        + ["--async.vllm_workers", "1", "--async.vllm_python", "/opt/v/bin/python"],
    )
    plan = children(cfg, tmp_path, resume=False, serve_tls=[], newest=tmp_path / "v0")
    started = [c for c in plan if c.name.startswith("adversary-")]
    assert [(c.name, c.args[c.args.index("--name") + 1]) for c in started] == [
        ("adversary-0", "adversary-0-other_model"),
        ("adversary-1", "adversary-1-int8_weights"),
    ]
    assert [c.args[c.args.index("--adversary") + 1] for c in started] == ["other_model", "int8_weights"]
    if engine == "vllm":
        assert all(c.args[-2:] == ("--engine", "vllm") and c.python == "/opt/v/bin/python" for c in started)
        # CPU 0 is the trainer's (async.pin_trainer), 1 the honest vLLM worker's
        assert [c.env["VLLM_CPU_OMP_THREADS_BIND"] for c in started] == ["2", "3"]
        assert all(c.later_cpus is None for c in started)  # vLLM binds its own threads
    else:
        assert all("--engine" not in c.args and c.python is None and c.env is None for c in started)
        assert all(c.later_cpus == (1, 2, 3) for c in started)
