"""What `swarmrl rl` starts, as data: `children(cfg, root, ...)` lists every child process in the
order the launcher starts them, each with its command line, threads, niceness, CPUs and what it
waits for. `swarmrl rl --dry-run` prints it; `launcher.run_rl` starts it; tests read it.

A child's command line may hold a placeholder (`ORCHESTRATOR`, `ORIGIN`, an endpoint's) where a URL
goes that exists only once another child serves: `needs` names the file that child writes
(`{"url": ...}`) and how long to wait for it. A child with `ready` writes that file itself once it
serves, and the next child starts only then (the orchestrator, each relay, each `swarmrl serve`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from swarmrl.config import Config
from swarmrl.launch import torchrun

ORCHESTRATOR = "{orchestrator-url}"
ORIGIN = "{origin-url}"


@dataclass(frozen=True)
class Needs:
    placeholder: str
    file: Path
    """where the child that serves it writes {"url": ...}"""
    timeout_s: float


@dataclass(frozen=True)
class Child:
    name: str
    args: tuple[str, ...] = ()
    """`swarmrl ARGS` (placeholders replaced at start)"""
    threads: int = 1
    nice: int = 0
    python: str | None = None
    """another environment's python (vLLM's), default this one"""
    env: dict[str, str] | None = None
    """its whole environment, when not this process's (vLLM's thread binding)"""
    cpus: tuple[int, ...] | None = None
    """pinned there from the start (`placement`)"""
    later_cpus: tuple[int, ...] | None = None
    """moved there once the first step is trained (workers: their start overlaps the trainer's)"""
    command: tuple[str, ...] | None = None
    """a command run in place of `swarmrl ARGS` (torchrun)"""
    needs: tuple[Needs, ...] = ()
    ready: Path | None = None
    """a file it writes once it serves: waited for before the next child starts"""
    ready_timeout_s: float = 120.0

    def line(self) -> str:
        """One line for `--dry-run` and the launcher's log."""
        what = " ".join(self.command) if self.command else "swarmrl " + " ".join(self.args)
        how = [f"{self.threads} threads"]
        if self.python:
            how.append(f"python {self.python}")
        if self.nice:
            how.append(f"nice {self.nice}")
        if self.cpus:
            how.append(f"CPUs {list(self.cpus)}")
        if self.later_cpus:
            how.append(f"CPUs {list(self.later_cpus)} once a step is trained")
        return f"{self.name}: {what}  ({', '.join(how)})"


def placement(cfg: Config) -> tuple[list[int] | None, list[int] | None]:
    """(the trainer's CPUs, everyone else's) under `async.pin_trainer`, or (None, None): the
    scheduler places everything (GPU runs, several trainer ranks, or no CPU left over)."""
    if not cfg.async_.pin_trainer or cfg.model.device != "cpu" or torchrun.world_size(cfg) > 1:
        return None, None
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    n = cfg.async_.trainer_threads
    if len(cpus) <= n:
        return None, None
    return cpus[:n], cpus[n:]


def vllm_cpus(index: int, threads: int, cpus: list[int]) -> list[int]:
    """The cores vLLM worker `index` pins its `threads` threads to: its own block of the CPU set,
    wrapping around when there are more workers than blocks (they then share)."""
    if threads >= len(cpus):
        return list(cpus)
    start = (index * threads) % len(cpus)
    return [cpus[(start + k) % len(cpus)] for k in range(threads)]


def vllm_process(cfg: Config, index: int) -> dict:
    """The python and environment of vLLM worker `index` (its own cores on a CPU)."""
    from swarmrl.inference.vllm_engine import cpu_list

    env = {**os.environ}
    if cfg.model.device == "cpu":
        cpus = placement(cfg)[1] or sorted(os.sched_getaffinity(0))  # off a pinned trainer's CPUs
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(vllm_cpus(index, cfg.async_.worker_threads, cpus))
    return {"python": str(Path(cfg.async_.vllm_python).expanduser().absolute()), "env": env}


def endpoint_dir(root: Path, i: int) -> Path:
    return root / "workers" / f"worker-openai-{i}"


def children(cfg: Config, root: Path, *, resume: bool, serve_tls: list[str], newest: Path) -> list[Child]:
    """Every child of a `swarmrl rl` run in `root`, in start order: the orchestrator; the trainer
    (or torchrun's ranks); the workers, which start beside the trainer (their imports take seconds a
    first batch would wait for) and take the relays' URLs from their files once written; each
    endpoint worker after its own `swarmrl serve` (on `newest`, the newest policy folder); the
    adversaries; the relays, once the trainer's origin serves."""
    trainer_cpus, other_cpus = placement(cfg)
    again = ["--resume"] if resume else []
    orchestrator_file, origin_file = root / "orchestrator.json", root / "origin.json"
    out = [
        Child(
            "orchestrator",
            ("orchestrator", "--run-dir", str(root), *serve_tls, *again),
            cpus=_t(other_cpus),
            ready=orchestrator_file,
        )
    ]
    trainer_args = ["--run-dir", str(root), *again]
    if torchrun.world_size(cfg) == 1:
        out.append(Child("trainer", ("trainer", *trainer_args), cfg.async_.trainer_threads, cpus=_t(trainer_cpus)))
        origin_wait_s = 120.0
    else:
        command = torchrun.torchrun_command(
            cfg, node_rank=0, trainer_args=trainer_args, log_dir=root / "logs", endpoint=torchrun.rendezvous(cfg)
        )
        out.append(
            Child("trainer", threads=cfg.async_.trainer_threads, env=torchrun.rank_env(cfg), command=tuple(command))
        )
        origin_wait_s = 300.0 if cfg.trainer.nnodes == 1 else cfg.trainer.dist_timeout_s + 60.0
    # Weights: trainer (origin) -> relays -> workers, every version signed by the trainer.
    relay_files = [root / "relays" / f"relay-{i}.json" for i in range(cfg.broadcast.relays)]
    weights = ("--relay-files", ",".join(map(str, relay_files)), "--trainer-key", str(root / "trainer.pub"))
    url = Needs(ORCHESTRATOR, orchestrator_file, 120.0)

    # The run's plug-ins, on the command line: a plug-in's engine must be known before the flags are read.
    plugin_flags = tuple(arg for name in cfg.plugins for arg in ("--plugin", name))

    def worker(name: str, display: str, *extra: str, python: str | None = None, env: dict | None = None) -> Child:
        wdir = root / "workers" / name  # its own key, policy cache and outbox
        args = ("worker", *plugin_flags, "--orchestrator", ORCHESTRATOR, "--key-file", str(wdir / "key.pem"))
        args += ("--cache-dir", str(wdir), "--name", display, "--threads", str(cfg.async_.worker_threads))
        args += ("--device", cfg.model.device, "--dtype", cfg.sampling.dtype, *weights, *extra)
        # vLLM binds its own threads (VLLM_CPU_OMP_THREADS_BIND): only the others move later
        later = _t(other_cpus) if python is None else None
        threads, nice = cfg.async_.worker_threads, cfg.async_.worker_nice
        return Child(name, args, threads, nice, python, env, later_cpus=later, needs=(url,))

    engine = engine_flags(cfg)
    out += [worker(f"worker-{i}", f"worker-{i}", *engine) for i in range(cfg.async_.workers)]
    out += [
        worker(f"worker-vllm-{i}", f"worker-vllm-{i}", "--engine", "vllm", **vllm_process(cfg, i))
        for i in range(cfg.async_.vllm_workers)
    ]
    for i in range(cfg.async_.endpoint_workers):
        wdir = endpoint_dir(root, i)
        token, url_file = wdir / "reload.token", wdir / "serve.json"
        serve = ("serve", "--model", str(newest), "--port", "0", "--url-file", str(url_file))
        serve += ("--reload-token-file", str(token), "--dtype", cfg.sampling.dtype, "--device", cfg.model.device)
        serve += ("--served-model-name", "policy", "--threads", str(cfg.async_.worker_threads))
        out.append(Child(f"serve-{i}", serve, cfg.async_.worker_threads, cfg.async_.worker_nice, ready=url_file))
        endpoint = f"{{serve-{i}-url}}"
        extra = ("--engine", "openai", "--endpoint", endpoint, "--endpoint-key-file", str(token), "--load", "reload")
        w = worker(f"worker-openai-{i}", f"worker-openai-{i}", *extra)
        out.append(Child(**{**w.__dict__, "needs": (url, Needs(endpoint, url_file, 120.0))}))
    on_vllm = cfg.async_.adversary_engine == "vllm"
    for i, kind in enumerate(cfg.async_.adversaries):
        name, display = f"adversary-{i}", f"adversary-{i}-{kind}"
        if on_vllm:  # after the honest vLLM workers' cores
            extra_process = vllm_process(cfg, cfg.async_.vllm_workers + i)
            out.append(worker(name, display, "--adversary", kind, "--engine", "vllm", **extra_process))
        else:
            out.append(worker(name, display, "--adversary", kind))
    for i, url_file in enumerate(relay_files):
        relay = ("relay", "--upstream", ORIGIN, "--cache-dir", str(root / "relays" / f"relay-{i}"))
        relay += ("--trainer-key", str(root / "trainer.pub"), "--keep", str(cfg.broadcast.keep), "--url-file")
        relay += (str(url_file), *serve_tls)
        needs = (Needs(ORIGIN, origin_file, origin_wait_s),)
        out.append(Child(f"relay-{i}", relay, cpus=_t(other_cpus), needs=needs, ready=url_file))
    return out


def engine_flags(cfg: Config) -> tuple[str, ...]:
    """`--engine NAME` and its options' flags for the run's `async.workers` (nothing for the
    default built-in engine without options); ValueError when the engine is not registered, does
    not prove its work, or refuses its options."""
    from swarmrl.inference import backends

    name, options = cfg.async_.worker_engine, cfg.async_.worker_engine_options
    backend = backends.get(name)
    if not backend.proves:
        raise ValueError(
            f"async.worker_engine = {name!r} builds no proofs, so its groups are fraud from an untrusted key: "
            "use async.endpoint_workers for a trusted server, or a proving engine"
        )
    checked = backend.options.model_validate(options)  # ValidationError names the field
    if name == "builtin" and not options:
        return ()
    flags = ["--engine", name]
    for field in options:
        value = getattr(checked, field)
        flag = "--" + (backend.prefix + field).replace("_", "-")
        flags += [flag] if value is True else [] if value is False else [flag, str(value)]
    return tuple(flags)


def _t(cpus: list[int] | None) -> tuple[int, ...] | None:
    return tuple(cpus) if cpus else None
