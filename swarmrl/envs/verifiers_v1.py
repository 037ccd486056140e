"""Environments of verifiers' current API (`verifiers.v1`: the whole of verifiers 0.4, also
shipped in 0.3.x) as swarmrl environments. swarmrl/envs/verifiers_env.py adapts the older
`MultiTurnEnv` (0.1.8-0.3.x); this module adapts a `vf.Env` whose `async run(task, agents)` drives
one model seat through `interaction.turn(message)` (docs/environments.md, "verifiers 0.4").

swarmrl's trusted side replays an episode from its task and the model's turns alone, so both
functions replay: they call the environment's own `setup` and `run` with a stand-in seat whose
`turn()` answers with the recorded model turns, one per call, and

- `respond` returns the message `run` sends after the last recorded turn (the observation), or
  done when `run` ends, a seat limit (`max_turns`) or a `@vf.stop` on the trace refuses the turn;
- `reward` replays the whole transcript, runs the task's scoring (its `@vf.metric` and
  `@vf.reward` hooks) and the environment's `finalize`, and returns the trace's weighted reward.

What it refuses when the environment is adapted (`from_verifiers_v1` raises ValueError): more
than one seat (self-play, a model playing the user). What it cannot see: a `run` or a reward that
reads clocks, the network or unseeded randomness (its observations differ on the trusted side, and
its workers are refused as `observation_mismatch`), rewards that need a runtime (verifiers skips
them when scoring without one) and judges. It builds on verifiers' internals (the Env's task class
and seat specs, the trace's message graph): checked against 0.3.1's `verifiers.v1` in CI and
0.4.0 by hand (docs/environments.md). O(turns^2) `run` calls per episode, as the older adapter.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

from swarmrl.envs.base import Environment, Reply

DEFAULT_MAX_TURNS = 4
EXHAUSTED = "swarmrl_turns_exhausted"  # the stop condition of a replay that ran out of model turns


def _vf():
    import verifiers.v1 as vf

    return vf


def _text(message) -> str:
    """The text of what `run` sends a seat: a string, or messages (dicts or message objects)."""
    from verifiers.v1.dialects import parse_message
    from verifiers.v1.types import content_text

    if message is None:
        return ""
    if isinstance(message, str):
        return message
    parts = [content_text((parse_message(m) if isinstance(m, dict) else m).content) for m in message]
    return "\n".join(p for p in parts if p)


class _Script:
    """One replayed interaction: `turn(message)` commits `message` and answers with the next model
    turn, as verifiers' own interaction does; with no model turn left it keeps `message` as the
    observation and ends the trace, as a turn limit would, so `run` finishes along its own path."""

    def __init__(self, task, turns: list[str], max_turns: int | None):
        from verifiers.v1.state import state_cls

        vf = _vf()
        self.turns, self.used, self.max_turns = list(turns), 0, max_turns
        self.observation, self.asked, self.over = None, False, False
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig(model="swarmrl-replay")),
            state=state_cls(type(task))(),
        )
        data = task.data
        if data.system_prompt:
            self._add(vf.SystemMessage(content=data.system_prompt))
        for message in [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else data.prompt or []:
            self._add(message)
        self.stops = task.hooks("stop")

    def _add(self, message, sampled: bool = False) -> None:
        from verifiers.v1.graph import MessageNode

        n = len(self.trace.nodes)
        self.trace.nodes.append(MessageNode(parent=n - 1 if n else None, message=message, sampled=sampled))

    async def _refused(self) -> str | None:
        """What verifiers checks before serving a model call: the seat's turn limit, then the
        trace's stop hooks."""
        if self.max_turns is not None and self.trace.num_turns >= self.max_turns:
            return "max_turns"
        for stop in self.stops:
            hit = stop(self.trace)
            if asyncio.iscoroutine(hit):
                hit = await hit
            if hit:
                return stop.__name__
        return None

    async def turn(self, message=None):
        from verifiers.v1.dialects import parse_message

        vf = _vf()
        if self.over:
            raise RuntimeError("the interaction is over (the episode ended)")
        refused = await self._refused()
        if refused is None and self.used >= len(self.turns):
            self.asked, self.observation = True, message
        if refused is not None or self.used >= len(self.turns):
            self.trace.stop(refused or EXHAUSTED)
            self.over = True
            return vf.Segment(messages=[], terminated=True)
        if message is not None:
            sent = [vf.UserMessage(content=message)] if isinstance(message, str) else message
            for m in sent:
                self._add(parse_message(m) if isinstance(m, dict) else m)
        reply = vf.AssistantMessage(content=self.turns[self.used])
        self.used += 1
        self._add(reply, sampled=True)
        return vf.Segment(messages=[reply])


class _Seat:
    """The one model seat `run` plays with (`agents.<seat>`)."""

    def __init__(self, turns: list[str], max_turns: int | None, score: bool):
        self.turns, self.max_turns, self.score, self.scripts = turns, max_turns, score, []
        self.trainable = True

    @asynccontextmanager
    async def interaction(self, task, **_):
        if self.scripts:
            raise NotImplementedError("swarmrl replays one interaction per episode (its model's)")
        script = _Script(task, self.turns, self.max_turns)
        self.scripts.append(script)
        try:
            yield script
        finally:
            if not script.trace.stop_condition:
                script.trace.stop("user_closed")
            if self.score:
                await task.score(script.trace, None)
            script.trace.is_completed = script.trace.ok = True

    async def run(self, task, **_):  # a single-turn seat (SingleAgentEnv.run: agents.agent.run(task))
        async with self.interaction(task) as script:
            await script.turn()
        return script.trace


class _Agents:
    def __init__(self, name: str, seat: _Seat):
        self._name, self._seat = name, seat

    def __getattr__(self, name: str):
        if name.startswith("_") or name != self._name:
            raise AttributeError(f"the environment asked for seat {name!r}; swarmrl plays one seat, {self._name!r}")
        return self._seat


def _seat_of(env) -> tuple[str, int | None]:
    specs = dict(env._agent_specs)
    if len(specs) != 1:
        raise ValueError(
            f"{type(env).__name__} has {len(specs)} seats ({', '.join(specs)}): swarmrl plays one model seat; "
            "self-play and model-played users cannot be replayed by the trusted side"
        )
    ((name, spec),) = specs.items()
    return name, getattr(spec, "max_turns", None)


async def _replay(env, row: dict, turns: list[str], *, score: bool) -> _Script:
    task_cls = env._task_cls
    task = task_cls(task_cls.data_type().model_validate(row), env.taskset.config.task)
    name, max_turns = _seat_of(env)
    seat = _Seat(turns, max_turns, score)
    agents = _Agents(name, seat)
    await env.setup(agents)
    await env.run(task, agents)
    if not seat.scripts:
        raise ValueError(f"{type(env).__name__}.run never opened an interaction with seat {name!r}")
    (script,) = seat.scripts
    if score:
        vf = _vf()
        episode = vf.Episode(env=vf.EnvInfo(id=env.config.env_id), task=script.trace.task, traces=[script.trace])
        await env.finalize(task, episode)
    return script


def from_verifiers_v1(env, name: str, *, max_turns: int | None = None) -> Environment:
    """A swarmrl `Environment` named `name` that plays `env`, a `verifiers.v1` Env with one seat."""
    _, seat_turns = _seat_of(env)

    def respond(task: dict, turns: list[str], seed: int) -> Reply:
        script = asyncio.run(_replay(env, task, turns, score=False))
        ended = not script.asked or script.used < len(turns)
        text = "" if ended else _text(script.observation)
        return Reply(text, done=ended or not text)

    def reward(task: dict, turns: list[str], seed: int) -> tuple[float, str | None]:
        trace = asyncio.run(_replay(env, task, turns, score=True)).trace
        value = float(trace.reward or 0.0)
        return value, None if value > 0 else f"the task's rewards gave 0 (stopped: {trace.stop_condition})"

    def check(task: dict) -> str | None:
        try:
            env._task_cls.data_type().model_validate(task)
        except ValueError as e:
            return f"not a row of {type(env).__name__}'s tasks: {str(e).splitlines()[0]}"
        return None

    limit = max_turns or seat_turns or DEFAULT_MAX_TURNS
    return Environment(name, respond, reward, check=check, max_turns=limit)


def rows_v1(env, name: str) -> list[dict]:
    """The environment's tasks as swarmrl task rows (task_type "env:NAME"): the prompt is the
    task's prompt (its last user message), the verification_info the task's data as JSON. A task
    without a prompt (the environment speaks first) opens with what `run` sends before any model
    turn."""
    out = []
    for i, task in enumerate(env.taskset):
        data = task.data.model_dump(mode="json", exclude_none=True)  # exclude_defaults loses message roles
        prompt = task.data.prompt
        if isinstance(prompt, str):
            text = prompt
        elif prompt:
            text = _text([m for m in prompt if getattr(m, "role", None) == "user"][-1:])
        else:
            text = _text(asyncio.run(_replay(env, data, [], score=False)).observation)
        out.append(
            {
                "problem_id": f"{name}-{getattr(task.data, 'id', None) or i}",
                "task_type": f"env:{name}",
                "prompt": text,
                "verification_info": json.dumps(data),
            }
        )
    return out


def load(name: str, config: dict, max_turns: int | None = None) -> Environment:
    """The verifiers environment `config` names (as `vf.resolve_env_config` takes it, e.g.
    {"taskset": {"id": "my_env", ...}}), loaded as verifiers loads environments and adapted:
    the build function `in_process` gives its child."""
    vf = _vf()
    return from_verifiers_v1(vf.load_environment(vf.resolve_env_config(config)), name, max_turns=max_turns)


def in_process(
    name: str,
    config: dict,
    *,
    python: str = ".venv-verifiers/bin/python",
    max_turns: int = DEFAULT_MAX_TURNS,
    path: list[str] | tuple[str, ...] = (),
    timeout_s: float = 30.0,
) -> Environment:
    """The verifiers environment `config` names, run by `python` (a virtual environment with
    verifiers and the environment's package installed) in a process of its own
    (swarmrl/envs/process.py), for a run whose own venv cannot import verifiers. Register it in
    a plug-in; `python -m swarmrl.envs.verifiers_v1 NAME CONFIG`, run by that interpreter, writes
    its task rows."""
    from swarmrl.envs.process import from_process

    args = {"name": name, "config": config, "max_turns": max_turns}
    return from_process(
        name, python, "swarmrl.envs.verifiers_v1:load", args, max_turns=max_turns, path=path, timeout_s=timeout_s
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m swarmrl.envs.verifiers_v1 NAME CONFIG`: the environment's tasks as swarmrl task
    rows (JSONL on stdout), for `tasks.source`."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m swarmrl.envs.verifiers_v1 NAME CONFIG_JSON > rows.jsonl")
    vf = _vf()
    env = vf.load_environment(vf.resolve_env_config(json.loads(args[1])))
    for row in rows_v1(env, args[0]):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
