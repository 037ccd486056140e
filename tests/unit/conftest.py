"""The unit tier's guard: a unit test that starts a process or opens a network socket fails,
naming what it did, so the tier stays fast and a slow test cannot drift in unnoticed.

What is refused: subprocess, os.fork/posix_spawn/exec, multiprocessing, and inet sockets that
bind, listen or connect. Unix-domain sockets stay allowed (asyncio's self-pipe and an in-process
ASGI client use them), as do threads.
"""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess

import pytest


class StartedAProcess(AssertionError):
    pass


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise StartedAProcess(
            f"a unit test {what}: move it to tests/integration/ (or test the pure "
            f"function underneath without the {what.split()[0]})"
        )

    return refused


def _guarded_socket_method(name: str, original):
    def method(self, *args, **kwargs):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise StartedAProcess(
                f"a unit test opened a network socket ({name} {args[:1]}): move it to "
                f"tests/integration/, or use an in-process ASGI client"
            )
        return original(self, *args, **kwargs)

    return method


@pytest.fixture(autouse=True)
def no_processes_or_sockets(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("started a process (subprocess)"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "execvp", "execvpe"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"started a process (os.{name})"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("started a process (multiprocessing)"))
    for name in ("bind", "listen", "connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, _guarded_socket_method(name, getattr(socket.socket, name)))
    yield


@pytest.fixture(autouse=True)
def torch_kernels_only(monkeypatch):
    """The CPU engine's C kernels are compiled in a subprocess on first use, which this tier
    refuses, but a pytest-xdist worker that ran an integration test first already holds them
    loaded: without this, a unit test would run the torch path or the C path depending on what
    its worker ran before. The unit tier checks the torch path; tests/integration/
    test_native_attention.py the C one."""
    from swarmrl.inference import native

    monkeypatch.setattr(native, "decode_attention_lib", lambda: None)
