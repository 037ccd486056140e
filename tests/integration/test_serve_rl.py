"""`swarmrl serve` as an RL worker's engine (docs/engines.md): token-id prompts, token ids and
logprobs answered the way vLLM answers them, and POST /v1/reload switching the weights of a
running server. A real process on 127.0.0.1, real HTTP, real forward passes."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from test_serve import Server

from swarmrl.inference.engine import build_engine
from swarmrl.inference.remote import parse_choice
from swarmrl.model.checkpoint import build_tiny_policy, load_policy, save_policy

pytestmark = pytest.mark.timeout(300)

PROMPT = "What is 12 + 7?"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """Two checkpoints of the same shape with different weights (A and B)."""
    root = tmp_path_factory.mktemp("ckpts")
    for seed, name in ((0, "a"), (1, "b")):
        model, tokenizer = build_tiny_policy(seed=seed)
        save_policy(model, tokenizer, root / name)
    return root / "a", root / "b"


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    run = tmp_path_factory.mktemp("serve-rl")
    (run / "token").write_text("s3cret\n")
    s = Server(
        folders[0],
        run,
        "--reload-token-file",
        str(run / "token"),
        "--served-model-name",
        "policy",
        "--batch-window-ms",
        "20",
    )
    s.token = "s3cret"
    yield s
    s.stop()


def ask(server, prompt_ids: list[int], seed: int, max_tokens: int = 24, **extra) -> dict:
    body = {
        "model": "policy",
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": seed,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        **extra,
    }
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def local(folder: Path, prompt_ids: list[int], seeds: list[int], max_tokens: int = 24):
    """What the built-in engine gives in this process for these seeds."""
    model, tokenizer = load_policy(folder)
    engine = build_engine(model.eval(), tokenizer)
    return engine.generate([prompt_ids] * len(seeds), seeds, max_new_tokens=max_tokens, temperature=1.0)


def prompt_of(folder: Path) -> list[int]:
    _, tokenizer = load_policy(folder)
    return tokenizer(PROMPT, add_special_tokens=False)["input_ids"]


def reload(server, folder: Path, token: str | None = None) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/reload",
        json={"model_path": str(folder)},
        headers={"authorization": f"Bearer {token or server.token}"},
        timeout=120,
    )


def test_token_id_prompts_are_answered_with_token_ids_and_logprobs_as_vllm_does(server, folders):
    ids = prompt_of(folders[0])
    seed = (1 << 63) - 5  # lease seeds are 63-bit
    reply = ask(server, ids, seed)
    choice = reply["choices"][0]
    # vLLM's shape: logprob tokens spelled "token_id:ID", the ids again in `token_ids`.
    assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
    assert all(len(top) == 1 and next(iter(top)).startswith("token_id:") for top in choice["logprobs"]["top_logprobs"])
    assert choice["prompt_token_ids"] == ids
    tokens, logprobs, finish = parse_choice(choice)
    mine = local(folders[0], ids, [seed])[0]
    assert tokens == mine.token_ids and finish == mine.finish_reason
    assert logprobs == pytest.approx(mine.logprobs, abs=1e-4)
    assert reply["usage"]["prompt_tokens"] == len(ids)
    # The same prompt as text gives the same completion.
    text = httpx.post(
        server.url + "/v1/completions",
        json={"model": "policy", "prompt": PROMPT, "max_tokens": 24, "seed": seed},
        timeout=120,
    ).json()
    assert text["choices"][0]["text"] == choice["text"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"prompt": [1, 2, 10_000_000]}, "prompt"),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"top_k": 5}, "top_k"),
        ({"seed": (1 << 63) - 1, "n": 2}, "seed"),
        ({"return_token_ids": "yes"}, "return_token_ids"),
        ({"stream": True, "return_token_ids": True}, "return_token_ids"),
    ],
)
def test_bad_rl_requests_get_a_400_naming_the_parameter(server, extra, param):
    body = {"model": "policy", "prompt": [5, 6, 7], "max_tokens": 4, **extra}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_reload_switches_the_weights_and_needs_the_token(server, folders):
    a, b = folders
    ids = prompt_of(a)
    seeds = [11, 12, 13]
    on_a = [parse_choice(ask(server, ids, s)["choices"][0])[0] for s in seeds]
    assert on_a == [c.token_ids for c in local(a, ids, seeds)]
    # Refused without the token, or with another; nothing changes.
    assert reload(server, b, token="wrong").status_code == 401
    assert httpx.post(server.url + "/v1/reload", json={"model_path": str(b)}).status_code == 401
    assert [parse_choice(ask(server, ids, s)["choices"][0])[0] for s in seeds] == on_a
    # A folder that is not a checkpoint: a 400 that says so, no traceback; still serving A.
    bad = reload(server, a.parent)
    assert bad.status_code == 400 and "could not load" in bad.json()["error"]["message"]
    assert "Traceback" not in bad.text
    assert reload(server, a.parent / "nowhere").json()["error"]["param"] == "model_path"
    done = reload(server, b)
    assert done.status_code == 200 and done.json()["success"] is True
    on_b = [parse_choice(ask(server, ids, s)["choices"][0])[0] for s in seeds]
    assert on_b == [c.token_ids for c in local(b, ids, seeds)] and on_b != on_a
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert models[0]["id"] == "policy" and models[0]["root"] == str(b.resolve())
    assert reload(server, a).status_code == 200
    assert [parse_choice(ask(server, ids, s)["choices"][0])[0] for s in seeds] == on_a


def test_requests_in_flight_during_a_reload_are_answered(server, folders):
    a, b = folders
    ids = prompt_of(a)
    results: list = []

    def long_request(i: int) -> None:
        results.append(ask(server, ids, 100 + i, max_tokens=200, temperature=1.0))

    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert reload(server, b).status_code == 200
    assert reload(server, a).status_code == 200
    for t in threads:
        t.join(timeout=200)
    assert len(results) == 4 and all(len(r["choices"]) == 1 for r in results)
    assert httpx.get(server.url + "/health").json() == {"ok": True}


def test_reload_is_off_without_a_token_file(folders, tmp_path):
    s = Server(folders[0], tmp_path)
    try:
        reply = httpx.post(
            s.url + "/v1/reload", json={"model_path": str(folders[1])}, headers={"authorization": "Bearer anything"}
        )
        assert reply.status_code == 404 and "--reload-token-file" in reply.json()["error"]["message"]
    finally:
        s.stop()
