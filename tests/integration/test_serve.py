"""`swarmrl serve` as a real process on 127.0.0.1, driven by the official `openai` client."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from swarmrl.eval.runner import chat_ids
from swarmrl.inference.sampler import Sampler
from swarmrl.model.checkpoint import build_tiny_policy, load_policy, save_policy

from harness import wait_for
from serving import Server, departing_requests, from_address, settled_stats

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


@pytest.mark.parametrize("kind", ["builtin", "hf"])
def test_a_running_request_cancelled_stops_and_waiting_requests_take_turns_by_address(model_dir, kind):
    from swarmrl.serve.engine import Engine, GenRequest

    model, tokenizer = load_policy(model_dir)
    engine = Engine(model.eval(), tokenizer, max_batch_rows=4, batch_window_s=0.01, kind=kind)
    ids = chat_ids(tokenizer, "a")
    try:
        running = GenRequest(ids, [1, 2, 3, 4], 400, 1.0, client="a")
        engine.submit(running)
        wait_for(lambda: engine.stats["requests"] >= 1, 60, "the engine to take the request", every=0.01)
        running.cancel()  # its client left while it generates
        assert running.future.result(timeout=60) == []
        assert engine.stats["cancelled_running"] == 1 and engine.stats["generated_tokens"] < 4 * 400 // 2
        # One address queues three requests that each fill the batch, then another address one: it
        # starts second, before the first address's third (first come, first served: last).
        first = [GenRequest(ids, [10 * i + j for j in range(4)], 32, 1.0, client="a") for i in range(3)]
        other = GenRequest(ids, [99], 32, 1.0, client="b")
        starts: list[str] = []
        for name, request in [("a0", first[0]), ("a1", first[1]), ("a2", first[2]), ("b", other)]:
            # Called from the engine thread at each piece of text: the first call is its first token.
            request.on_delta = lambda _i, _text, _tok, name=name: None if name in starts else starts.append(name)
            engine.submit(request)
        for request in [*first, other]:
            request.future.result(timeout=120)
        assert starts.index("b") < starts.index("a2"), starts
    finally:
        engine.close()


# -- clients that leave, clients that flood (docs/security.md, "`swarmrl serve` under a disconnecting flood")

FLOOD = {"model": "tiny", "prompt": "What is 2 + 3?", "n": 8, "max_tokens": 384, "temperature": 1.0, "seed": 1}


def _cancelled(stats: dict) -> int:
    return stats.get("cancelled_waiting", 0) + stats.get("cancelled_running", 0)


@pytest.mark.serial
def test_departed_clients_requests_are_not_generated_and_an_honest_client_is_not_kept_waiting(server):
    # The same 16 requests (n = 8, 384 tokens) twice: first with their clients staying, which
    # measures the work and how long the server takes for it, then from clients that close their
    # socket 0.3 s after sending, while an honest client on another address asks for 8 tokens.
    start = settled_stats(server.url)
    t0 = time.monotonic()
    with from_address("127.0.0.1", timeout=300) as client, ThreadPoolExecutor(16) as pool:
        replies = list(
            pool.map(
                lambda i: client.post(server.url + "/v1/completions", json={**FLOOD, "seed": 1 + 1000 * i}),
                range(16),
            )
        )
    stayed_s = time.monotonic() - t0
    assert all(r.status_code == 200 for r in replies)
    stayed = settled_stats(server.url)
    stayed_tokens = stayed["generated_tokens"] - start["generated_tokens"]
    assert stayed_tokens == sum(r.json()["usage"]["completion_tokens"] for r in replies)

    honest: dict = {}

    def honest_client() -> None:
        time.sleep(0.15)  # the flood's requests are queued by now
        with from_address("127.0.0.2") as client:
            t = time.monotonic()
            reply = client.post(
                server.url + "/v1/completions", json={"model": "tiny", "prompt": "1+1=", "max_tokens": 8, "seed": 3}
            )
            honest["s"], honest["reply"] = time.monotonic() - t, reply

    waiter = threading.Thread(target=honest_client)
    waiter.start()
    seen = departing_requests(server.url, FLOOD, 16, open_max=16, linger_s=0.3)
    waiter.join(timeout=300)
    after = settled_stats(server.url)
    assert honest["reply"].status_code == 200
    departed_tokens = after["generated_tokens"] - stayed["generated_tokens"]
    departed_tokens -= honest["reply"].json()["usage"]["completion_tokens"]
    # Nothing of a departed request runs after the next token step: a part of the work is done
    # (the first rows' tokens while their clients stayed; 15% here), not all of it (as before:
    # the same seeds gave the very same tokens).
    assert departed_tokens < 0.5 * stayed_tokens, (departed_tokens, stayed_tokens)
    assert _cancelled(after) - _cancelled(stayed) >= 12  # (a few may end before their client leaves)
    # Before, the honest request waited behind every departed request's whole work (about stayed_s).
    assert honest["s"] < 0.3 * stayed_s, (honest["s"], stayed_s)
    assert not any(s.startswith(b"HTTP/1.1 5") for s in seen)


def test_a_stream_whose_client_leaves_stops_generating(server):
    start = settled_stats(server.url)
    body = {**FLOOD, "stream": True}
    seen = departing_requests(server.url, body, 4, open_max=4, linger_s=30)
    assert all(s.startswith(b"HTTP/1.1 200") for s in seen)  # each left mid-stream
    after = settled_stats(server.url)
    asked = 4 * FLOOD["n"] * FLOOD["max_tokens"]
    assert after["cancelled_running"] - start["cancelled_running"] >= 1
    assert _cancelled(after) - _cancelled(start) == 4
    assert after["generated_tokens"] - start["generated_tokens"] < 0.25 * asked


@pytest.fixture(scope="module")
def capped(model_dir, tmp_path_factory):
    # One completion generating at a time, so what is admitted stays queued while the test looks.
    s = Server(
        model_dir,
        tmp_path_factory.mktemp("capped"),
        "--max-batch",
        "1",
        "--max-n",
        "8",
        "--max-queued-per-client",
        "16",
        "--max-queued-total",
        "24",
    )
    yield s
    s.stop()


def _hold(url: str, source: str, n: int) -> socket.socket:
    """A non-streaming request of n long completions from `source`, its socket left open."""
    host, port = url.split("//", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0))
    raw = json.dumps({**FLOOD, "n": n}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw)
    )
    return sock


def _queued(url: str, want: int) -> None:
    wait_for(
        lambda: httpx.get(url + "/stats").json().get("queued_completions") == want,
        60,
        f"{want} queued completions",
        log=lambda: str(httpx.get(url + "/stats").json()),
    )


def test_queued_work_is_capped_per_address_and_in_total_with_429_and_retry_after(capped):
    small = {"model": "tiny", "prompt": "1+1=", "max_tokens": 4}
    held = [_hold(capped.url, "127.0.0.1", 8), _hold(capped.url, "127.0.0.1", 8)]
    try:
        _queued(capped.url, 16)
        with from_address("127.0.0.1") as one, from_address("127.0.0.2") as two, from_address("127.0.0.3") as three:
            over = one.post(capped.url + "/v1/completions", json=small)
            assert over.status_code == 429
            assert int(over.headers["retry-after"]) >= 1
            error = over.json()["error"]
            assert error["code"] == "queue_full_per_client" and error["type"] == "rate_limit_error"
            assert "--max-queued-per-client" in error["message"] and "retry" in error["message"].lower()
            # Client input is still judged first: a bad request is a 400, not a 429.
            assert one.post(capped.url + "/v1/completions", json={**small, "n": 9}).status_code == 400
            # Another address has its own share, until the total is reached.
            held.append(_hold(capped.url, "127.0.0.2", 8))
            _queued(capped.url, 24)
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            full = three.post(capped.url + "/v1/chat/completions", json=chat)
            assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
            assert "--max-queued-total" in full.json()["error"]["message"] and full.headers["retry-after"]
            # The first address leaves: its share comes back (its requests are dropped or stopped).
            for sock in held[:2]:
                sock.close()
            _queued(capped.url, 8)
            assert one.post(capped.url + "/v1/completions", json=small).status_code == 200
            assert two.get(capped.url + "/health").status_code == 200
    finally:
        for sock in held:
            sock.close()
    _queued(capped.url, 0)


@pytest.mark.serial
def test_health_and_small_prompts_are_answered_while_megabyte_prompts_are_tokenised(server):
    big = json.dumps({"model": "tiny", "prompt": "1+2=" * 250_000})  # 1 MB, under the 1 MiB body limit
    polls: list[float] = []
    small: list[float] = []
    t0 = time.monotonic()
    with from_address("127.0.0.1") as flood, ThreadPoolExecutor(4) as pool:
        posts = [
            pool.submit(flood.post, server.url + "/tokenize", content=big, headers={"content-type": "application/json"})
            for _ in range(4)
        ]
        with from_address("127.0.0.2") as honest:
            while not all(p.done() for p in posts):
                t = time.monotonic()
                assert honest.get(server.url + "/health").json() == {"ok": True}
                polls.append(time.monotonic() - t)
                t = time.monotonic()
                assert honest.post(server.url + "/tokenize", json={"prompt": "1+1="}).json()["count"] == 4
                small.append(time.monotonic() - t)
                time.sleep(0.02)
        counts = [p.result().json()["count"] for p in posts]
    tokenising_s = time.monotonic() - t0
    assert counts == [1_000_000] * 4
    # Before, each tokenisation ran on the event loop and /health waited for one whole
    # tokenisation (a quarter of the time or more); now it is answered between the loop's turns.
    # Another address's small prompt does not queue behind the flood's big ones either: one
    # address gets at most all but one of the tokenizer threads.
    median, median_small = sorted(polls)[len(polls) // 2], sorted(small)[len(small) // 2]
    assert median < 0.1 * tokenising_s, (median, len(polls), tokenising_s)
    assert median_small < 0.1 * tokenising_s, (median_small, len(small), tokenising_s)
