"""The child side of swarmrl/envs/process.py: `python -m swarmrl.envs.process_child MODULE:FUNCTION ARGS`.

Builds the environment by calling the function with ARGS (a JSON object) as keywords, then
answers one JSON request per line on the pipe it was started with: a request is
{"op": "describe" | "respond" | "reward" | "check" | "visible", ...}, its answer
{"ok": true, "value": ...} or {"ok": false, "error": "..."}. The protocol keeps the original
stdout to itself; anything the environment prints goes to stderr. Standard library only.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from swarmrl.envs.base import Environment


def _build(target: str, args: dict) -> Environment:
    module, _, function = target.partition(":")
    env = getattr(importlib.import_module(module), function)(**args)
    if not isinstance(env, Environment):
        raise TypeError(f"{target} returned {type(env).__name__}, not a swarmrl.envs.base.Environment")
    return env


def _answer(env: Environment, request: dict) -> object:
    op = request["op"]
    if op == "describe":
        return {"name": env.name, "max_turns": env.max_turns, "observation_role": env.observation_role}
    if op == "respond":
        reply = env.respond(request["task"], request["turns"], request["seed"])
        return {"observation": reply.observation, "done": reply.done, "tool_error": reply.tool_error}
    if op == "reward":
        value, reason = env.reward(request["task"], request["turns"], request["seed"])
        return [float(value), reason]
    if op == "check":
        return env.check(request["task"])
    if op == "visible":
        return env.visible(request["task"])
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the environment's own prints (and its libraries' logs) go to stderr
    sys.stdout = sys.stderr
    env = _build(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    print(f"environment {env.name!r} built by {sys.argv[1]} in {sys.executable} (pid {os.getpid()})", file=sys.stderr)
    for line in sys.stdin:
        try:
            reply = {"ok": True, "value": _answer(env, json.loads(line))}
        except Exception as e:  # the environment's error, for the parent to report
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        protocol.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
