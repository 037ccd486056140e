"""What tests of real processes share: a free port, waiting for a condition with the process's log
at hand, a `swarmrl` command run in the background (RunHandle), and read-only views of what a run
leaves behind (its store, its metrics).

A wait that fails says what it waited for and shows the end of the log; a process that died while
it was waited for fails the wait at once, with its exit code, instead of after the timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from swarmrl.orchestrator.store import Store

TAIL = 3000  # characters of a log shown with a failure


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (another process could take it before
    the test binds it; the kernel hands out ephemeral ports in turn, which makes that rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(log: Path | str | Callable[[], str] | None, n: int = TAIL) -> str:
    """The last `n` characters of a log: a file, its text, or a function returning its text."""
    if log is None:
        return ""
    if callable(log):
        text = log()
    elif isinstance(log, Path):
        text = log.read_text(errors="replace") if log.exists() else f"({log} does not exist)"
    else:
        text = log
    return text[-n:]


def wait_for(
    condition: Callable[[], Any],
    timeout: float,
    what: str,
    *,
    proc: subprocess.Popen | None = None,
    log: Path | str | Callable[[], str] | None = None,
    every: float = 0.05,
) -> Any:
    """Poll `condition` until it returns something truthy, and return that. Fails with `what` and
    the tail of `log` after `timeout` seconds, or at once if `proc` exits before the condition holds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            value = condition()  # it may have done it on its way out
            if value:
                return value
            raise AssertionError(f"waiting for {what}: the process exited with code {proc.returncode}\n{tail(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"waiting for {what}: not within {timeout:g} s\n{tail(log)}")
        time.sleep(every)


def read_url_file(path: Path) -> str | None:
    """The URL a role wrote to its info file (`orchestrator.json`, a relay's `--url-file`), once written."""
    return json.loads(path.read_text())["url"] if path.exists() else None


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 never goes through a proxy


def answers(url: str) -> bool:
    """Whether a GET of `url` returns 200 now."""
    try:
        with _DIRECT.open(url, timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (metrics.jsonl, consumed.jsonl); none before it exists."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def metrics(run: Path) -> list[dict]:
    return read_jsonl(run / "metrics.jsonl")


def train_steps(run: Path) -> list[dict]:
    """The trainer's per-step records (the others are evaluations)."""
    return [r for r in metrics(run) if "time/step" in r]


@contextmanager
def run_store(run: Path) -> Iterator[Store]:
    """The orchestrator's store of a run, read-only: safe beside the live orchestrator."""
    store = Store.read_only(run / "orchestrator.sqlite")
    try:
        yield store
    finally:
        store.close()


def store_rows(run: Path, sql: str, args: tuple = ()) -> list[tuple]:
    """One read-only query of a run's store, as tuples (comparable with literals)."""
    with run_store(run) as store:
        return [tuple(r) for r in store.query(sql, args)]


def pids(pattern: str) -> list[str]:
    """The processes whose command line matches `pattern` (pgrep -f)."""
    return subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()


def processes_of(run: Path) -> list[str]:
    """Every process of a run: each role, torchrun and its ranks have the run folder on their
    command line (workers through --cache-dir). Half a second first: a child the launcher has
    just reaped may still be listed."""
    time.sleep(0.5)
    return pids(f"swarmrl.cli .*{run}")


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sends before it closes the connection (b"" if it closes without a word);
    raises TimeoutError if it is still open after `timeout_s`."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


@contextmanager
def dripping(sock: socket.socket, data: bytes, every: float) -> Iterator[None]:
    """A slow client: `data` sent a byte every `every` seconds from a thread while the block runs
    (until the peer closes); then the thread is stopped and the socket closed."""
    stop = threading.Event()

    def drip() -> None:
        for byte in data:
            if stop.wait(every):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                return

    dripper = threading.Thread(target=drip)
    dripper.start()
    try:
        yield
    finally:
        stop.set()
        dripper.join()
        sock.close()


def verdicts(run: Path, worker: str | None = None) -> list[dict]:
    """The validator's verdicts stored with the groups of a run (of one worker's key), oldest first."""
    sql = "SELECT verdict FROM groups WHERE verdict IS NOT NULL"
    if worker is None:
        return [json.loads(v) for (v,) in store_rows(run, sql + " ORDER BY id")]
    return [json.loads(v) for (v,) in store_rows(run, sql + " AND worker = ? ORDER BY id", (worker,))]


def judged(client, timeout_s: float) -> dict:
    """A worker's record (`client.me()`, a WorkerClient's) once nothing it submitted awaits the validator."""
    last: list[dict] = []

    def done() -> dict | None:
        last[:] = [client.me()]
        return None if last[0]["awaiting_validation"] else last[0]

    return wait_for(done, timeout_s, "validation to finish", log=lambda: f"the worker's record: {last}", every=0.1)


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a `swarmrl` child: one OpenMP thread (two contend for a free core on a
    shared 2-core box), and not the launcher's marker (a role started by hand is not its child)."""
    env = {k: v for k, v in os.environ.items() if k != "SWARMRL_LAUNCHER_PID"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


class RunHandle:
    """`swarmrl <args>` in the background, its stdout in `log` (and its stderr too, unless
    `stderr_log` keeps it apart), in a session of its own so that stop() reaches every child.

    A context manager: leaving it stops the process (stop()); if the block raised, whatever the
    process left running is killed too and the end of its log printed, so a failed test shows what
    the run said and leaves nothing behind."""

    def __init__(
        self,
        *args: str,
        log: Path,
        stderr_log: Path | None = None,
        run: Path | None = None,
        env: dict[str, str] | None = None,
    ):
        self.args, self.log, self.stderr_log, self.run = args, log, stderr_log, run
        self.env = env or cli_env()
        self.proc: subprocess.Popen | None = None

    @classmethod
    def rl(cls, run: Path, base: Path, steps: int, *args: str, log: Path | None = None, **kw) -> RunHandle:
        """`swarmrl rl` of `steps` steps from `base` into `run`, logging beside the run folder."""
        argv = ("rl", "--run-dir", str(run), "--model.path", str(base), "--trainer.steps", str(steps), *args)
        return cls(*argv, log=log or run.with_name(run.name + ".log"), run=run, **kw)

    def start(self) -> RunHandle:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            err = open(self.stderr_log, "ab") if self.stderr_log else None
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "swarmrl.cli", *self.args],
                    stdout=out,
                    stderr=err or subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
            finally:
                if err:
                    err.close()
        return self

    def __enter__(self) -> RunHandle:
        return self if self.proc else self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(kill_session=exc_type is not None)
        if exc_type is not None:
            print(f"--- swarmrl {' '.join(self.args[:1])}: the end of its log\n{self.tail()}")

    # ---- what it said --------------------------------------------------------------------------
    def out(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def err(self) -> str:
        """Its stderr (its whole log, when stderr was not kept apart)."""
        if self.stderr_log is None:
            return self.out()
        return self.stderr_log.read_text(errors="replace") if self.stderr_log.exists() else ""

    def tail(self, n: int = TAIL) -> str:
        text = self.out()[-n:]
        return text + (f"\n--- stderr\n{self.err()[-n:]}" if self.stderr_log else "")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ---- waiting -------------------------------------------------------------------------------
    def wait_for(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        """harness.wait_for, failing at once if this process exits, with its log."""
        return wait_for(condition, timeout, what, proc=self.proc, log=self.tail)

    def wait_for_line(self, pattern: str, timeout: float, *, path: Path | None = None) -> re.Match:
        """The first match of `pattern` in the log (or in another file, `path`: a role's own log)."""

        def search() -> re.Match | None:
            if path is None:
                return re.search(pattern, self.out() + (self.err() if self.stderr_log else ""))
            return re.search(pattern, path.read_text(errors="replace")) if path.exists() else None

        return self.wait_for(search, timeout, f"/{pattern}/ in {path or self.log}")

    def wait_for_file(self, path: Path, timeout: float) -> Path:
        return self.wait_for(lambda: path.exists() and path, timeout, f"{path} to appear")

    def wait_for_url(self, info_file: Path, timeout: float, *, health: str | None = "/healthz") -> str:
        """The URL the process announced in `info_file`, once `health` answers 200 there (the file
        is written as the server starts listening; the first request may still be refused)."""
        url = self.wait_for(lambda: read_url_file(info_file), timeout, f"the URL in {info_file}")
        if health is not None:
            self.wait_for(lambda: answers(url + health), timeout, f"{url}{health} to answer 200")
        return url

    def wait(self, timeout: float) -> int:
        """Its exit code, once it exits within `timeout` seconds."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"swarmrl {self.args[0]} still running after {timeout:g} s\n{self.tail()}") from None

    # ---- what it left --------------------------------------------------------------------------
    def _run(self) -> Path:
        assert self.run is not None, "RunHandle(run=...) names the run folder"
        return self.run

    def metrics(self) -> list[dict]:
        return metrics(self._run())

    def steps(self) -> list[dict]:
        return train_steps(self._run())

    def store(self):
        return run_store(self._run())

    # ---- stopping ------------------------------------------------------------------------------
    def kill9(self) -> None:
        """SIGKILL to its whole session at once: a crash, not a stop."""
        if self.alive:
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, grace: float = 30, *, kill_session: bool = False) -> None:
        """SIGTERM (a launcher stops its children on it), and SIGKILL to its whole session if it is
        still there after `grace` s. With `kill_session` (a failed test), whatever it left running
        goes too; otherwise what it leaves behind is for the test to find."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                kill_session = True
        if kill_session:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
