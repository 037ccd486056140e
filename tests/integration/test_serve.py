"""`swarmrl serve` as a real process on 127.0.0.1, driven by the official `openai` client."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from swarmrl.eval.runner import chat_ids
from swarmrl.inference.sampler import Sampler
from swarmrl.model.checkpoint import build_tiny_policy, load_policy, save_policy

from serving import Server

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("serve") / "tiny"
    model, tokenizer = build_tiny_policy(seed=0)
    save_policy(model, tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("run"), "--batch-window-ms", "50")
    yield s
    s.stop()


def local_samples(model_dir: Path, messages, seeds, max_tokens, temperature=1.0):
    """What the project's sampler gives for this chat request, in this process."""
    model, tokenizer = load_policy(model_dir)
    sampler = Sampler(model.eval(), stop_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    ids = chat_ids(tokenizer, messages[0]["content"])
    return sampler.generate([ids] * len(seeds), seeds, max_new_tokens=max_tokens, temperature=temperature), tokenizer


def test_models_lists_the_checkpoint(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    # Not one of this project's trained policies (no swarmrl_sft.json): no prompt format claimed.
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["swarmrl_prompt_format"] is None


def test_a_policy_says_which_prompts_it_was_trained_on(tmp_path):
    from swarmrl.serve.app import trained_prompt_format

    run = tmp_path / "policies"
    (run / "v000000").mkdir(parents=True)
    (run / "v000007").mkdir()
    meta = {"digits": 3, "ops": "-", "length_targets": [48, 96]}
    (run / "v000000" / "swarmrl_sft.json").write_text(json.dumps(meta))
    # A version the trainer published finds its base's metadata beside it.
    fmt = trained_prompt_format(str(run / "v000007"))
    assert fmt["task"] == "3-digit arithmetic (-)"
    assert fmt["example"] == "Compute 777 - 222. Think for 48 tokens before giving a response."
    assert fmt["length_targets"] == [48, 96] and "/v1/chat/completions" in fmt["how"]
    (run / "v000000" / "swarmrl_sft.json").write_text("{not json")
    assert trained_prompt_format(str(run / "v000007")) is None


def test_chat_matches_the_local_sampler_token_for_token_with_logprobs(server, model_dir):
    reply = server.client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=24, seed=7, n=2, logprobs=True, top_logprobs=3
    )
    local, tokenizer = local_samples(model_dir, MESSAGES, [7, 8], 24)
    assert len(reply.choices) == 2
    for choice, mine in zip(reply.choices, local):
        content = choice.logprobs.content
        assert [c.logprob for c in content] == pytest.approx(mine.logprobs, abs=1e-4)
        expected_ids = mine.token_ids[:-1] if mine.finish_reason == "stop" else mine.token_ids
        assert choice.message.content == tokenizer.decode(expected_ids, skip_special_tokens=False)
        assert choice.finish_reason == mine.finish_reason
        for c in content:
            tops = [t.logprob for t in c.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and c.logprob <= tops[0] + 1e-6
    assert reply.usage.completion_tokens == sum(len(m.token_ids) for m in local)
    assert reply.usage.prompt_tokens == len(chat_ids(tokenizer, MESSAGES[0]["content"]))


def test_plain_completion_with_logprobs_and_length_limit(server):
    reply = server.client.completions.create(
        model=server.model, prompt="12+7=", max_tokens=5, seed=1, temperature=0.7, logprobs=2
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("length", "stop")
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == reply.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    again = server.client.completions.create(
        model=server.model, prompt="12+7=", max_tokens=5, seed=1, temperature=0.7, logprobs=2
    )
    assert again.choices[0].text == choice.text  # a seed makes a request reproducible
    greedy = [
        server.client.completions.create(model=server.model, prompt="12+7=", max_tokens=5, temperature=0)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert greedy[0] == greedy[1]


def test_streaming_gives_the_same_text_as_one_response(server):
    kwargs = dict(model=server.model, messages=MESSAGES, max_tokens=30, seed=11, n=2)
    whole = server.client.chat.completions.create(**kwargs)
    parts: dict[int, list[str]] = {0: [], 1: []}
    finish, usage = {}, None
    for chunk in server.client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts[c.index].append(c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert {i: "".join(p) for i, p in parts.items()} == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert sum(1 for p in parts[0] if p) > 1  # it arrived in pieces
    streamed = "".join(
        chunk.choices[0].text
        for chunk in server.client.completions.create(
            model=server.model, prompt="9+9=", max_tokens=20, seed=2, stream=True
        )
        if chunk.choices
    )
    assert (
        streamed
        == server.client.completions.create(model=server.model, prompt="9+9=", max_tokens=20, seed=2).choices[0].text
    )


def test_stop_strings_cut_the_text(server):
    free = server.client.completions.create(model=server.model, prompt="abc", max_tokens=40, seed=5, temperature=0.5)
    text = free.choices[0].text
    stop = next(
        text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].isprintable() and text[i : i + 2].strip()
    )
    cut = server.client.completions.create(
        model=server.model, prompt="abc", max_tokens=40, seed=5, temperature=0.5, stop=[stop, "never-there"]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < free.usage.completion_tokens or free.choices[0].finish_reason == "stop"


def test_concurrent_clients_are_batched_and_get_what_they_would_alone(server):
    alone = [
        server.client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=20, seed=100 + i)
        .choices[0]
        .message.content
        for i in range(8)
    ]
    before = httpx.get(server.url + "/stats").json()
    together: list[str | None] = [None] * 8
    barrier = threading.Barrier(8)

    def one(i: int) -> None:
        barrier.wait()
        together[i] = (
            server.client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=20, seed=100 + i)
            .choices[0]
            .message.content
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = httpx.get(server.url + "/stats").json()
    assert together == alone
    assert after["max_batch_rows"] > 1
    # Continuous batching: the 8 requests shared token steps (fewer steps than tokens generated).
    assert after["continuous_batching"]
    assert after["steps"] - before["steps"] < after["generated_tokens"] - before["generated_tokens"]


@pytest.mark.parametrize(
    "kwargs, status, param",
    [
        (dict(temperature=-1), 400, "temperature"),
        (dict(n=0), 400, "n"),
        (dict(n=17), 400, "n"),
        (dict(max_tokens=10_000), 400, "max_tokens"),
        (dict(top_p=0.5), 400, "top_p"),
        (dict(logprobs=True, stream=True), 400, "logprobs"),
        (dict(top_logprobs=2), 400, "top_logprobs"),
        (dict(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
        (dict(seed=-3), 400, "seed"),
        (dict(extra_body={"mystery": 1}), 400, "mystery"),
        (dict(model="gpt-7"), 404, "model"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    ],
)
def test_bad_requests_get_openai_errors(server, kwargs, status, param):
    args = {"model": server.model, "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        result = server.client.chat.completions.create(**args)
        if args.get("stream"):
            list(result)
    assert info.value.status_code == status
    error = info.value.body
    assert error["param"] == param and error["message"] and error["type"]


def test_context_overflow_and_oversized_and_malformed_bodies(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client.completions.create(model=server.model, prompt="x" * 600, max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.APIStatusError) as info:
        server.client.completions.create(model=server.model, prompt="x" * (2 << 20), max_tokens=4)
    assert info.value.status_code == 413
    raw = httpx.post(
        server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.get(server.url + "/v1/nowhere")
    assert missing.status_code == 404 and "error" in missing.json()
    # The server is still there and answering.
    assert server.client.completions.create(model=server.model, prompt="1", max_tokens=2).usage.completion_tokens >= 1


def test_serve_refuses_a_missing_checkpoint(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "swarmrl.cli", "serve", "--model", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "is not a folder" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "body, param",
    [
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}",
            None,
        ),
        (b"[" * 100_000 + b"]" * 100_000, None),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "false"}', "stream"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 1, "n": 2}', None),  # a key twice
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": 1}',
            "stream_options",
        ),
    ],
)
def test_hostile_bodies_get_a_400_not_a_500(server, body, param):
    reply = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_request_cancelled_before_its_batch_runs_is_dropped_and_the_rest_served(model_dir):
    from swarmrl.serve.engine import Engine, GenRequest

    model, tokenizer = load_policy(model_dir)
    engine = Engine(model.eval(), tokenizer, batch_window_s=0.2)
    try:
        gone = GenRequest(chat_ids(tokenizer, "a"), [1], 8, 1.0)
        kept = GenRequest(chat_ids(tokenizer, "b"), [2, 3], 8, 1.0, stop=["x"])
        engine.submit(gone)
        engine.submit(kept)
        assert gone.future.cancel()  # its client went away while the batch was still forming
        choices = kept.future.result(timeout=60)
        assert len(choices) == 2 and all(c.finish_reason in ("stop", "length") for c in choices)
        assert engine.stats["requests"] == 1  # only the kept request ran
        later = GenRequest(chat_ids(tokenizer, "c"), [4], 4, 0.0)
        assert len(engine.submit(later).result(timeout=60)) == 1  # the engine thread is alive
    finally:
        engine.close()
