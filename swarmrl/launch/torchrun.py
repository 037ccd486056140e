"""The trainer's ranks under torchrun (`python -m torch.distributed.run`, PyTorch's elastic
launcher): the command that starts one node's `trainer.nproc` ranks, each rank's own log file,
and which rank ended the run when one dies.

Rendezvous is torchrun's static one: on one node, 127.0.0.1 at a free port; on several, a TCP
store at `trainer.rdzv_endpoint` on node 0. Static (not c10d) because node rank 0 must hold
global rank 0: that rank talks to the orchestrator, serves the weights and writes the run's
files, so it has to be on the node that holds them. `swarmrl rl` runs node 0; `swarmrl trainer
--node-rank N` runs node N (docs/deploy.md).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from swarmrl.config import Config


def world_size(cfg: Config) -> int:
    return cfg.trainer.nproc * cfg.trainer.nnodes


def under_torchrun() -> bool:
    """True in a process torchrun started (a rank), which must not start torchrun again."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def rank_log(log_dir: str | Path, rank: int | str) -> Path:
    return Path(log_dir) / f"trainer-rank{rank}.log"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(cfg: Config) -> tuple[str, int]:
    """(host, port) of the static rendezvous: trainer.rdzv_endpoint, else 127.0.0.1 at a free port."""
    if cfg.trainer.rdzv_endpoint:
        host, _, port = cfg.trainer.rdzv_endpoint.rpartition(":")
        return host, int(port)  # an IPv6 host keeps its brackets, as torchrun's --master-addr wants it
    return "127.0.0.1", _free_port()


def check_node(cfg: Config, node_rank: int) -> None:
    """What only this machine can tell, before any process starts (ValueError, naming the field)."""
    t = cfg.trainer
    if not 0 <= node_rank < t.nnodes:
        raise ValueError(
            f"node rank {node_rank} is not one of the trainer's trainer.nnodes={t.nnodes} nodes (0..{t.nnodes - 1})"
        )
    if cfg.model.device.startswith("cuda"):
        import torch

        have = torch.cuda.device_count()
        if have < t.nproc:
            raise ValueError(
                f"trainer.nproc={t.nproc} ranks need one GPU each, but this machine has {have} visible "
                "CUDA devices: lower trainer.nproc, or check CUDA_VISIBLE_DEVICES"
            )


def torchrun_command(
    cfg: Config,
    *,
    node_rank: int,
    trainer_args: list[str],
    log_dir: str | Path,
    endpoint: tuple[str, int] | None = None,
) -> list[str]:
    """The command starting this node's ranks; each runs `swarmrl trainer *trainer_args` and writes
    its output to log_dir/trainer-rank<RANK>.log."""
    host, port = endpoint or rendezvous(cfg)
    t = cfg.trainer
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(t.nnodes),
        "--nproc-per-node",
        str(t.nproc),
        "--node-rank",
        str(node_rank),
        "--master-addr",
        host,
        "--master-port",
        str(port),
        # How long node 0's store waits for the other nodes to join.
        "--rdzv-conf",
        f"timeout={int(t.dist_timeout_s)}",
        "--max-restarts",
        "0",  # a dead rank ends the run (resume from a checkpoint instead)
        "-m",
        "swarmrl.cli",
        "trainer",
        *trainer_args,
        "--rank-logs",
        str(log_dir),
    ]


def rank_env(cfg: Config) -> dict[str, str]:
    """Environment for torchrun and its ranks: `async.trainer_threads` threads per rank (torchrun
    would otherwise set OMP_NUM_THREADS=1), and gloo forced when the trainer runs on CPU even
    where CUDA exists."""
    threads = str(cfg.async_.trainer_threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
    if not cfg.model.device.startswith("cuda"):
        env["SWARMRL_BACKEND"] = "gloo"
    return env


def redirect_rank_output(log_dir: str | Path) -> Path:
    """In a rank: send this process's stdout and stderr (Python's and C++'s) to its own log."""
    path = rank_log(log_dir, os.environ.get("RANK", "0"))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    env = os.environ
    print(
        f"trainer rank {env.get('RANK')} of {env.get('WORLD_SIZE')} (node {env.get('GROUP_RANK', '?')}, "
        f"local rank {env.get('LOCAL_RANK')}) on {socket.gethostname()}, pid {os.getpid()}",
        flush=True,
    )
    return path


# torchrun's failure summary (torch/distributed/elastic/multiprocessing/errors): one entry per
# rank that failed, the root cause last.
_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def rank_failures(torchrun_output: str) -> list[tuple[int, int]]:
    """(global rank, exit code) of each rank torchrun reported failed, in its order."""
    seen: dict[int, int] = {}
    for m in _FAILURE.finditer(torchrun_output):
        seen.setdefault(int(m.group(1)), int(m.group(2)))
    return list(seen.items())


def _code(code: int) -> str:
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def describe_failure(torchrun_log: Path, log_dir: Path, tail: int = 15, since: int = 0) -> str | None:
    """Which rank ended the run, its log file and the log's last lines; None when torchrun's
    output (from byte `since` of its log: this start's, not a resumed run's earlier one) names
    no failed rank (it failed before starting them).

    When one rank dies, ranks blocked in a collective with it fail too, within the same second
    (torchrun's timestamps), so torchrun's "root cause" can be a bystander. A rank killed by a
    signal (the OOM killer, kill -9, a segfault) is the cause; otherwise the first to write its
    last words (its log's modification time) is."""
    try:
        with open(torchrun_log, "rb") as f:
            f.seek(since)
            failures = rank_failures(f.read().decode(errors="replace"))
    except FileNotFoundError:
        return None
    if not failures:
        return None

    def order(item: tuple[int, int]) -> tuple[int, float]:
        rank, code = item
        log = rank_log(log_dir, rank)
        return (0 if code < 0 else 1, log.stat().st_mtime if log.exists() else float("inf"))

    failures.sort(key=order)
    rank, code = failures[0]
    log = rank_log(log_dir, rank)
    lines = log.read_text(errors="replace").strip().splitlines()[-tail:] if log.exists() else ["(no log)"]
    msg = f"trainer rank {rank} exited with {_code(code)}; its log is {log}\n  " + "\n  ".join(lines)
    others = [f"rank {r} ({_code(c)}, log {rank_log(log_dir, r)})" for r, c in failures[1:]]
    if others:
        msg += "\n  then: " + ", ".join(others)
    return msg + f"\n  (torchrun's own output: {torchrun_log})"


def rank_pids(torchrun_pid: int) -> set[int]:
    """The ranks torchrun started on this node (its child processes), for cleanup: each rank runs
    in its own session, out of reach of a signal to torchrun's process group."""
    pids: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{torchrun_pid}/task"):
            with open(f"/proc/{torchrun_pid}/task/{task}/children") as f:
                pids.update(int(p) for p in f.read().split())
    except OSError:
        pass
    return pids


def kill_ranks(pids: set[int]) -> None:
    """SIGKILL each rank still running (and its process group: rank 0's grading processes)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"swarmrl.cli" not in f.read():
                    continue  # gone, and the pid reused by something else
            os.killpg(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def run_node(cfg: Config, run_dir: str | Path, node_rank: int, trainer_args: list[str]) -> int:
    """`swarmrl trainer --node-rank N`: this node's ranks under torchrun, in the foreground. Its
    output goes to the terminal and to <run-dir>/logs/trainer-node<N>.log; returns its exit code,
    after naming the rank that died if one did."""
    check_node(cfg, node_rank)
    log_dir = Path(run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    own_log = log_dir / f"trainer-node{node_rank}.log"
    cmd = torchrun_command(cfg, node_rank=node_rank, trainer_args=trainer_args, log_dir=log_dir)
    since = own_log.stat().st_size if own_log.exists() else 0
    t = cfg.trainer
    print(
        f"trainer node {node_rank} of {t.nnodes}: {t.nproc} ranks under torchrun, rendezvous at "
        f"{cmd[cmd.index('--master-addr') + 1]}:{cmd[cmd.index('--master-port') + 1]}; rank logs "
        f"{rank_log(log_dir, '<RANK>')}",
        flush=True,
    )
    proc = subprocess.Popen(cmd, env=rank_env(cfg), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with open(own_log, "ab") as out:
            for line in proc.stdout:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                out.write(line)
                out.flush()
        code = proc.wait()
    except BaseException:  # Ctrl-C or SIGTERM: torchrun stops its ranks (SIGTERM, then SIGKILL after 30 s)
        pids = rank_pids(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
        kill_ranks(pids)
        raise
    if code != 0:
        why = describe_failure(own_log, log_dir, since=since)
        print(f"swarmrl trainer: {why or f'torchrun exited with code {code}; see {own_log}'}", file=sys.stderr)
    return code
