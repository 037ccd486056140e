"""One module per `swarmrl` command, each holding the command's settings model and its `main`.

A command module defines:
  HELP          the one line `swarmrl --help` lists (DESCRIPTION, EPILOG: more for its own --help)
  Settings      a pydantic model of its flags: `run_dir` is --run-dir, the field's docstring its help
  RUN_CONFIG    where the run config comes from: "flags" (--config FILE and dotted overrides such as
                --trainer.lr 3e-7, as `swarmrl rl`), "run-dir" (<run-dir>/config.toml, written by
                `swarmrl rl --prepare`) or None (the command needs none; its --config FILE is a TOML
                file of its own settings)
  main(settings, cfg)   run the command; cfg is the run config for RUN_CONFIG = "flags", else None

`swarmrl.cli` builds the parser from these and adds --config and --dry-run to every command. The
roles themselves live in their packages (`inference.worker`, `transport.relay`, `launch.status`, ...);
a module here only turns flags into a call.
"""

from __future__ import annotations

from swarmrl.entrypoints import (
    assets,
    calibrate,
    orchestrator,
    relay,
    rl,
    score,
    serve,
    sft,
    status,
    tasks,
    trainer,
    validator,
    worker,
)
from swarmrl.entrypoints import eval as eval_command
from swarmrl.entrypoints import filter as filter_command

# In the order `swarmrl --help` lists them.
MODULES = {
    "rl": rl,
    "sft": sft,
    "score": score,
    "serve": serve,
    "eval": eval_command,
    "tasks": tasks,
    "filter": filter_command,
    "orchestrator": orchestrator,
    "trainer": trainer,
    "worker": worker,
    "status": status,
    "validator": validator,
    "calibrate": calibrate,
    "relay": relay,
    "assets": assets,
}
