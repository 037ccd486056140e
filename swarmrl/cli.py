"""The `swarmrl` command. Each subcommand is one role or tool; `swarmrl --help` lists them."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

COMMANDS = {
    "rl": "Run the whole asynchronous GRPO loop on this machine (orchestrator + trainer + workers on loopback).",
    "sft": "Supervised warm start of the built-in tiny model on worked arithmetic traces.",
    "score": "Score completions in a JSONL file (math answers, code run against tests in a sandbox; length control).",
    "tasks": "Write built-in procedural tasks as JSONL in the INTELLECT-2 RL dataset schema.",
    "orchestrator": "The orchestrator service (HTTP): leases, rollouts, rewards, batches, durable state.",
    "trainer": "The trainer role: pulls batches from the orchestrator, publishes policy versions (torchrun-able).",
    "worker": "An inference worker: joins an orchestrator over HTTP with its own ed25519 key (untrusted, with proofs; "
              "or a trusted key generating through vLLM, SGLang or swarmrl serve).",
    "validator": "A trusted validator: re-runs prefills to check workers' TOPLOC proofs, seeded sampling, logprobs.",
    "relay": "An untrusted HTTP relay: mirrors signed, sharded policy versions from upstream and serves them.",
    "serve": "An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) over a local checkpoint.",
    "eval": "Evaluate a checkpoint or an OpenAI-compatible endpoint on a benchmark: avg@k, pass@k, lengths.",
    "status": "A run at a glance from its orchestrator: progress, every worker's record, validation, versions.",
}

CONFIG_EPILOG = ("Any config field can be overridden with its dotted name, e.g. --trainer.lr 3e-7 "
                 "--async.bound 0 --tasks.digits 3. See configs/default.toml for every field.")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarmrl", description="Asynchronous GRPO over verifiable rewards.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_local_commands(sub)
    _add_role_commands(sub)
    return p


def _add_local_commands(sub) -> None:
    """Commands that run on this machine alone: rl, sft, score, serve, eval, tasks."""
    rl = sub.add_parser("rl", help=COMMANDS["rl"], description=COMMANDS["rl"], epilog=CONFIG_EPILOG)
    rl.add_argument("--config", help="TOML config file (default: the embedded default)")
    rl.add_argument("--run-dir", help="run directory (default: a new folder under runs/)")
    rl.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    rl.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    rl.add_argument("--prepare", action="store_true",
                    help="only write the run directory (config.toml, policies/v000000) for roles started by hand")

    sft = sub.add_parser("sft", help=COMMANDS["sft"], description=COMMANDS["sft"], epilog=CONFIG_EPILOG)
    sft.add_argument("--config", help="TOML config file (its [sft] and [tasks] sections are used)")
    sft.add_argument("--output", help="folder for the HF model (default: the base-model cache that `rl` uses)")
    sft.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")

    sc = sub.add_parser("score", help=COMMANDS["score"], description=COMMANDS["score"])
    sc.add_argument("--input", required=True, help="JSONL rows: task fields + completion (+ target_length)")
    sc.add_argument("--output", required=True, help="JSONL output: input fields + task_reward, length_penalty, reward, error")
    sc.add_argument("--tokenizer", help="HF folder whose tokenizer counts completion tokens (default: the built-in one)")
    sc.add_argument("--length-mode", default="max", choices=["exact", "max", "clip"])
    sc.add_argument("--length-coef", type=float, default=0.001)
    sc.add_argument("--workers", type=int, default=2, help="grading processes")
    sc.add_argument("--timeout", type=float, default=5.0, help="hard per-row math grading timeout in seconds")
    sc.add_argument("--config", help="TOML config file; its [sandbox] section sets how code rows run")
    sc.add_argument("--allow-errors", action="store_true",
                    help="exit 0 even when some rows could not be scored (by default that exits 1; the output "
                         "file is written either way, each such row with its `error`)")
    sc.epilog = ("Code rows (task_type prime_rl_code) run in bubblewrap; set its fields as --sandbox.FIELD "
                 "VALUE, e.g. --sandbox.workers 4 --sandbox.partial_credit true. See docs/sandbox.md.")

    sv = sub.add_parser("serve", help=COMMANDS["serve"], description=COMMANDS["serve"] + " Requests "
                        "share the built-in engine's continuous batches: a request joins the running batch at the "
                        "next token step. CUDA serving is untested (CPU only here).")
    sv.add_argument("--model", required=True, help="local HF checkpoint folder (a swarmrl policy or any causal LM)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    sv.add_argument("--served-model-name", help="the model id clients ask for (default: the folder's name)")
    sv.add_argument("--device", default="cpu")
    sv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    sv.add_argument("--tls-cert", help="PEM certificate (chain): serve https (with --tls-key)")
    sv.add_argument("--tls-key", help="PEM private key of --tls-cert")
    sv.add_argument("--engine", choices=["builtin", "hf"], default="builtin",
                    help="builtin: continuous batching (Qwen2/Llama models; others fall back to hf); hf: the "
                         "generic engine over the model's own forward, in static batches")
    sv.add_argument("--max-batch", "--max-batch-rows", type=int, default=32, help="completions generated together at most")
    sv.add_argument("--batch-window-ms", type=float, default=5.0,
                    help="static batches only (--engine hf): how long a batch waits for more requests to join")
    sv.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    sv.add_argument("--max-request-kb", type=int, default=1024, help="larger request bodies get a 413")
    sv.add_argument("--default-max-tokens", type=int, default=256, help="chat max_tokens when the request has none")
    sv.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    sv.add_argument("--url-file", help="write {url, model} here as JSON once listening (for scripts and tests)")
    sv.add_argument("--reload-token-file",
                    help="enable POST /v1/reload {\"model_path\": FOLDER} (load another checkpoint in place) for "
                         "callers sending 'Authorization: Bearer' + this file's content; how an endpoint worker "
                         "loads each new policy version (docs/engines.md). Anyone with the token can make the "
                         "server load any folder it can read")

    ev = sub.add_parser("eval", help=COMMANDS["eval"], description=COMMANDS["eval"],
                        epilog="Built-in sets take --tasks.FIELD overrides (e.g. --tasks.digits 3), code rows "
                               "--sandbox.FIELD ones. See docs/eval.md.")
    source = ev.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="local HF checkpoint folder, sampled with the project's seeded sampler")
    source.add_argument("--endpoint", help="OpenAI-compatible server URL, e.g. http://127.0.0.1:8080/v1 "
                                           "(swarmrl serve, vLLM, SGLang)")
    ev.add_argument("--served-model", help="model id at the endpoint (default: the first in /v1/models)")
    ev.add_argument("--api-key", help="bearer token for the endpoint (default: $OPENAI_API_KEY if set)")
    ev.add_argument("--benchmark", required=True,
                    help="a JSONL/parquet file, or a built-in set: 'arithmetic' (the held-out split) or 'code'")
    ev.add_argument("--format", default="auto", choices=["auto", "schema", "math", "code", "mcq"],
                    help="the file's format (auto: decided from the first row's fields)")
    ev.add_argument("--limit", type=int, help="only the first N problems")
    ev.add_argument("--k", type=int, default=4, help="samples per problem (avg@k, pass@1..k)")
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--max-tokens", type=int, default=None,
                    help="generated tokens per sample at most (default: 512, or fewer where an --endpoint's context "
                         "leaves less room after a problem's prompt)")
    ev.add_argument("--length-target", type=int,
                    help="append ' Think for N tokens before giving a response.' and report adherence")
    ev.add_argument("--seed", type=int, default=0, help="sample j of problem i uses seed seed*1000003 + i*1000 + j")
    ev.add_argument("--output-dir", required=True, help="writes results.jsonl (per problem) and summary.json")
    ev.add_argument("--concurrency", type=int, default=8, help="endpoint requests in flight")
    ev.add_argument("--device", default="cpu", help="--model only (cuda is untested: no GPU here)")
    ev.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="--model only")
    ev.add_argument("--streams", type=int, default=1,
                    help="--model on a CPU: decode in this many processes of one thread each (one per core is "
                         "fastest at small sizes; the same samples as 1, docs/engines.md). Default 1")
    ev.add_argument("--workers", type=int, default=2, help="math grading processes")
    ev.add_argument("--config", help="TOML config file: its [tasks] and [sandbox] sections are used")

    tk = sub.add_parser("tasks", help=COMMANDS["tasks"], description=COMMANDS["tasks"])
    tk.add_argument("--output", required=True)
    tk.add_argument("--kind", default="arithmetic", choices=["arithmetic", "code"],
                    help="arithmetic: procedural math rows; code: the built-in programming tasks (fixed set)")
    tk.add_argument("--completions", choices=["reference", "wrong"],
                    help="code only: add a completion to each row (its reference or a wrong program), "
                         "ready for `swarmrl score`")
    tk.add_argument("--n", type=int, default=1000)
    tk.add_argument("--digits", type=int, default=2)
    tk.add_argument("--ops", default="+-")
    tk.add_argument("--split", default="train", choices=["train", "test"])
    tk.add_argument("--seed", type=int, default=0)


def _add_trainer_command(sub) -> None:
    """`swarmrl trainer`: one process, a node's ranks under torchrun, or one rank started by torchrun."""
    tr = sub.add_parser("trainer", help=COMMANDS["trainer"], description=COMMANDS["trainer"] + (
        " With trainer.nproc or trainer.nnodes above 1 in the run's config, it starts this node's ranks under "
        "torchrun (python -m torch.distributed.run) and waits for them; node 0 is the one that reaches the "
        "orchestrator and holds the run's files, every other node runs it with --node-rank and a copy of the run's "
        "config.toml and policies/v000000. Started by torchrun itself (python -m torch.distributed.run ... -m "
        "swarmrl.cli trainer ...), it is one rank. docs/deploy.md has the commands."))
    tr.add_argument("--run-dir", required=True)
    tr.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint (with several nodes, every node needs it)")
    tr.add_argument("--orchestrator", help="orchestrator URL (default: from <run-dir>/orchestrator.json)")
    tr.add_argument("--ca-file", help="PEM CA certificate(s) to trust besides the public CAs, for services with "
                    "certificates from your own CA (https is always verified)")
    tr.add_argument("--token-file", help="trainer bearer token (default: <run-dir>/trainer.token)")
    tr.add_argument("--node-rank", type=int, default=0,
                    help="which of the trainer.nnodes nodes this is (0: the one holding global rank 0)")
    tr.add_argument("--rank-logs", metavar="DIR",
                    help="as a torchrun rank: write this rank's output to DIR/trainer-rank<RANK>.log")


def _add_role_commands(sub) -> None:
    """The roles of a run started by hand: orchestrator, trainer, worker, validator, relay."""
    orc = sub.add_parser("orchestrator", help=COMMANDS["orchestrator"], description=COMMANDS["orchestrator"])
    orc.add_argument("--run-dir", required=True, help="run directory with config.toml and policies/v000000")
    orc.add_argument("--host", help="bind address (default: orchestrator.host from the config)")
    orc.add_argument("--port", type=int, help="port (default: orchestrator.port; 0 picks a free one)")
    orc.add_argument("--resume", action="store_true", help="reopen a finished run (its trainer is resuming)")
    orc.add_argument("--tls-cert", help="PEM certificate (chain): serve https (with --tls-key)")
    orc.add_argument("--tls-key", help="PEM private key of --tls-cert")

    _add_trainer_command(sub)

    wk = sub.add_parser("worker", help=COMMANDS["worker"], description=COMMANDS["worker"])
    wk.add_argument("--orchestrator", required=True, help="orchestrator URL, e.g. http://127.0.0.1:8000")
    wk.add_argument("--ca-file", help="PEM CA certificate(s) to trust besides the public CAs, for services with "
                    "certificates from your own CA (https is always verified)")
    wk.add_argument("--insecure", action="store_true",
                    help="allow a plain-http orchestrator that is not on this machine (by default refused: on the "
                         "open internet plain http lets anyone read the traffic or pose as the orchestrator)")
    wk.add_argument("--run-id", help="the run to join (run_id of GET /v1/status, 32 hex): an orchestrator serving "
                                     "another run is refused before anything is signed for it")
    wk.add_argument("--key-file", default=".cache/swarmrl/worker/key.pem",
                    help="ed25519 private key (PEM), created on first start; its public key is this worker's identity")
    wk.add_argument("--cache-dir", default=None,
                    help="downloaded policy versions and the outbox of unsent submissions; one worker per folder "
                         "(default: .cache/swarmrl/worker/<key file name>, so workers with their own keys never "
                         "share one)")
    wk.add_argument("--name", default="worker", help="display name (letters, digits, _ . -)")
    wk.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    wk.add_argument("--streams", type=int, default=1,
                    help="built-in engine on a CPU: decode in this many independent streams of one thread each "
                         "(e.g. one per core; then leave --threads unset). At small model sizes this beats "
                         "splitting each kernel over threads (docs/engines.md). Default 1")
    wk.add_argument("--device", default="cpu", help="cpu or cuda (the CUDA path is checked on the device machine only)")
    wk.add_argument("--dtype", choices=["float32", "bfloat16"],
                    help="default: the run's precision, which every lease names (the validator prefills in it). "
                         "Given, the worker stops with a message if the run samples in another")
    wk.add_argument("--relays", default="", help="comma-separated relay URLs to fetch policy versions from "
                                                  "(the origin the orchestrator names is tried last)")
    wk.add_argument("--trainer-key", help="the trainer's ed25519 public key (64 hex) or a file holding it "
                                          "(<run-dir>/trainer.pub); versions it did not sign are refused")
    en = wk.add_argument_group(
        "trusted fleets", "Generate through an OpenAI-compatible server instead of the built-in sampler. Such work has "
        "no TOPLOC proofs: the orchestrator accepts it only from keys in its orchestrator.trusted_keys_file. "
        "docs/engines.md has the vLLM and SGLang commands.")
    en.add_argument("--engine", choices=["builtin", "openai"], default="builtin",
                    help="builtin: the seeded sampler with proofs (anyone); openai: the server at --endpoint (trusted keys)")
    en.add_argument("--endpoint", help="the server's URL, e.g. http://127.0.0.1:8100 (or .../v1)")
    en.add_argument("--endpoint-key-file", help="bearer token for every request to the server (vLLM --api-key, "
                                                "swarmrl serve --reload-token-file)")
    en.add_argument("--served-model", help="the model id to ask the server for (default: the first of /v1/models)")
    en.add_argument("--load", choices=["reload", "restart", "sglang", "vllm"],
                    help="how each new policy version gets into the server: reload (swarmrl serve's POST /v1/reload; "
                         "the default), restart (this worker runs --server-command and restarts it per version; the "
                         "default with --server-command), sglang (POST /update_weights_from_disk), vllm (re-point "
                         "<cache-dir>/serving, POST /collective_rpc reload_weights). sglang and vllm are untested here")
    en.add_argument("--server-command", help="restart mode: the server's command line, {model} standing for the "
                                             "checkpoint folder, e.g. \"vllm serve {model} --port 8100 ...\"")
    en.add_argument("--endpoint-dtype", choices=["float32", "bfloat16", "float16"],
                    help="the precision the server computes in, declared with every group (the validator's logprob "
                         "tolerance follows it); default: the run's")
    en.add_argument("--concurrency", type=int, default=16, help="requests in flight to the server")

    from swarmrl.config import ADVERSARY_KINDS

    wk.add_argument("--adversary", choices=list(ADVERSARY_KINDS), metavar="KIND",
                    help="FOR TESTING THE VALIDATOR ONLY: cheat in one way (the orchestrator bans the key). "
                         + "; ".join(f"{k}: {v}" for k, v in ADVERSARY_KINDS.items()))

    st = sub.add_parser("status", help=COMMANDS["status"], description=COMMANDS["status"] + (
        " It reads GET /v1/dashboard, which is public: no token needed."))
    st.add_argument("--orchestrator", required=True, help="orchestrator URL, e.g. http://127.0.0.1:8000")
    st.add_argument("--json", action="store_true", help="print the dashboard document as JSON instead of tables")
    st.add_argument("--steps", type=int, default=10, help="progress rows to show (the newest)")
    st.add_argument("--workers", type=int, default=20, help="leaderboard rows to show")
    st.add_argument("--watch", type=float, default=0.0, help="refresh every this many seconds (0: print once)")
    st.add_argument("--ca-file", help="PEM CA certificate(s) to trust besides the public CAs, for services with "
                    "certificates from your own CA (https is always verified)")

    va = sub.add_parser("validator", help=COMMANDS["validator"], description=COMMANDS["validator"] + (
        " Claims groups from the orchestrator with the validator token, fetches the claimed policy versions "
        "from the trainer's weight URLs, and reports verdicts; thresholds come from the orchestrator's config. "
        "Start the orchestrator with --validator.mode external in its config to use only these."))
    va.add_argument("--orchestrator", required=True, help="orchestrator URL")
    va.add_argument("--token-file", required=True, help="validator bearer token (<run-dir>/validator.token)")
    va.add_argument("--cache-dir", default=".cache/swarmrl/validator", help="downloaded policy versions")
    va.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    va.add_argument("--device", default="cpu",
                    help="cpu or cuda (the CUDA path is untested here: no GPU was available to this project's CI)")
    va.add_argument("--dtype", choices=["float32", "bfloat16"],
                    help="default: prefill in the run's precision, which every claim names. Given, the validator "
                         "stops with a message if the run samples in another")
    va.add_argument("--relays", default="", help="comma-separated relay URLs for policy versions (origin last)")
    va.add_argument("--ca-file", help="PEM CA certificate(s) to trust besides the public CAs, for services with "
                    "certificates from your own CA (https is always verified)")
    va.add_argument("--trainer-key", help="the trainer's public key (64 hex) or a file holding it; default: the "
                                          "key the orchestrator's manifests name")

    rel = sub.add_parser("relay", help=COMMANDS["relay"], description=COMMANDS["relay"] + (
        " Versions are verified shard by shard (sha256 from the manifest) before they are served, and their "
        "manifest against the trainer's key (required: a version that does not verify is never mirrored). Serves "
        "HTTP Range requests to many "
        "clients at once; keeps the newest --keep versions."))
    rel.add_argument("--upstream", required=True,
                     help="comma-separated URLs of the origin (the trainer's broadcast server) or other relays")
    rel.add_argument("--cache-dir", required=True, help="where mirrored versions are kept")
    rel.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to serve other machines)")
    rel.add_argument("--port", type=int, default=0, help="port (0 picks a free one)")
    rel.add_argument("--keep", type=int, default=3, help="versions kept (a version being downloaded is never deleted)")
    rel.add_argument("--trainer-key", help="required: the trainer's ed25519 public key (64 hex) or a file holding it "
                                           "(<run-dir>/trainer.pub)")
    rel.add_argument("--startup-tries", type=int, default=10,
                     help="tries to reach an upstream at start before giving up with an error")
    rel.add_argument("--url-file", help="write {\"url\": ...} here once listening (for launchers)")
    rel.add_argument("--max-bytes-per-s", type=float, help="cap on the bytes per second this relay serves in all")
    rel.add_argument("--tls-cert", help="PEM certificate (chain): serve https (with --tls-key)")
    rel.add_argument("--tls-key", help="PEM private key of --tls-cert")
    rel.add_argument("--ca-file", help="PEM CA certificate(s) to trust besides the public CAs, for services with "
                    "certificates from your own CA (https is always verified)")


def _key_arg(value: str | None) -> str | None:
    """A public key given as 64 hex characters or as a file holding them."""
    from pathlib import Path

    if value and Path(value).is_file():
        return Path(value).read_text().strip()
    return value


def _fail(msg: str) -> None:
    print(f"swarmrl: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _config(args, overrides):
    from swarmrl.config import ConfigError, load_config

    from swarmrl.rewards import registry

    try:
        cfg = load_config(args.config, overrides)
        if getattr(args, "run_dir", None):
            cfg = cfg.model_copy(update={"run_dir": args.run_dir})
        registry.load(cfg.tasks.types)
        return cfg
    except (ConfigError, ValueError) as e:
        _fail(str(e))


def _peek_task_types(path: str) -> list[dict]:
    """``{"task_type": ...}`` of each parseable line, to know whether a sandbox is needed."""
    found = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                found.append({"task_type": row.get("task_type")})
    return found


def _run_eval(args, cfg) -> None:
    """`swarmrl eval`: load the benchmark, pick the backend, run, write results and summary."""
    from pathlib import Path

    from swarmrl.eval.formats import load_benchmark
    from swarmrl.eval.runner import EndpointBackend, EvalSettings, ModelBackend, evaluate_rows, progress_bar
    from swarmrl.rewards.pool import VerifierPool
    from swarmrl.rewards.registry import open_graders
    from swarmrl.sandbox.runner import SandboxUnavailable

    for name, value, low in (("--k", args.k, 1), ("--max-tokens", args.max_tokens, 1), ("--concurrency", args.concurrency, 1)):
        if value is not None and value < low:
            _fail(f"{name} must be at least {low}, got {value}")
    if args.length_target is not None and args.length_target < 1:
        _fail(f"--length-target must be a positive number of tokens, got {args.length_target}")
    if args.temperature < 0:
        _fail(f"--temperature must be >= 0, got {args.temperature}")
    if args.streams < 1 or (args.streams > 1 and (not args.model or not args.device.startswith("cpu"))):
        _fail(f"--streams {args.streams}: give 1, or more with --model on a CPU (one per core)")
    try:
        if args.benchmark == "arithmetic":  # the held-out split `swarmrl rl` evaluates on
            from swarmrl.tasks import arithmetic

            t = cfg.tasks
            rows = arithmetic.generate(t.eval_size, digits=t.digits, ops=t.ops, split="test", seed=t.seed)
        elif args.benchmark == "code":
            from swarmrl.tasks import code as code_tasks

            rows = code_tasks.generate()
        else:
            rows = load_benchmark(args.benchmark, args.format)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if args.limit is not None:
        rows = rows[: args.limit]
    if not rows:
        _fail(f"{args.benchmark} has no problems")
    settings = EvalSettings(k=args.k, temperature=args.temperature, max_tokens=args.max_tokens,
                            length_target=args.length_target, seed=args.seed)
    try:
        if args.model:
            if not os.path.isdir(args.model):
                _fail(f"--model {args.model} is not a folder; pass a local Hugging Face checkpoint folder")
            backend = ModelBackend.from_path(args.model, device=args.device, dtype=args.dtype, streams=args.streams)
        else:
            backend = EndpointBackend(args.endpoint, model=args.served_model,
                                      api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
                                      concurrency=args.concurrency)
        graders = open_graders(rows, cfg.sandbox)
    except (ValueError, OSError, SandboxUnavailable) as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - e.g. an unreachable endpoint (httpx errors)
        _fail(f"{type(e).__name__}: {e}")
    print(f"evaluating {len(rows)} problems x {args.k} samples on {backend.describe()}", file=sys.stderr)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with VerifierPool(args.workers, 5.0) as pool:
            results, summary = evaluate_rows(rows, backend, settings, pool=pool, graders=graders,
                                             progress=progress_bar(len(rows), "eval"))
    except ValueError as e:
        _fail(str(e))
    except Exception as e:  # noqa: BLE001 - a failing endpoint mid-run: say so, no traceback
        _fail(f"evaluation stopped: {type(e).__name__}: {e}")
    finally:
        graders.close()
    with open(out / "results.jsonl", "w", encoding="utf-8") as handle:
        for r in results:
            handle.write(json.dumps(r, ensure_ascii=False) + "\n")
    summary = {**summary, "benchmark": args.benchmark, "backend": backend.describe(),
               "settings": {"k": args.k, "temperature": args.temperature,
                            "max_tokens": args.max_tokens if args.max_tokens is not None else "auto",
                            "length_target": args.length_target, "seed": args.seed}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def _quiet_libraries() -> None:
    import logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "httpcore"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _cmd_sft(args, extra: list[str]) -> None:
    from pathlib import Path

    from swarmrl.sft.warmstart import base_cache_key, train_sft

    cfg = _config(args, extra)
    if args.dry_run:
        print(cfg.to_toml(show_unset=True))
        return
    out = Path(args.output) if args.output else Path(cfg.model.base_cache_dir) / base_cache_key(cfg)
    print(f"wrote {train_sft(cfg, out)}")


def _cmd_rl(args, extra: list[str]) -> None:
    cfg = _config(args, extra)
    if args.dry_run:
        print(cfg.to_toml(show_unset=True))
        return
    if args.resume and not args.run_dir:
        _fail("--resume needs --run-dir: the run to continue")
    from swarmrl.launch.launcher import ChildDied, run_rl
    from swarmrl.sandbox.runner import SandboxUnavailable

    # Ctrl-C must reach the launcher even when it was started from a shell that ignores
    # SIGINT for background jobs (Python keeps an inherited SIG_IGN otherwise).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    if args.resume:
        from pathlib import Path

        from swarmrl.config import load_config

        if not (Path(args.run_dir) / "config.toml").exists():
            _fail(f"{args.run_dir} has no config.toml: it is not a swarmrl run directory")
        cfg = load_config(Path(args.run_dir) / "config.toml")
    try:
        summary = run_rl(cfg, resume=args.resume, prepare_only=args.prepare)
    except (ChildDied, FileExistsError, ValueError, FileNotFoundError, SandboxUnavailable) as e:
        _fail(str(e))
    print(json.dumps(summary, indent=1))


def _cmd_score(args, extra: list[str]) -> None:
    from swarmrl.rewards.pool import VerifierPool
    from swarmrl.rewards.scoring import score_file

    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    else:
        from swarmrl.model.tokenizer import build_char_tokenizer

        tok = build_char_tokenizer()
    from swarmrl.rewards.registry import open_graders
    from swarmrl.sandbox.runner import SandboxUnavailable

    cfg = _config(args, extra)
    if not os.path.exists(args.input):
        _fail(f"--input {args.input} does not exist")
    try:
        graders = open_graders(_peek_task_types(args.input), cfg.sandbox)
    except SandboxUnavailable as e:
        _fail(str(e))
    try:
        with VerifierPool(args.workers, args.timeout) as pool:
            counts = score_file(args.input, args.output, pool=pool,
                                count_tokens=lambda s: len(tok(s, add_special_tokens=False)["input_ids"]),
                                length_mode=args.length_mode, length_coef=args.length_coef, graders=graders)
    finally:
        graders.close()
    print(json.dumps(counts))
    if counts["errors"] and not args.allow_errors:
        first = "; ".join(f"line {e['line']}: {e['error']}" for e in counts["first_errors"][:2])
        print(f"swarmrl score: {counts['errors']} of {counts['rows']} rows could not be scored ({first}); each has "
              f"its `error` in {args.output}. mean_reward averages the {counts['scored']} scored rows, "
              "mean_reward_all_rows counts the others as 0. Fix the rows, or pass --allow-errors to exit 0.",
              file=sys.stderr)
        raise SystemExit(1)


def _cmd_tasks(args, extra: list[str]) -> None:
    from swarmrl.data.loading import write_jsonl
    from swarmrl.tasks import arithmetic
    from swarmrl.tasks import code as code_tasks

    if args.completions and args.kind != "code":
        _fail("--completions is for --kind code (arithmetic rows have no reference programs)")
    try:
        if args.kind == "code":
            rows = code_tasks.generate(completions=args.completions)
        else:
            rows = arithmetic.generate(args.n, digits=args.digits, ops=args.ops, split=args.split, seed=args.seed)
    except ValueError as e:
        _fail(str(e))
    print(f"wrote {write_jsonl(rows, args.output)} rows to {args.output}")


def _cmd_eval(args, extra: list[str]) -> None:
    _run_eval(args, _config(args, extra))


def _cmd_serve(args, extra: list[str]) -> None:
    from swarmrl.serve.app import serve

    if not os.path.isdir(args.model):
        _fail(f"--model {args.model} is not a folder; pass a local Hugging Face checkpoint folder")
    try:
        serve(args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
              model_name=args.served_model_name, max_batch_rows=args.max_batch,
              batch_window_ms=args.batch_window_ms, max_n=args.max_n, max_request_kb=args.max_request_kb,
              default_max_tokens=args.default_max_tokens, url_file=args.url_file, threads=args.threads,
              reload_token_file=args.reload_token_file, engine=args.engine, tls_cert=args.tls_cert,
              tls_key=args.tls_key)
    except (OSError, ValueError) as e:
        _fail(str(e))


def _cmd_orchestrator(args, extra: list[str]) -> None:
    from swarmrl.orchestrator.server import serve
    from swarmrl.sandbox.runner import SandboxUnavailable
    from swarmrl.validator.runner import start_in_process

    try:
        serve(args.run_dir, host=args.host, port=args.port, resume=args.resume, start_validator=start_in_process,
              tls_cert=args.tls_cert, tls_key=args.tls_key)
    except (FileNotFoundError, OSError, SandboxUnavailable) as e:
        _fail(str(e))


def _cmd_trainer(args, extra: list[str]) -> None:
    from pathlib import Path

    from swarmrl.launch import torchrun

    if torchrun.under_torchrun():
        if args.rank_logs:
            torchrun.redirect_rank_output(args.rank_logs)
    else:
        from swarmrl.config import ConfigError, load_config

        config = Path(args.run_dir) / "config.toml"
        if not config.exists():
            _fail(f"{config} does not exist: prepare the run first (swarmrl rl --prepare --run-dir {args.run_dir}), "
                  "or on another trainer node copy config.toml and policies/v000000 there")
        try:
            cfg = load_config(config)
        except ConfigError as e:
            _fail(str(e))
        if torchrun.world_size(cfg) > 1:
            passed = ["--run-dir", args.run_dir] + (["--resume"] if args.resume else [])
            for flag in ("--orchestrator", "--token-file", "--ca-file"):  # rank 0 reaches the orchestrator
                value = getattr(args, flag[2:].replace("-", "_"), None)
                passed += [flag, value] if value else []
            try:
                code = torchrun.run_node(cfg, args.run_dir, args.node_rank, passed)
            except ValueError as e:
                _fail(str(e))
            raise SystemExit(1 if code else 0)
        if args.node_rank:
            _fail(f"--node-rank {args.node_rank}: the run's config has one trainer node (trainer.nnodes = 1)")
    from swarmrl.trainer.loop import run_trainer

    try:
        run_trainer(args.run_dir, resume=args.resume, orchestrator=args.orchestrator, token_file=args.token_file)
    except FileNotFoundError as e:
        _fail(str(e))
    except (SystemExit, KeyboardInterrupt) as e:
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        from swarmrl.trainer.checkpoint import checkpoint_dirs

        done = checkpoint_dirs(Path(args.run_dir) / "checkpoints")
        where = f"its newest checkpoint is step {done[-1][0]}" if done else "it has no checkpoint yet (it starts over)"
        print(f"trainer stopped; {where}. Continue with: swarmrl trainer --run-dir {args.run_dir} --resume "
              "(steps after the checkpoint are redone on the same batches)", file=sys.stderr, flush=True)
        raise


def _endpoint_settings(args):
    """The --engine openai flags as EndpointSettings (None for the built-in engine)."""
    from pathlib import Path

    from swarmrl.inference.remote import EndpointSettings

    endpoint_flags = [f for f in ("endpoint", "endpoint_key_file", "served_model", "load", "server_command",
                                  "endpoint_dtype") if getattr(args, f) is not None]
    if args.engine == "builtin":
        if endpoint_flags:
            _fail(f"--{endpoint_flags[0].replace('_', '-')} is for --engine openai")
        return None
    if not args.endpoint:
        _fail("--engine openai needs --endpoint URL, the OpenAI-compatible server to generate with")
    if args.adversary:
        _fail("--adversary runs the built-in engine; it cannot be combined with --engine openai")
    api_key = None
    if args.endpoint_key_file:
        try:
            api_key = Path(args.endpoint_key_file).read_text().strip()
        except OSError as e:
            _fail(f"--endpoint-key-file {args.endpoint_key_file}: {e.strerror}")
    load = args.load or ("restart" if args.server_command else "reload")
    try:
        return EndpointSettings(args.endpoint, load=load, api_key=api_key, served_model=args.served_model,
                                server_command=args.server_command, dtype=args.endpoint_dtype,
                                concurrency=args.concurrency)
    except ValueError as e:
        _fail(str(e))


def _check_urls(args) -> None:
    """Service URLs checked before anything starts: one that cannot work fails now, clearly,
    instead of being retried for minutes (issue 18); a trailing /v1 is accepted and dropped."""
    from swarmrl.protocol.client import service_url

    try:
        if getattr(args, "orchestrator", None):
            args.orchestrator = service_url(args.orchestrator, "--orchestrator")
        for flag in ("relays", "upstream"):
            value = getattr(args, flag, None)
            if value:
                setattr(args, flag, ",".join(service_url(u, f"--{flag}") for u in value.split(",") if u.strip()))
    except ValueError as e:
        _fail(str(e))


_HELD: list = []  # open lock files: held until the process exits


def _hold_folder(folder: str, role: str) -> None:
    """Take `folder` for this process alone (an flock on <folder>/.lock, released when the process
    ends, however it ends): two workers sharing a cache would share, and double-send, one outbox."""
    import fcntl

    Path(folder).mkdir(parents=True, exist_ok=True)
    handle = open(Path(folder) / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        _fail(f"--cache-dir {folder} is in use by {holder}: give each {role} its own --cache-dir")
    handle.seek(0)
    handle.truncate()
    handle.write(f"{role} pid {os.getpid()}\n")
    handle.flush()
    _HELD.append(handle)


def _cmd_worker(args, extra: list[str]) -> None:
    from swarmrl.inference.worker import Worker, run_worker
    from swarmrl.protocol.signing import AuthError

    _check_urls(args)
    from swarmrl.protocol.tls import is_loopback

    if args.streams < 1:
        _fail(f"--streams {args.streams}: give at least 1 decoding stream (one per core is the usual choice)")
    if args.streams > 1 and not args.device.startswith("cpu"):
        _fail(f"--streams {args.streams} is for CPU workers; on --device {args.device} one engine fills the device: "
              "drop --streams")
    if args.orchestrator.startswith("http://") and not is_loopback(args.orchestrator) and not args.insecure:
        _fail(f"--orchestrator {args.orchestrator} is plain http to another machine: anyone on the path could read "
              "this worker's traffic or pose as the orchestrator. Use its https URL, or pass --insecure on a network "
              "you trust")
    if args.cache_dir is None:
        args.cache_dir = os.path.join(".cache", "swarmrl", "worker", Path(args.key_file).stem)
    _hold_folder(args.cache_dir, "worker")
    endpoint = _endpoint_settings(args)
    worker_class = Worker
    if args.adversary:  # test-only cheats live outside the production inference package
        from swarmrl.adversary.workers import adversary_class

        worker_class = adversary_class(args.adversary)
    try:
        run_worker(args.orchestrator, key_file=args.key_file, cache_dir=args.cache_dir, name=args.name,
                   threads=args.threads, device=args.device, dtype=args.dtype, worker_class=worker_class,
                   relays=[u.strip() for u in args.relays.split(",") if u.strip()],
                   trainer_key=_key_arg(args.trainer_key), run_id=args.run_id, endpoint=endpoint,
                   streams=args.streams)
    except AuthError as e:
        _fail(str(e))


def _cmd_relay(args, extra: list[str]) -> None:
    from swarmrl.transport.broadcast import BroadcastError
    from swarmrl.transport.relay import run_relay

    _check_urls(args)
    key = _key_arg(args.trainer_key)
    try:
        run_relay([u.strip() for u in args.upstream.split(",") if u.strip()], args.cache_dir, host=args.host,
                  port=args.port, keep=args.keep, public_key=key, startup_tries=args.startup_tries,
                  url_file=args.url_file, max_bytes_per_s=args.max_bytes_per_s, tls=_relay_tls(args))
    except BroadcastError as e:
        print(f"swarmrl relay: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def _relay_tls(args):
    if not (args.tls_cert or args.tls_key):
        return None
    if not (args.tls_cert and args.tls_key):
        _fail("--tls-cert and --tls-key go together: give both")
    from swarmrl.protocol.tls import server_context

    return server_context(args.tls_cert, args.tls_key)


def _cmd_validator(args, extra: list[str]) -> None:
    from swarmrl.validator.runner import run_external

    _check_urls(args)
    try:
        run_external(args.orchestrator, token_file=args.token_file, cache_dir=args.cache_dir,
                     threads=args.threads, device=args.device, dtype=args.dtype,
                     relays=[u.strip() for u in args.relays.split(",") if u.strip()],
                     trainer_key=_key_arg(args.trainer_key))
    except FileNotFoundError as e:
        _fail(str(e))


def _cmd_status(args, extra: list[str]) -> None:
    from swarmrl.launch.status import watch

    _check_urls(args)
    try:
        watch(args.orchestrator, as_json=args.json, steps=args.steps, workers=args.workers, every_s=args.watch)
    except ValueError as e:
        _fail(str(e))


COMMAND_FUNCTIONS = {
    "rl": _cmd_rl,
    "sft": _cmd_sft,
    "score": _cmd_score,
    "tasks": _cmd_tasks,
    "eval": _cmd_eval,
    "serve": _cmd_serve,
    "orchestrator": _cmd_orchestrator,
    "trainer": _cmd_trainer,
    "worker": _cmd_worker,
    "relay": _cmd_relay,
    "validator": _cmd_validator,
    "status": _cmd_status,
}


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("rl", "sft", "score", "eval"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "score" and any(a.startswith("--") and not a.startswith(("--sandbox.", "--tasks.")) for a in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)} (score takes --sandbox.FIELD and --tasks.types "
                     "overrides only)")
    if args.command == "eval" and any(a.startswith("--") and not a.startswith(("--sandbox.", "--tasks.")) for a in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)} (eval takes --tasks.FIELD and --sandbox.FIELD "
                     "overrides only)")
    _quiet_libraries()
    # Roles started by the launcher exit cleanly (finally blocks run, pools close) on SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from swarmrl.protocol.tls import TLSError, trust_ca_file

    try:
        if getattr(args, "ca_file", None):
            trust_ca_file(args.ca_file)
        COMMAND_FUNCTIONS[args.command](args, extra)
    except TLSError as e:
        _fail(str(e))


if __name__ == "__main__":
    main()
