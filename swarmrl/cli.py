"""The `swarmrl` command: one subcommand per module of `swarmrl.entrypoints`; `swarmrl --help` lists them.

Every subcommand's flags are its module's settings model, plus three for all of them: `--config FILE`
(the run config for the commands that build one, as `swarmrl rl`; otherwise a TOML file of the
command's own settings, which its flags override), `--dry-run` (print what the command would run
with, checked, and exit 0 without starting anything) and `--plugin MODULE` (imported before the
flags are read, so a plug-in's engine or task source can be named by them: docs/plugins.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from types import ModuleType

from pydantic import BaseModel, ValidationError

from swarmrl import plugins
from swarmrl.config import Config
from swarmrl.entrypoints import MODULES
from swarmrl.entrypoints.common import CaFileSettings, fail, run_config, run_dir_config
from swarmrl.entrypoints.flags import (
    add_settings_flags,
    comment_out,
    explain,
    missing_flags,
    read_settings_file,
    settings_toml,
)
from swarmrl.errors import SwarmrlError

COMMANDS = {name: module.HELP for name, module in MODULES.items()}

SETTINGS_FILE_HELP = (
    'TOML file of this command\'s settings, keyed by the flag names (e.g. cache_dir = "D"); '
    "flags given here win. --dry-run prints one"
)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `swarmrl` parser and each command's subparser (for errors phrased as its usage)."""
    parser = argparse.ArgumentParser(prog="swarmrl", description="Asynchronous GRPO over verifiable rewards.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parsers = {}
    for name, module in MODULES.items():
        from_flags = module.RUN_CONFIG == "flags"
        sp = sub.add_parser(
            name,
            help=module.HELP,
            description=getattr(module, "DESCRIPTION", module.HELP),
            epilog=getattr(module, "EPILOG", None),
        )
        sp.add_argument("--config", metavar="FILE", help=module.CONFIG_HELP if from_flags else SETTINGS_FILE_HELP)
        # Required flags are enforced by argparse only where they cannot come from a settings file.
        add_settings_flags(sp, module.Settings, groups=getattr(module, "GROUPS", None), required=from_flags)
        sp.add_argument(
            plugins.FLAG,
            metavar="MODULE",
            action="append",
            help="import this plug-in first (repeat for several): a module that registers task sources, environments, "
            "engines or task types (docs/plugins.md)"
            + ("; added to the run config's plugins, so every role of the run imports it" if from_flags else ""),
        )
        sp.add_argument(
            "--dry-run",
            action="store_true",
            help="print the resolved config and exit"
            if from_flags
            else "print the resolved settings (as a --config file) and exit without starting anything",
        )
        parsers[name] = sp
    return parser, parsers


def _check_overrides(name: str, module: ModuleType, parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Words argparse did not take are dotted config overrides, for the commands that build a run
    config (and only the sections they use); anything else is an unknown argument."""
    if module.RUN_CONFIG != "flags":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return
    sections = getattr(module, "OVERRIDE_SECTIONS", None)
    if sections and any(a.startswith("--") and not a.startswith(tuple(f"--{s}." for s in sections)) for a in extra):
        parser.error(
            f"unrecognized arguments: {' '.join(extra)} ({name} takes "
            f"{' and '.join(f'--{s}.FIELD' for s in sections)} overrides only)"
        )


def resolve(
    name: str, args: argparse.Namespace, extra: list[str], parser: argparse.ArgumentParser
) -> tuple[BaseModel, Config | None]:
    """The command's settings (its settings file, then its flags) and run config, checked."""
    module = MODULES[name]
    _check_overrides(name, module, parser, extra)
    values = {k: v for k, v in vars(args).items() if k in module.Settings.model_fields}
    if args.config and module.RUN_CONFIG != "flags":
        try:
            values = {**read_settings_file(args.config, module.Settings), **values}
        except ValueError as e:
            fail(str(e))
    try:
        settings = module.Settings(**values)
    except ValidationError as e:
        if missing := missing_flags(e, module.Settings):
            parser.error(f"the following arguments are required: {', '.join(missing)}")
        fail(explain(e, module.Settings))
    cfg = None
    if module.RUN_CONFIG == "flags":
        cfg = run_config(args.config, extra, getattr(settings, "run_dir", None))
        # `--plugin` on the command line joins the run's plug-ins: every role of the run imports it.
        named = [p for p in plugins.loaded() if p not in cfg.plugins]
        if named:
            cfg = cfg.model_copy(update={"plugins": [*cfg.plugins, *named]})
    return settings, cfg


def dry_run(name: str, settings: BaseModel, cfg: Config | None) -> str:
    """What `--dry-run` prints: a file the command takes as --config, the rest as comments."""
    kind = MODULES[name].RUN_CONFIG
    notes = getattr(MODULES[name], "dry_run_notes", None)  # what else the command would do (rl: its processes)
    if kind == "flags":
        text = f"# swarmrl {name} settings:\n{settings_toml(settings, commented=True)}{cfg.to_toml(show_unset=True)}"
        return text + (notes(settings, cfg) if notes else "")
    text = settings_toml(settings)
    if kind == "run-dir":
        run_dir = settings.run_dir
        run = run_dir_config(
            run_dir, f"{run_dir} has no config.toml: prepare the run first (swarmrl rl --prepare --run-dir {run_dir})"
        )
        text += f"\n# The run's config, {os.path.join(run_dir, 'config.toml')}:\n{comment_out(run.to_toml())}"
    return text


def _quiet_libraries() -> None:
    import logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("httpx", "httpcore"):  # one line per request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # plug-ins first: they may register the engines and sources the flags below name
        named, argv = plugins.split_argv(argv)
        if argv[:2] == ["tasks", "filter"]:  # the spelling docs/usage.md uses for `swarmrl filter`
            argv = ["filter", *argv[2:]]
        plugins.load(named, where=plugins.FLAG)
    except SwarmrlError as e:
        fail(str(e))
    parser, parsers = build_parser()
    args, extra = parser.parse_known_args(argv)
    settings, cfg = resolve(args.command, args, extra, parsers[args.command])
    if args.dry_run:
        print(dry_run(args.command, settings, cfg))
        return
    _quiet_libraries()
    # Roles started by the launcher exit cleanly (finally blocks run, pools close) on SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from swarmrl.protocol.tls import trust_ca_file

    try:
        if isinstance(settings, CaFileSettings) and settings.ca_file:
            trust_ca_file(settings.ca_file)
        MODULES[args.command].main(settings, cfg)
    except SwarmrlError as e:  # meant for the user (TLS, refusals, broadcast failures): one line, no traceback
        fail(str(e))


if __name__ == "__main__":
    main()
