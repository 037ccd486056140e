"""An environment that runs in another Python: its own interpreter, its own packages.

Some environments cannot be imported beside swarmrl: PrimeIntellect's `verifiers` pins its own
transformers, cryptography and idna, and a lab's environment may need a library of its own.
`from_process(name, python, build)` makes a swarmrl `Environment` whose `respond`, `reward`,
`check` and `visible` are answered by a child process of that interpreter, started on first use
in each process that plays or replays an episode (worker, orchestrator, evaluation):

    python -m swarmrl.envs.process_child BUILD

`BUILD` is "module:function", a function that returns the `Environment`, called with the keyword
arguments `args` (JSON) and importable by that interpreter: for verifiers,
`swarmrl.envs.verifiers_v1:load` (`verifiers_v1.in_process` fills all of this in).
The child needs nothing of swarmrl but the standard-library `swarmrl.envs` package, so the source
tree on its PYTHONPATH is enough (the parent adds it). Requests and replies are JSON lines on a
private pipe (the environment's own prints go to stderr, which is forwarded to the parent's with
the environment's name in front).

Determinism is the environment's own: the trusted side replays episodes through its own child,
so the child must compute the same answers as a worker's (same package versions: pin them).
A call that takes longer than `timeout_s` kills the child (the next call starts a fresh one) and
raises, so an environment that hangs on a worker's text costs one timeout, not the server. A
process that forks after the child started (a grading pool) starts its own child rather than
sharing the pipe. Calls from several threads take turns.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from swarmrl.envs.base import Environment, Reply

SOURCE_ROOT = str(Path(__file__).resolve().parents[2])
"""The folder holding the `swarmrl` package, put on the child's PYTHONPATH."""


class EnvironmentProcessError(RuntimeError):
    """The environment's process could not start, died, or did not answer in time."""


class _Child:
    """One child process per parent process; restarted after a failure or a fork."""

    def __init__(self, name: str, python: str, build: str, args: dict, path: list[str], env: dict, timeout_s: float):
        self.name, self.python, self.build, self.path, self.env = name, python, build, path, env
        self.args = json.dumps(args)
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.pid = 0
        self.stderr_tail: deque[str] = deque(maxlen=20)
        self.reply_buffer = b""
        self.stderr_thread: threading.Thread

    def _start(self) -> None:
        paths = [SOURCE_ROOT, *self.path, os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, **self.env, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        env.pop("PYTHONHOME", None)  # the child is another installation
        self.proc = subprocess.Popen(
            [self.python, "-m", "swarmrl.envs.process_child", self.build, self.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        self.pid, self.reply_buffer = os.getpid(), b""
        self.stderr_tail.clear()
        self.stderr_thread = threading.Thread(target=self._forward_stderr, args=(self.proc,), daemon=True)
        self.stderr_thread.start()
        described = self._call_locked({"op": "describe"})
        if described.get("name") != self.name:
            self._stop()
            raise EnvironmentProcessError(
                f"{self.build} built the environment {described.get('name')!r}, not {self.name!r}: "
                "register it under the name its build function gives it"
            )

    def _forward_stderr(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            self.stderr_tail.append(line)
            print(f"[env {self.name}] {line}", file=sys.stderr, flush=True)

    def _stop(self) -> None:
        if self.proc is not None and self.pid == os.getpid():
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def _failure(self, what: str) -> EnvironmentProcessError:
        if self.proc is not None and self.proc.poll() is not None:
            self.stderr_thread.join(timeout=2)  # its last words, before they are quoted
        tail = "\n".join(list(self.stderr_tail)[-8:])
        self._stop()
        return EnvironmentProcessError(
            f"environment {self.name!r} ({self.python} -m swarmrl.envs.process_child {self.build}): {what}"
            + (f"; its last output:\n{tail}" if tail else "")
        )

    def _call_locked(self, request: dict) -> dict:
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._failure("its process exited") from None
        deadline = time.monotonic() + self.timeout_s
        fd = proc.stdout.fileno()
        while b"\n" not in self.reply_buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._failure(f"no answer to {request['op']!r} in {self.timeout_s:g} s (process killed)")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    proc.wait()
                    raise self._failure(f"its process exited with status {proc.returncode}")
                self.reply_buffer += chunk
        line, self.reply_buffer = self.reply_buffer.split(b"\n", 1)
        reply = json.loads(line)
        if not reply.get("ok"):
            raise ValueError(f"environment {self.name!r}: {reply.get('error')}")
        return reply["value"]

    def call(self, op: str, **args) -> object:
        with self.lock:
            if self.proc is None or self.pid != os.getpid() or self.proc.poll() is not None:
                if self.pid != os.getpid():
                    self.proc = None  # a forked copy: the pipe is the parent's
                self._start()
            return self._call_locked({"op": op, **args})


def from_process(
    name: str,
    python: str | os.PathLike,
    build: str,
    args: dict | None = None,
    *,
    max_turns: int = 4,
    observation_role: str = "user",
    path: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> Environment:
    """An `Environment` named `name` answered by `python -m swarmrl.envs.process_child BUILD`.

    `python` is the interpreter (e.g. ".venv-verifiers/bin/python"); `build` a "module:function"
    that returns the environment, called with the keyword arguments `args` (JSON-able); `path`
    folders added to the child's PYTHONPATH (where `build`'s module lives); `env` extra
    environment variables; `max_turns` and `observation_role` as the
    environment declares them (checked against the child's on its first start). Nothing starts
    until the environment is first used."""
    python = str(Path(python).expanduser().absolute())  # not resolve(): a venv's python is a symlink
    if not os.access(python, os.X_OK):
        raise ValueError(
            f"environment {name!r} runs in {python}, which is not an executable here: create that "
            "virtual environment (for verifiers: `make verifiers-env`) or pass its interpreter"
        )
    if build.count(":") != 1 or not all(build.split(":")):
        raise ValueError(f"environment {name!r}: build must be 'module:function', got {build!r}")
    try:
        json.dumps(args or {})
    except (TypeError, ValueError) as e:
        raise ValueError(f"environment {name!r}: args must be JSON (they are sent to its process): {e}") from None
    child = _Child(name, python, build, dict(args or {}), [str(p) for p in path], dict(env or {}), timeout_s)

    def described() -> None:
        value = child.call("describe")
        assert isinstance(value, dict)
        if value["max_turns"] != max_turns or value["observation_role"] != observation_role:
            raise EnvironmentProcessError(
                f"environment {name!r}: its process says max_turns={value['max_turns']}, "
                f"observation_role={value['observation_role']!r}; from_process was told {max_turns}, "
                f"{observation_role!r}: pass the same"
            )

    checked: list[bool] = []

    def call(op: str, **args) -> object:
        if not checked:
            described()
            checked.append(True)
        return child.call(op, **args)

    def respond(task: dict, turns: list[str], seed: int) -> Reply:
        value = call("respond", task=task, turns=list(turns), seed=seed)
        assert isinstance(value, dict)
        return Reply(value["observation"], bool(value["done"]), bool(value.get("tool_error", False)))

    def reward(task: dict, turns: list[str], seed: int) -> tuple[float, str | None]:
        value = call("reward", task=task, turns=list(turns), seed=seed)
        assert isinstance(value, list) and len(value) == 2
        return float(value[0]), value[1]

    def check(task: dict) -> str | None:
        value = call("check", task=task)
        return None if value is None else str(value)

    def visible(task: dict) -> dict:
        value = call("visible", task=task)
        assert isinstance(value, dict)
        return value

    return Environment(
        name=name,
        respond=respond,
        reward=reward,
        check=check,
        max_turns=max_turns,
        visible=visible,
        observation_role=observation_role,
    )
