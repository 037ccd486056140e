"""`swarmrl rl`: start the orchestrator, the trainer and inference workers as OS processes on
this machine and watch them. They talk HTTP on loopback exactly as they would across the
internet: workers have their own keys, lease from the orchestrator and fetch weights over HTTP.

The launcher owns the children: each runs in its own session (so a terminal's Ctrl-C reaches
only the launcher, which then stops everyone in order), logs to `<run-dir>/logs/`, and is
killed with its whole process group. A child that dies is reported with its log path and the
run stops instead of hanging. With several trainer ranks (`trainer.nproc`, `trainer.nnodes`) the
trainer child is torchrun (launch/torchrun.py): a rank that dies is reported with its own log.
At the end it writes `summary.json` and PNG plots.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError

from swarmrl.config import Config, ConfigError, read_key_file
from swarmrl.launch import fatal, torchrun
from swarmrl.launch.plan import Child, endpoint_dir, engine_flags, placement
from swarmrl.launch.plan import children as children_of
from swarmrl.launch.progress import Progress, check_tensorboard
from swarmrl.model.checkpoint import load_tokenizer
from swarmrl.model.hub import is_hub_id, resolve
from swarmrl.model.lora import check_lora_config
from swarmrl.orchestrator.limits_reload import published_by
from swarmrl.proofs.limits import LimitsError, cpu_kind, run_limits
from swarmrl.protocol.signing import load_or_create_key, public_key_hex
from swarmrl.protocol.tls import make_loopback_certificates, trust_ca_file
from swarmrl.rewards.registry import open_graders
from swarmrl.sft.warmstart import ensure_base_model
from swarmrl.tasks.source import model_input, task_rows
from swarmrl.transport.filesystem import RunDir, atomic_write_text


class ChildDied(RuntimeError):
    pass


def new_run_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


def _install_base(rd: RunDir, base: Path) -> None:
    """Policy version 0 is the starting model, copied in whole before anyone reads it."""
    dest = rd.version_path(0)
    if dest.exists():
        return
    tmp = rd.policies / ".v000000.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    os.replace(tmp, dest)


class Children:
    def __init__(self, rd: RunDir, log=print):
        self.rd, self.log = rd, log
        self.procs: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.gone: set[str] = set()  # adversarial workers that left (banned): expected
        self.torchrun: str | None = None  # the child that is torchrun, whose ranks run in their own sessions
        self.rank_pids: set[int] = set()
        self.log_start = 0  # where this start's output begins in torchrun's log (a resumed run appends)
        self.deferred: dict[str, list[int]] = {}  # CPU sets to apply once the run is under way

    def start(
        self,
        name: str,
        args: list[str],
        threads: int,
        nice: int = 0,
        *,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        python: str | None = None,
        cpus: list[int] | None = None,
    ) -> None:
        """`swarmrl <args>` as child `name` (on `python`, default this one), or `command`
        (torchrun) in its place; on `cpus` only when given (`placement`)."""
        log = self.rd.logs / f"{name}.log"
        if command:
            self.torchrun, self.log_start = name, log.stat().st_size if log.exists() else 0
        env = {
            **(env or os.environ),
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "SWARMRL_LAUNCHER_PID": str(os.getpid()),
        }
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                command or [python or sys.executable, "-m", "swarmrl.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_placed(nice, cpus) if nice or cpus else None,
            )
        self.procs[name] = (proc, log)

    def place_later(self, name: str, cpus: list[int]) -> None:
        """Move child `name` to `cpus` at `place_deferred`: workers start on every CPU (their
        imports and first policy load then overlap the trainer's start instead of queueing on the
        CPUs left to them) and keep off the trainer's once the run is under way."""
        self.deferred[name] = cpus

    def place_deferred(self) -> None:
        for name, cpus in self.deferred.items():
            proc, _ = self.procs[name]
            tasks = Path(f"/proc/{proc.pid}/task")
            try:  # every thread it has: sched_setaffinity(pid) moves only the main one
                tids = [int(t.name) for t in tasks.iterdir()] if tasks.exists() else [proc.pid]
            except OSError:
                tids = [proc.pid]
            for tid in tids:
                try:
                    os.sched_setaffinity(tid, cpus)
                except OSError:
                    pass  # gone (a thread that ended, a worker that stopped): nothing to move
        self.deferred.clear()

    def check(self) -> bool:
        """True once the trainer has finished; raises ChildDied if any child failed."""
        for name, (proc, log) in self.procs.items():
            code = proc.poll()
            if code is not None and name.startswith("adversary"):
                if name not in self.gone:
                    self.gone.add(name)
                    last = (log.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
                    self.log(f"{name} left (code {code}): {last}")
                continue
            if code is not None and (code != 0 or name != "trainer"):
                if name.startswith("worker") and code == 0 and self.rd.stop_requested():
                    continue  # a worker that exited because the run is over
                stopped = fatal.read(self.rd.root)
                if stopped is not None:
                    # A role that stopped the run on purpose: its message is the whole story.
                    role, message = stopped
                    raise ChildDied(f"the {role} stopped the run: {message}\n(logs: {self.rd.logs})")
                why = (
                    torchrun.describe_failure(log, self.rd.logs, since=self.log_start)
                    if name == self.torchrun
                    else None
                )
                if why:
                    raise ChildDied(why)  # the rank that died, and its own log
                tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                raise ChildDied(f"{name} exited with code {code}; its log is {log}\n  " + "\n  ".join(tail))
            if code is None and name == self.torchrun:
                self.rank_pids |= torchrun.rank_pids(proc.pid)
        trainer = self.procs.get("trainer")
        return trainer is not None and trainer[0].poll() == 0

    def wait_for_file(self, path: Path, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            self.check()
            if time.monotonic() > deadline:
                raise ChildDied(f"{path.name} did not appear within {timeout_s:.0f} s; see {self.rd.logs}")
            time.sleep(0.05)

    def stop(self, grace_s: float = 5.0) -> None:
        self.rd.request_stop()
        # Workers and trainer first, the orchestrator last (they may be mid-request).
        for proc, _ in reversed(list(self.procs.values())):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for proc, _ in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the group: stray grandchildren too
            except ProcessLookupError:
                pass
        torchrun.kill_ranks(self.rank_pids)  # any rank torchrun had no time to stop


class _Events:
    """Validator rejections and bans from the orchestrator's log, for the terminal: every ban,
    and the first rejection of each (worker, reason) (the log and /metrics have all of them)."""

    def __init__(self, path: Path):
        self.path, self.pos, self.seen = path, 0, set()

    def new(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        cut = data.rfind(b"\n") + 1  # whole lines only
        self.pos += cut
        out = []
        for line in data[:cut].decode(errors="replace").splitlines():
            if line.startswith("banned:"):
                out.append(line)
            elif line.startswith("rejected:"):
                who_reason = line.split(":", 3)[:3]
                key = tuple(who_reason)
                if key not in self.seen:
                    self.seen.add(key)
                    out.append(line[:240] + " (first of its kind; all in logs/orchestrator.log)")
        return out


def read_metrics(rd: RunDir) -> list[dict]:
    path = rd.root / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_summary(rd: RunDir, cfg: Config, wall_seconds: float) -> dict:
    records = read_metrics(rd)
    trainer_summary = json.loads((rd.root / "trainer_summary.json").read_text())
    steps = [r for r in records if "time/step" in r]
    summary = {
        "accuracy_before": trainer_summary["accuracy_before"],
        "accuracy_after": trainer_summary["accuracy_after"],
        "accuracy_gain": trainer_summary["accuracy_after"] - (trainer_summary["accuracy_before"] or 0.0),
        "steps": cfg.trainer.steps,
        "wall_seconds": round(wall_seconds, 1),
        "max_off_policy": max((r["off_policy/max"] for r in steps), default=0),
        "async_bound": cfg.async_.bound,
        "off_policy_dropped": sum(r.get("off_policy/dropped", 0) for r in steps),
        "mean_step_seconds": sum(r["time/step"] for r in steps) / max(1, len(steps)),
        "eval_temperature": cfg.eval.temperature,
        "eval_problems": cfg.tasks.eval_size,
    }
    atomic_write_text(rd.root / "summary.json", json.dumps(summary, indent=1))
    return summary


def _check_packing_budget(cfg: Config, train: list[dict], base: Path) -> None:
    """With packing on, the longest prompt the orchestrator can lease plus a full-length completion
    must fit one pack (config validation could only check max_new_tokens). Prompts are built as
    the orchestrator builds them; with length control, with the target written with most digits."""
    budget = cfg.trainer.max_tokens_per_micro_batch
    if budget is None:
        return
    tokenizer = load_tokenizer(base)
    targets = cfg.length.targets if cfg.length.enabled else None
    target = max(targets, key=lambda t: len(str(t))) if targets else None
    longest = max((len(model_input(tokenizer, row["prompt"], target)[1]) for row in train), default=0)
    need = longest + cfg.sampling.max_new_tokens
    if budget < need:
        raise ValueError(
            f"trainer.max_tokens_per_micro_batch={budget} cannot hold one sequence: the longest prompt "
            f"is {longest} tokens and sampling.max_new_tokens is {cfg.sampling.max_new_tokens}, so a "
            f"sequence can be {need} tokens; set trainer.max_tokens_per_micro_batch to at least {need}"
        )


def _trust_endpoint_workers(rd: RunDir, cfg: Config) -> Config:
    """Keys for the endpoint workers, made trusted: <run-dir>/trusted_keys.txt lists them and
    the keys of the user's orchestrator.trusted_keys_file, and the run's config points at it."""
    keys = sorted(read_key_file(cfg.orchestrator.trusted_keys_file)) if cfg.orchestrator.trusted_keys_file else []
    lines = [f"{k}  # from {cfg.orchestrator.trusted_keys_file}" for k in keys]
    for i in range(cfg.async_.endpoint_workers):
        key = public_key_hex(load_or_create_key(endpoint_dir(rd.root, i) / "key.pem"))
        lines.append(f"{key}  # worker-openai-{i} (swarmrl rl, async.endpoint_workers)")
    path = rd.root / "trusted_keys.txt"
    atomic_write_text(
        path,
        "# keys whose groups are accepted without proofs (orchestrator.trusted_keys_file)\n" + "\n".join(lines) + "\n",
    )
    orchestrator = cfg.orchestrator.model_copy(update={"trusted_keys_file": str(path.resolve())})
    return cfg.model_copy(update={"orchestrator": orchestrator})


def _placed(nice: int, cpus: list[int] | None):
    """What a child runs before exec: its niceness and CPU set."""

    def place() -> None:
        if nice:
            os.nice(nice)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return place


def trainer_pub(rd: RunDir) -> Path:
    """<run>/trainer.pub, written here if the trainer has not yet (it loads the same key file):
    relays and workers may then start before the trainer does."""
    pub = rd.root / "trainer.pub"
    key = load_or_create_key(rd.root / "trainer_key.pem")
    if not pub.exists() or pub.read_text().strip() != public_key_hex(key):
        atomic_write_text(pub, public_key_hex(key) + "\n")
    return pub


def _endpoint_tokens(rd: RunDir, cfg: Config) -> None:
    """Each endpoint worker's reload token, in its folder (its `swarmrl serve` and the worker read it)."""
    import secrets

    for i in range(cfg.async_.endpoint_workers):
        token = endpoint_dir(rd.root, i) / "reload.token"
        if not token.exists():
            atomic_write_text(token, secrets.token_hex(16))
            token.chmod(0o600)


def start_children(children_: Children, plan: list[Child], log) -> None:
    """Start `plan` in order: each child once the URLs it needs are written (`Needs`), the next
    once a child that serves has written its own (`ready`). Files from an earlier start go first:
    a restarted orchestrator, origin, relay or server may listen elsewhere."""
    for f in {c.ready for c in plan} | {n.file for c in plan for n in c.needs}:
        if f is not None:
            f.unlink(missing_ok=True)
    urls: dict[str, str] = {}
    for c in plan:
        for n in c.needs:
            if n.placeholder not in urls:
                children_.wait_for_file(n.file, timeout_s=n.timeout_s)
                urls[n.placeholder] = json.loads(n.file.read_text())["url"]
        children_.start(
            c.name,
            [urls.get(a, a) for a in c.args],
            c.threads,
            c.nice,
            command=list(c.command) if c.command else None,
            env=c.env,
            python=c.python,
            cpus=list(c.cpus) if c.cpus else None,
        )
        if c.later_cpus:
            children_.place_later(c.name, list(c.later_cpus))
        if c.ready is not None:
            children_.wait_for_file(c.ready, timeout_s=c.ready_timeout_s)
            log(f"{c.name}: {json.loads(c.ready.read_text())['url']}")


def _notes(cfg: Config, rd: RunDir, log) -> None:
    """What the operator should know of the processes about to start."""
    trainer_cpus, other_cpus = placement(cfg)
    if trainer_cpus:
        log(f"CPUs: the trainer on {trainer_cpus}, the other processes on {other_cpus} (async.pin_trainer)")
    t = cfg.trainer
    if torchrun.world_size(cfg) > 1:
        backend = "nccl" if cfg.model.device.startswith("cuda") else "gloo"
        log(
            f"trainer: {t.nproc} ranks x {t.nnodes} nodes under torchrun ({backend}), logs "
            f"{torchrun.rank_log(rd.logs, '<RANK>')}"
        )
        if t.nnodes > 1:
            log(
                f"trainer: waiting up to {t.dist_timeout_s:.0f} s for nodes 1..{t.nnodes - 1} to join; on each, "
                f"with a copy of {rd.root}/config.toml and {rd.version_path(0)}: "
                "swarmrl trainer --run-dir <copy> --node-rank N"
            )
    a = cfg.async_
    if a.vllm_workers:
        log(f"{a.vllm_workers} proving vLLM workers on {a.vllm_python} (swarmrl worker --engine vllm)")
    if a.endpoint_workers:
        log(f"{a.endpoint_workers} trusted endpoint workers, each generating through its own swarmrl serve")
    if a.adversaries:
        on = f"proving vLLM workers on {a.vllm_python}" if a.adversary_engine == "vllm" else "the built-in engine"
        log(f"{len(a.adversaries)} adversarial workers ({on}): {', '.join(a.adversaries)}")


def prepared_next_steps(cfg: Config, root: Path) -> str:
    """What `swarmrl rl --prepare` tells the operator to start next, in order (README, docs/deploy.md)."""
    o = cfg.orchestrator
    scheme = "https" if cfg.broadcast.tls_cert else "http"
    lines = [
        f"prepared {root}: config.toml and policies/v000000 ({cfg.trainer.steps} steps). Start, in this order:",
        f"  swarmrl orchestrator --run-dir {root} --host {o.host} --port {o.port or 8000}"
        "   [--tls-cert CERT --tls-key KEY]   (writes trainer.token, validator.token)",
        f"  swarmrl trainer --run-dir {root}   (serves the weights on {scheme}://{cfg.trainer.weights_host}:"
        f"{cfg.trainer.weights_port or 'a free port'}; writes trainer.pub, the key relays and workers check)",
        "  swarmrl relay --upstream ORIGIN_URL --cache-dir DIR --trainer-key <trainer.pub>   (any number)",
        "  swarmrl worker --orchestrator ORCHESTRATOR_URL --trainer-key <trainer.pub> --relays RELAY_URLS"
        "   (any number, each with its own --key-file)",
    ]
    if cfg.validator.mode == "external":
        lines.append(f"  swarmrl validator --orchestrator ORCHESTRATOR_URL --token-file {root}/validator.token")
    else:
        lines.append(
            "  (validation runs inside the orchestrator: prepare with --validator.mode external to run "
            "`swarmrl validator` on its own machine)"
        )
    lines.append("Watch it: open the orchestrator's URL in a browser, or `swarmrl status --orchestrator URL`.")
    return "\n".join(lines)


def _pin_model(cfg: Config, log) -> Config:
    """A Hub id in model.path resolved now (HubError naming the id and the cache otherwise), and
    its commit written into model.revision: the run, its resumes and its signed versions name the
    weights it started from, whatever the branch points at later."""
    if not (cfg.model.path and is_hub_id(cfg.model.path)):
        return cfg
    resolved = resolve(cfg.model.path, cfg.model.revision)
    log(f"model.path {cfg.model.path}: Hub commit {resolved.commit or 'unknown'} ({resolved.folder})")
    if resolved.commit is None:
        return cfg
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"revision": resolved.commit})})


def _preflight(cfg: Config) -> None:
    """Checks of the config alone, before anything is written: LoRA targets the model lacks, and
    a bf16 run on its own model without a limits file (LimitsError naming `swarmrl calibrate`)."""
    check_lora_config(cfg)
    check_tensorboard(cfg)
    try:
        engine_flags(cfg)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"async.worker_engine_options for engine {cfg.async_.worker_engine!r}: {problems}") from None
    except ValueError as e:
        raise ConfigError(f"async.worker_engine: {e}") from None
    if cfg.sampling.dtype == "bfloat16" and cfg.model.path and not cfg.validator.limits_file:
        run_limits(cfg, None)


def _base_with_limits(rd: RunDir, cfg: Config, train: list[dict], log) -> tuple[Config, Path]:
    """The run's base model, once its validator limits are known to fit it (a limits file for
    another model or dtype is a LimitsError as soon as the base is at hand). A bf16 run of the
    built-in model without a limits file gets one measured here, as its base is built here: the
    shipped bf16 limits were measured on one CPU kind and refuse most honest groups on others
    (docs/validation.md, "Calibrating a run")."""
    base = ensure_base_model(cfg, log=log)
    if cfg.sampling.dtype == "bfloat16" and not cfg.model.path and not cfg.validator.limits_file:
        limits = _builtin_limits(cfg, base, train, log)
        cfg = cfg.model_copy(update={"validator": cfg.validator.model_copy(update={"limits_file": str(limits)})})
        atomic_write_text(rd.root / "config.toml", cfg.to_toml())
    run_limits(cfg, base, rd.root, published_by(rd.root))
    return cfg, base


# The built-in model's own calibration (`_builtin_limits`): enough honest groups that an int8
# cheat is banned within `--max-groups-to-ban` on the machines measured (docs/validation.md).
BUILTIN_CALIBRATION_GROUPS, BUILTIN_CHEAT_GROUPS = 1024, 64


def _builtin_limits(cfg: Config, base: Path, train: list[dict], log) -> Path:
    """The built-in base's limits file for this run's sampling on this CPU kind, measured once
    (about 2 minutes on 2 cores) and kept beside the base."""
    s = cfg.sampling
    if cfg.async_.vllm_workers or (cfg.async_.adversaries and cfg.async_.adversary_engine == "vllm"):
        raise LimitsError(
            "a bfloat16 run with vLLM workers needs a limits file that measured vLLM: run .venv-vllm/bin/swarmrl "
            f"calibrate --model {base} --dtype bfloat16 --engines builtin,vllm --group-size {s.group_size} "
            f"--max-new-tokens {s.max_new_tokens} --temperature {s.temperature} --out limits.json, then set "
            "validator.limits_file"
        )
    path = base.parent / (
        f"{base.name}.limits-bf16-g{s.group_size}-t{s.max_new_tokens}-T{s.temperature:g}-{cpu_kind()}.json"
    )
    if path.exists():
        return path
    import tempfile

    from swarmrl.validator.calibrate import calibrate, report

    log(f"calibrating the built-in model for bfloat16 on this machine, once (about 2 minutes): {path}")
    with tempfile.TemporaryDirectory(prefix="swarmrl-calibrate-") as work:
        data = calibrate(
            str(base),
            [row["prompt"] for row in train],
            dtype="bfloat16",
            engines=["builtin"],
            groups=BUILTIN_CALIBRATION_GROUPS,
            cheat_groups=BUILTIN_CHEAT_GROUPS,
            group_size=s.group_size,
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            seed=cfg.seed,
            work_dir=Path(work),
            log=log,
        )
    atomic_write_text(path, json.dumps(data))
    log(report(data))
    return path


def prepare(rd: RunDir, cfg: Config, log) -> Config:
    """The preflight and the run directory of a new run: every check that can fail fast does so here,
    with the config's own words, before a base is built or a process starts (LoRA targets the model
    lacks, a bf16 run without limits, a missing sandbox or vLLM environment); then config.toml, the
    base model, its limits file and policies/v000000. Returns the config the run uses."""
    if (rd.root / "metrics.jsonl").exists():
        raise FileExistsError(f"{rd.root} already holds a run; pass --resume to continue it, or a new --run-dir")
    cfg = _pin_model(cfg.model_copy(update={"run_dir": str(rd.root)}), log)
    # Fail here, with the config's own words, rather than in a child process later.
    _preflight(cfg)  # LoRA targets the model lacks, a bf16 run without limits: before the base is even built
    train, held_out = task_rows(cfg, log=log)
    with open_graders(train + held_out, cfg.sandbox, log=log) as graders:  # SandboxUnavailable: the fix
        for name, grader in graders.items():
            log(f"{name} tasks are graded by {grader.describe() if hasattr(grader, 'describe') else grader}")
    if cfg.async_.endpoint_workers:
        cfg = _trust_endpoint_workers(rd, cfg)
    vllm_users = cfg.async_.vllm_workers or (cfg.async_.adversaries and cfg.async_.adversary_engine == "vllm")
    if vllm_users and not Path(cfg.async_.vllm_python).expanduser().exists():
        what = (
            f"async.vllm_workers {cfg.async_.vllm_workers}"
            if cfg.async_.vllm_workers
            else 'async.adversary_engine "vllm"'
        )
        raise FileNotFoundError(
            f"{what} needs vLLM's environment, and async.vllm_python "
            f"{cfg.async_.vllm_python} does not exist: build it with `make vllm-env`, or point "
            "async.vllm_python at the python of an environment with vLLM and swarmrl installed"
        )
    if cfg.async_.tls:  # the origin's certificate goes into the run's config: the trainer reads it there
        _, cert, key = make_loopback_certificates(rd.root / "tls")
        cfg = cfg.model_copy(
            update={"broadcast": cfg.broadcast.model_copy(update={"tls_cert": str(cert), "tls_key": str(key)})}
        )
    atomic_write_text(rd.root / "config.toml", cfg.to_toml())
    cfg, base = _base_with_limits(rd, cfg, train, log)
    _check_packing_budget(cfg, train, base)
    _install_base(rd, base)
    return cfg


def run_rl(cfg: Config, *, resume: bool = False, prepare_only: bool = False, log=print) -> dict:
    t0 = time.monotonic()
    if torchrun.world_size(cfg) > 1 and not prepare_only:
        torchrun.check_node(cfg, 0)  # e.g. GPUs this machine lacks: before a base is built or a process starts
    rd = RunDir(cfg.run_dir or new_run_dir())
    if not resume:
        cfg = prepare(rd, cfg, log)
    if prepare_only:
        log(prepared_next_steps(cfg, rd.root))
        return {"run_dir": str(rd.root)}
    log(f"run directory: {rd.root}")
    children = Children(rd, log=log)
    serve_tls: list[str] = []
    if cfg.async_.tls:
        ca, cert, key = make_loopback_certificates(rd.root / "tls")
        trust_ca_file(ca)  # every child inherits the trust (SSL_CERT_FILE)
        serve_tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    interrupted = False
    try:
        (rd.root / "stop").unlink(missing_ok=True)
        fatal.clear(rd.root)
        trainer_pub(rd)  # relays and workers check versions against it, and may start before the trainer
        _endpoint_tokens(rd, cfg)
        _notes(cfg, rd, log)
        newest = rd.version_path(max(rd.versions()))
        start_children(children, children_of(cfg, rd.root, resume=resume, serve_tls=serve_tls, newest=newest), log)
        events = _Events(rd.logs / "orchestrator.log")
        with Progress(cfg, enabled=cfg.logging.progress) as progress:
            seen = 0
            while True:
                finished = children.check()
                for line in events.new():
                    progress.note(line)
                records = read_metrics(rd)
                if children.deferred and any("time/step" in r for r in records):
                    children.place_deferred()
                for r in records[seen:]:
                    progress.update(r)
                seen = len(records)
                if finished:
                    break
                time.sleep(0.25)
    except KeyboardInterrupt:
        interrupted = True
        log(f"interrupted: stopping children. Continue with: swarmrl rl --resume --run-dir {rd.root}")
    finally:
        children.stop()
    if interrupted:
        raise SystemExit(130)
    summary = write_summary(rd, cfg, time.monotonic() - t0)
    if cfg.logging.plots:
        from swarmrl.launch.plots import write_plots

        write_plots(read_metrics(rd), rd.root / "plots", cfg)
    return summary
