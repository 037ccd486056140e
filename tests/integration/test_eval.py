"""`swarmrl eval` as a user runs it: a local checkpoint and the same checkpoint behind
`swarmrl serve` give the same scores; benchmark files in each format run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_serve import Server

from swarmrl.model.checkpoint import build_tiny_policy, save_policy

from runs import swarmrl

pytestmark = pytest.mark.timeout(600)


def run_eval(out: Path, *args: str) -> tuple[dict, list[dict]]:
    swarmrl("eval", "--output-dir", str(out), *args)
    summary = json.loads((out / "summary.json").read_text())
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return summary, results


@pytest.fixture(scope="module")
def served_base(easy_base, tmp_path_factory):
    """The easy base behind one `swarmrl serve` for the module's endpoint tests (one server
    start instead of one per test; nothing they do changes what it serves)."""
    server = Server(easy_base, tmp_path_factory.mktemp("serve"))
    yield server
    server.stop()


def test_model_and_endpoint_give_the_same_scores(easy_base, served_base, tmp_path):
    # The easy base was warm-started without a length instruction, so none is added here: its
    # accuracy stays above 0 and equal scores mean something.
    args = [
        "--benchmark",
        "arithmetic",
        "--tasks.digits",
        "1",
        "--tasks.eval_size",
        "8",
        "--k",
        "4",
        "--max-tokens",
        "32",
        "--seed",
        "0",
    ]
    local, local_rows = run_eval(tmp_path / "local", "--model", str(easy_base), *args)
    remote, remote_rows = run_eval(tmp_path / "remote", "--endpoint", served_base.url, *args)
    assert 0.0 < local["avg@4"] < 1.0  # a policy with signal: the comparison is not 0 == 0
    for key in ("problems", "avg@4", "pass@1", "pass@2", "pass@4", "length/mean", "errors"):
        assert remote[key] == local[key], key
    assert [r["completions"] for r in remote_rows] == [r["completions"] for r in local_rows]
    assert [r["lengths"] for r in remote_rows] == [r["lengths"] for r in local_rows]
    # Decoding streams (one process per core) sample exactly what one engine samples.
    streamed, streamed_rows = run_eval(tmp_path / "streams", "--model", str(easy_base), "--streams", "2", *args)
    assert streamed["avg@4"] == local["avg@4"]
    assert [r["completions"] for r in streamed_rows] == [r["completions"] for r in local_rows]
    assert local["samples_per_problem"] == 4
    assert remote["backend"].startswith("endpoint") and local["backend"].startswith("local model")
    first = local_rows[0]
    assert set(first) >= {"problem_id", "rewards", "correct", "lengths", "pass@1", "pass@4", "reasons"}
    assert first["pass@1"] == pytest.approx(first["correct"] / 4)


def test_endpoint_default_max_tokens_fits_the_context(served_base, tmp_path):
    # Issue 18: with its defaults, eval against swarmrl serve asked for prompt + 512 tokens from a
    # model whose context is 512 and every request failed. Now it asks the server how long each
    # prompt is (POST /tokenize, vLLM's route) and sends what fits.
    import httpx

    server = served_base
    context = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    chat = {"model": server.model, "messages": [{"role": "user", "content": "What is 2+2?"}]}
    counted = httpx.post(server.url + "/tokenize", json=chat).json()
    assert counted["max_model_len"] == context and counted["count"] == len(counted["tokens"]) > 5
    plain = httpx.post(server.url + "/tokenize", json={"prompt": "What is 2+2?"}).json()
    assert plain["count"] < counted["count"]  # the chat template adds its own tokens
    both = httpx.post(server.url + "/tokenize", json={**chat, "prompt": "x"})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    assert httpx.post(server.url + "/tokenize", json={**chat, "model": "other"}).status_code == 404
    summary, _ = run_eval(
        tmp_path / "auto",
        "--endpoint",
        server.url,
        "--benchmark",
        "arithmetic",
        "--tasks.digits",
        "1",
        "--tasks.eval_size",
        "2",
        "--k",
        "1",
    )
    assert counted["count"] + 512 > context  # the old default alone would not fit
    assert summary["problems"] == 2 and summary["errors"] == 0
    assert summary["settings"]["max_tokens"] == "auto"


def test_benchmark_files_in_each_format(tmp_path):
    model = tmp_path / "tiny"
    save_policy(*build_tiny_policy(seed=0), model)
    files = {
        "math": [{"id": "aime-1", "problem": "What is 1+1?", "answer": "2"}],
        "mcq": [{"id": "q1", "question": "Which is even?", "choices": ["3", "4", "5"], "answer": "B"}],
        "code": [
            {
                "question_id": "lcb-1",
                "question_content": "Print the sum of two integers.",
                "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
            }
        ],
    }
    paths = []
    for name, rows in files.items():
        paths.append(tmp_path / f"{name}.jsonl")
        paths[-1].write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The three files in one process, one after the other on the one loaded model.
    out = tmp_path / "out"
    swarmrl("eval", "--output-dir", str(out), "--model", str(model), "--benchmark", ",".join(map(str, paths)),
            "--k", "2", "--max-tokens", "12", "--sandbox.workers", "1", "--length-target", "10")  # fmt: skip
    combined = json.loads((out / "summary.json").read_text())["benchmarks"]
    assert list(combined) == list(files)  # in the order given, each named after its file
    for name, rows in files.items():
        summary = json.loads((out / name / "summary.json").read_text())
        results = [json.loads(line) for line in (out / name / "results.jsonl").read_text().splitlines()]
        assert summary == combined[name] and summary["benchmark"] == str(tmp_path / f"{name}.jsonl")
        assert summary["problems"] == 1 and summary["errors"] == 0, summary
        assert summary["length/target"] == 10 and 0 <= summary["length/within_10pct"] <= 1
        lengths = results[0]["lengths"]
        assert summary["length/abs_error_mean"] == pytest.approx(sum(abs(n - 10) for n in lengths) / 2)
        assert results[0]["problem_id"] == rows[0].get("id", rows[0].get("question_id"))
        assert len(results[0]["reasons"]) == 2 and all(r for r in results[0]["reasons"])  # untrained: 0, with why


def test_eval_errors_are_clear(tmp_path):
    def refused(*args: str) -> str:
        """`swarmrl eval` with these options exits 2, without a traceback; what it said."""
        proc = swarmrl("eval", *args, "--output-dir", str(tmp_path / "o"), check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        return proc.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"neither": 1}) + "\n")
    assert "format" in refused("--model", str(tmp_path), "--benchmark", str(bad)).lower()
    assert "ConnectError" in refused("--endpoint", "http://127.0.0.1:9/v1", "--benchmark", "code")
    assert "--k must be at least 1" in refused("--model", str(tmp_path), "--benchmark", "code", "--k", "0")
    said = refused("--endpoint", "http://127.0.0.1:9/v1", "--benchmark", "code", "--streams", "2")
    assert "--streams 2: give 1, or more with --model on a CPU" in said
    said = refused("--model", str(tmp_path), "--benchmark", f"code,{tmp_path}/a/code.jsonl")
    assert "--benchmark names code twice" in said
    # A bad file among several fails before any model is loaded (tmp_path is no checkpoint).
    assert "format" in refused("--model", str(tmp_path), "--benchmark", f"code,{bad}").lower()
