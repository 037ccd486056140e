"""An environment in another interpreter (swarmrl/envs/process.py): a real child process of this
Python, answering over its pipe exactly as the environment answers in-process; its failures
(an exception, a hang, a death, a wrong name) reported with what to do, and the next call served
by a fresh child."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from swarmrl.envs.builtin import GUESS, secret
from swarmrl.envs.process import EnvironmentProcessError, from_process

SUPPORT = str(Path(__file__).resolve().parents[1] / "support")


def child(build: str, name: str, **kw):
    return from_process(name, sys.executable, build, path=[SUPPORT], **kw)


def test_a_process_environment_answers_as_the_environment_does_in_process():
    env = child("process_envs:guess", "guess", max_turns=6)
    task = {"low": 1, "high": 32}
    h = secret(task, 7)
    for turns in (["no idea"], [f"{h - 1}"], ["3", f"{h + 1}"], [f"{h}"]):
        assert env.respond(task, turns, 7) == GUESS.respond(task, turns, 7)
        assert env.reward(task, turns, 7) == GUESS.reward(task, turns, 7)
    assert env.check({"low": 5, "high": 5}) == GUESS.check({"low": 5, "high": 5}) is not None
    assert env.check(task) is None and env.visible(task) == task


def test_build_arguments_a_wrong_name_and_wrong_declarations_are_refused_with_the_fix():
    renamed = child("process_envs:guess", "other", args={"name": "other"}, max_turns=6)
    assert renamed.check({"low": 1, "high": 2}) is None
    with pytest.raises(EnvironmentProcessError, match="built the environment 'guess', not 'mine'"):
        child("process_envs:guess", "mine", max_turns=6).check({})
    with pytest.raises(EnvironmentProcessError, match="max_turns=6.*was told 4"):
        child("process_envs:guess", "guess").check({})
    with pytest.raises(ValueError, match="not an executable here: create that virtual environment"):
        from_process("x", "/no/such/venv/bin/python", "m:f")
    with pytest.raises(ValueError, match="build must be 'module:function'"):
        from_process("x", sys.executable, "just_a_module")
    with pytest.raises(ValueError, match="args must be JSON"):
        from_process("x", sys.executable, "m:f", {"f": object()})


def test_prints_errors_hangs_and_deaths_of_the_environment():
    env = child("process_envs:noisy", "noisy", max_turns=2, timeout_s=3)
    assert env.respond({}, ["hi"], 0).observation == "you said hi"  # its print went to stderr
    with pytest.raises(ValueError, match='KeyError: "the environment\'s own bug"'):
        env.respond({}, ["boom"], 0)
    assert env.reward({}, ["a", "b"], 0) == (0.5, "half")  # the same child goes on after its error
    with pytest.raises(EnvironmentProcessError, match="no answer to 'respond' in 3 s"):
        env.respond({}, ["hang"], 0)
    assert env.respond({}, ["a", "b"], 0).done  # a fresh child
    broken = child("process_envs:no_such_function", "noisy", max_turns=2)
    gone = "(?s)exited with status 1.*AttributeError: module .process_envs. has no attribute"
    with pytest.raises(EnvironmentProcessError, match=gone):
        broken.respond({}, ["x"], 0)


def test_a_forked_process_starts_its_own_child():
    env = child("process_envs:guess", "guess", max_turns=6)
    task = {"low": 1, "high": 32}
    assert env.check(task) is None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the forked copy must not read its parent's pipe
        ok = env.respond(task, ["1"], 7) == GUESS.respond(task, ["1"], 7)
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert env.respond(task, ["2"], 7) == GUESS.respond(task, ["2"], 7)  # the parent's child still answers
