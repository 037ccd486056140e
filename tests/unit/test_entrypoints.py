"""The `swarmrl` commands' settings models and the dispatcher built from them, in-process: argv to
settings, --dry-run, settings files, and errors that name the flag. Nothing here starts a process
or opens a socket (tests/test_cli.py runs the command as a user would)."""

from __future__ import annotations

import tomllib

import pytest

from swarmrl import cli
from swarmrl.config import load_config
from swarmrl.entrypoints import MODULES
from swarmrl.entrypoints.flags import RoleSettings

# Every flag each command took before the entrypoints package (cli.py at 7c62974, 123 flags), so
# that no spelling is lost; --config and --dry-run are on every command now.
FLAGS = {
    "rl": "--config --run-dir --resume --dry-run --prepare",
    "sft": "--config --output --dry-run",
    "score": "--input --output --tokenizer --length-mode --length-coef --workers --timeout --config --allow-errors",
    "serve": "--model --host --port --served-model-name --device --dtype --tls-cert --tls-key --engine --max-batch "
    "--max-batch-rows --batch-window-ms --max-n --max-request-kb --default-max-tokens --threads --url-file "
    "--reload-token-file",
    "eval": "--model --endpoint --served-model --api-key --benchmark --format --limit --k --temperature --max-tokens "
    "--length-target --seed --output-dir --concurrency --device --dtype --streams --workers --config",
    "tasks": "--output --kind --completions --n --digits --ops --split --seed",
    "orchestrator": "--run-dir --host --port --resume --tls-cert --tls-key",
    "trainer": "--run-dir --resume --orchestrator --ca-file --token-file --node-rank --rank-logs",
    "worker": "--orchestrator --ca-file --insecure --run-id --key-file --cache-dir --name --threads --streams --device "
    "--dtype --relays --trainer-key --engine --endpoint --endpoint-key-file --served-model --load "
    "--server-command --endpoint-dtype --concurrency --adversary",
    "status": "--orchestrator --json --steps --workers --watch --ca-file",
    "validator": "--orchestrator --token-file --cache-dir --threads --device --dtype --relays --ca-file --trainer-key",
    "relay": "--upstream --cache-dir --host --port --keep --trainer-key --startup-tries --url-file --max-bytes-per-s "
    "--tls-cert --tls-key --ca-file",
    "assets": "--cache --wheels --force --gguf --output --dtype",
    "filter": "--input --output --model --endpoint --band --k --temperature --max-tokens --seed --limit --format "
    "--extract",
    "calibrate": "--model --dtype --engines --prompts --groups --cheat-groups --group-size --max-new-tokens "
    "--temperature --max-batch --batch-groups --threads --false-ban-rate --horizon --max-groups-to-ban --seed "
    "--measured --out",
}

# The least each command needs to resolve its settings.
MINIMAL = {
    "rl": [],
    "sft": [],
    "score": ["--input", "in.jsonl", "--output", "out.jsonl"],
    "serve": ["--model", "m"],
    "eval": ["--model", "m", "--benchmark", "arithmetic", "--output-dir", "o"],
    "tasks": ["--output", "t.jsonl"],
    "orchestrator": ["--run-dir", "RUN"],
    "trainer": ["--run-dir", "RUN"],
    "worker": ["--orchestrator", "http://127.0.0.1:8000"],
    "status": ["--orchestrator", "http://127.0.0.1:8000"],
    "validator": ["--orchestrator", "http://127.0.0.1:8000", "--token-file", "tok"],
    "relay": ["--upstream", "http://127.0.0.1:8001", "--cache-dir", "c"],
    "assets": ["--cache", "c"],
    "filter": ["--input", "rows.jsonl", "--output", "kept.jsonl", "--model", "m"],
    "calibrate": [],
}


def parse(argv: list[str]):
    """argv -> (settings, run config), as `swarmrl` resolves them before running anything."""
    parser, parsers = cli.build_parser()
    args, extra = parser.parse_known_args(argv)
    return cli.resolve(args.command, args, extra, parsers[args.command])


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    """`swarmrl ARGV` in-process: exit code, stdout, stderr."""
    try:
        cli.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A folder with a run config (what `swarmrl rl --prepare` writes first), as RUN under the cwd."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "RUN").mkdir()
    (tmp_path / "RUN" / "config.toml").write_text(load_config(None, ["--trainer.steps", "7"]).to_toml())
    return tmp_path / "RUN"


def test_every_command_has_a_module_with_settings_help_and_main():
    assert set(MODULES) == set(FLAGS) == set(cli.COMMANDS)
    help_text = " ".join(cli.build_parser()[0].format_help().split())
    for name, module in MODULES.items():
        assert issubclass(module.Settings, RoleSettings), name
        assert callable(module.main) and module.HELP.strip(), name
        assert module.RUN_CONFIG in ("flags", "run-dir", None), name
        assert " ".join(module.HELP.split()[:4]) in help_text, f"{name} missing from swarmrl --help"
        assert not {"config", "dry_run"} & set(module.Settings.model_fields), f"{name}: names the dispatcher takes"
        for field, info in module.Settings.model_fields.items():
            assert info.description and info.description.strip(), f"{name} --{field} has no help text"


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_every_flag_of_before_is_still_taken_and_every_command_has_config_and_dry_run(name):
    _, parsers = cli.build_parser()
    taken = {s for action in parsers[name]._actions for s in action.option_strings}
    assert set(FLAGS[name].split()) | {"--config", "--dry-run"} <= taken
    assert parsers[name].format_help().strip()


def test_argv_to_settings_with_defaults_aliases_and_normalised_urls():
    settings, cfg = parse(
        [
            "worker",
            "--orchestrator",
            "http://127.0.0.1:8000/v1/",
            "--key-file",
            "keys/a.pem",
            "--relays",
            "http://r1:1/, http://r2:2",
            "--threads",
            "2",
        ]
    )
    assert cfg is None
    assert settings.orchestrator == "http://127.0.0.1:8000" and settings.relays == "http://r1:1,http://r2:2"
    assert settings.threads == 2 and settings.name == "worker" and settings.engine == "builtin"
    assert settings.cache_dir == ".cache/swarmrl/worker/a"  # per key file unless given
    serve, _ = parse(["serve", "--model", "m", "--max-batch-rows", "8"])
    assert serve.max_batch == 8 and serve.port == 8080 and serve.dtype == "float32"
    status, _ = parse(["status", "--orchestrator", "https://h", "--json"])
    assert status.as_json is True and status.watch == 0.0


def test_commands_that_build_a_run_config_take_config_file_and_dotted_overrides(tmp_path):
    file = tmp_path / "c.toml"
    file.write_text("[trainer]\nlr = 1e-5\n")
    settings, cfg = parse(["rl", "--config", str(file), "--run-dir", "myrun", "--async.bound", "0"])
    assert settings.run_dir == "myrun" and cfg.run_dir == "myrun"
    assert cfg.trainer.lr == pytest.approx(1e-5) and cfg.async_.bound == 0
    _, cfg = parse(["eval", "--model", "m", "--benchmark", "arithmetic", "--output-dir", "o", "--tasks.digits", "3"])
    assert cfg.tasks.digits == 3


def test_settings_file_then_flags(tmp_path, capsys):
    file = tmp_path / "worker.toml"
    file.write_text('orchestrator = "http://127.0.0.1:9"\nkey-file = "k.pem"\nname = "from-file"\nthreads = 3\n')
    settings, _ = parse(["worker", "--config", str(file), "--name", "from-flag"])
    assert (settings.orchestrator, settings.key_file, settings.name, settings.threads) == (
        "http://127.0.0.1:9",
        "k.pem",
        "from-flag",
        3,
    )
    # What --dry-run prints is a settings file giving the same settings.
    code, out, _ = run(["worker", "--config", str(file), "--name", "from-flag", "--dry-run"], capsys)
    assert code == 0
    again = tmp_path / "again.toml"
    again.write_text(out)
    assert parse(["worker", "--config", str(again)])[0] == settings
    assert "# adversary =" in out  # unset settings are listed, as comments


def test_dry_run_prints_and_starts_nothing(monkeypatch, run_dir, capsys):
    for name, module in MODULES.items():
        monkeypatch.setattr(module, "main", lambda *a, name=name: pytest.fail(f"{name} --dry-run ran main"))
        code, out, err = run([name, *MINIMAL[name], "--dry-run"], capsys)
        assert code == 0, (name, err)
        assert tomllib.loads(out) is not None, name  # every dry run prints TOML
    assert not (run_dir.parent / "runs").exists() and not (run_dir.parent / ".cache").exists()


def test_dry_run_of_rl_is_exactly_the_resolved_config(capsys, tmp_path):
    overrides = ["--trainer.lr", "3e-6", "--async.bound=0"]
    code, out, _ = run(["rl", "--run-dir", "r", *overrides, "--dry-run"], capsys)
    assert code == 0
    assert out.startswith('# swarmrl rl settings:\n# run_dir = "r"\n')  # the flags, as comments
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(out)
    assert load_config(dumped) == load_config(None, [*overrides, "--run_dir", "r"])


def test_dry_run_of_a_role_on_a_run_dir_shows_the_runs_config(run_dir, capsys):
    code, out, _ = run(["trainer", "--run-dir", "RUN", "--node-rank", "1", "--dry-run"], capsys)
    assert code == 0
    printed = tomllib.loads(out)  # the settings; the run's config follows as comments
    assert printed == {"run_dir": "RUN", "resume": False, "node_rank": 1}
    assert "# The run's config, RUN/config.toml:" in out and "# steps = 7" in out
    code, _, err = run(["orchestrator", "--run-dir", "elsewhere", "--dry-run"], capsys)
    assert code == 2 and "elsewhere has no config.toml: prepare the run first" in err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["tasks", "--output", "x.jsonl", "--bogus", "1"], ["swarmrl tasks: error: unrecognized arguments: --bogus 1"]),
        (["tasks", "--output", "x.jsonl", "--trainer.lr", "1"], ["unrecognized arguments: --trainer.lr"]),
        (["score", "--input", "a", "--output", "b", "--trainer.lr", "1"], ["score takes --sandbox.FIELD"]),
        (["tasks", "--output", "x.jsonl", "--n", "many"], ["argument --n: invalid int value: 'many'"]),
        (["serve", "--model", "m", "--dtype", "fp8"], ["argument --dtype: invalid choice: 'fp8'"]),
        (["worker"], ["the following arguments are required: --orchestrator"]),
        (["score", "--input", "a"], ["the following arguments are required: --output"]),
        (["eval", "--benchmark", "b", "--output-dir", "o"], ["one of the arguments --model --endpoint is required"]),
        (["worker", "--orchestrator", "127.0.0.1:8000"], ["--orchestrator '127.0.0.1:8000' has no scheme"]),
        (["worker", "--orchestrator", "http://10.1.2.3:8000"], ["plain http to another machine", "--insecure"]),
        (["worker", "--orchestrator", "http://127.0.0.1:9", "--streams", "0"], ["--streams 0: give at least 1"]),
        (
            ["worker", "--orchestrator", "http://127.0.0.1:9", "--endpoint", "http://e"],
            ["--endpoint is for --engine openai"],
        ),
        (
            ["worker", "--orchestrator", "http://127.0.0.1:9", "--vllm-kv-cache-gib", "2"],
            ["--vllm-kv-cache-gib is for --engine vllm"],
        ),
        (
            ["worker", "--orchestrator", "http://127.0.0.1:9", "--engine", "vllm", "--endpoint", "http://e"],
            ["--endpoint is for --engine openai"],
        ),
        (
            ["worker", "--orchestrator", "http://127.0.0.1:9", "--engine", "vllm", "--streams", "2"],
            ["--engine vllm schedules its own batches"],
        ),
        (
            ["worker", "--orchestrator", "http://127.0.0.1:9", "--engine", "vllm", "--vllm-max-model-len", "1"],
            ["--vllm-max-model-len 1: give at least 2"],
        ),
        (["relay", "--upstream", "http://ok:1,bad:2", "--cache-dir", "c"], ["--upstream 'bad:2' has no scheme"]),
        (["relay", "--upstream", "http://ok:1", "--cache-dir", "c", "--tls-key", "k"], ["--tls-cert and --tls-key go"]),
        (["tasks", "--output", "x", "--completions", "wrong"], ["--completions is for --kind code"]),
        (["eval", "--model", "m", "--benchmark", "b", "--output-dir", "o", "--k", "0"], ["--k must be at least 1"]),
        (["rl", "--trainer.lrr", "1"], ["trainer.lrr", "allowed"]),
        (["status", "--config", "nope.toml"], ["--config nope.toml does not exist"]),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(argv, needles, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run([*argv, "--dry-run"], capsys)
    assert code == 2 and out == "", (code, out, err)
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def test_a_settings_file_with_an_unknown_or_bad_key_is_refused(tmp_path, capsys):
    bad = tmp_path / "relay.toml"
    bad.write_text('upstream = "http://a:1"\ncache_dir = "c"\nkeeps = 2\n')
    code, _, err = run(["relay", "--config", str(bad), "--dry-run"], capsys)
    # The shared settings (common.py's mixins) come first: pydantic lists a base's fields first.
    assert code == 2 and "unknown setting(s) keeps; allowed: tls_cert, tls_key, ca_file, upstream, cache_dir" in err
    bad.write_text('upstream = "http://a:1"\ncache_dir = "c"\nkeep = "two"\n')
    code, _, err = run(["relay", "--config", str(bad), "--dry-run"], capsys)
    assert code == 2 and "--keep:" in err and "'two'" in err


def test_help_of_every_command_renders(capsys):
    for name in MODULES:
        with pytest.raises(SystemExit) as done:
            cli.main([name, "--help"])
        assert done.value.code == 0
        assert f"usage: swarmrl {name}" in capsys.readouterr().out


def test_eval_extract_last_number_changes_math_rows_only():
    """--extract last_number: a math row's grading takes the last number when no \\boxed{} is
    written; a code row is left as it was."""
    import json

    from swarmrl.entrypoints.eval import _with_extract
    from swarmrl.rewards.math import math_task_reward

    math_row = {
        "problem_id": "m",
        "task_type": "verifiable_math",
        "prompt": "q",
        "verification_info": json.dumps({"ground_truth": "19"}),
    }
    code_row = {"problem_id": "c", "task_type": "prime_rl_code", "prompt": "q", "verification_info": "{}"}
    loose = _with_extract(math_row, "last_number")
    assert _with_extract(code_row, "last_number") is code_row
    assert math_row["verification_info"] == json.dumps({"ground_truth": "19"})  # not edited in place
    plain = "12 + 7 = 19."
    assert math_task_reward(json.loads(math_row["verification_info"]), plain)[0] == 0.0
    assert math_task_reward(json.loads(loose["verification_info"]), plain)[0] == 1.0
    assert math_task_reward(json.loads(loose["verification_info"]), "12 + 7 = 8")[0] == 0.0


# ---- placement of `swarmrl rl`'s processes (issue 30) -------------------------------------------
def test_pin_trainer_gives_the_trainer_its_own_cpus_on_a_cpu_run_and_only_there(monkeypatch):
    from swarmrl.launch import launcher

    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda _: {3, 0, 2, 1})
    assert launcher.placement(load_config(None, [])) == ([0], [1, 2, 3])
    two = load_config(None, ["--async.trainer_threads", "2"])
    assert launcher.placement(two) == ([0, 1], [2, 3])
    assert launcher.placement(load_config(None, ["--async.pin_trainer", "false"])) == (None, None)
    assert launcher.placement(load_config(None, ["--model.device", "cuda"])) == (None, None)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda _: {0})
    assert launcher.placement(load_config(None, [])) == (None, None)  # nothing left for the others


# ---- settings several roles share, errors meant for the user (issue 51) --------------------------
SHARED = {  # mixin -> its fields -> the roles that take them
    "CaFileSettings": (("ca_file",), {"relay", "status", "trainer", "validator", "worker"}),
    "TlsServeSettings": (("tls_cert", "tls_key"), {"orchestrator", "relay", "serve"}),
    "OrchestratorUrlSettings": (("orchestrator",), {"status", "validator", "worker"}),
}


def _declared_in(settings: type, field: str) -> type:
    """The class of `settings`' MRO whose body declares `field`."""
    return next(c for c in settings.__mro__ if field in c.__dict__.get("__annotations__", {}))


@pytest.mark.parametrize("mixin", sorted(SHARED))
def test_each_shared_setting_is_declared_once_in_its_mixin(mixin):
    from swarmrl.entrypoints import common

    base = getattr(common, mixin)
    fields, roles = SHARED[mixin]
    for name, module in MODULES.items():
        assert issubclass(module.Settings, base) == (name in roles), (name, mixin)
        for field in fields:
            if name in roles:
                assert _declared_in(module.Settings, field) is base, (name, field)
                assert module.Settings.model_fields[field].description == base.model_fields[field].description
            elif field in module.Settings.model_fields:  # the trainer's optional --orchestrator is its own
                assert (name, field) == ("trainer", "orchestrator")


def test_the_shared_checks_run_for_every_role_that_takes_them(capsys):
    for argv in (["orchestrator", "--run-dir", "RUN"], ["serve", "--model", "m"], MINIMAL["relay"]):
        argv = argv if argv[0] != "--upstream" else ["relay", *argv]
        code, _, err = run([*argv, "--tls-cert", "c.pem", "--dry-run"], capsys)
        assert code == 2 and "--tls-cert and --tls-key go together: give both" in err, argv
    for name in ("status", "validator", "worker"):
        argv = [name, *MINIMAL[name]]
        argv[argv.index("--orchestrator") + 1] = "ftp://example.org"
        code, _, err = run([*argv, "--dry-run"], capsys)
        assert code == 2 and "--orchestrator" in err and "Traceback" not in err, (name, err)
    settings, _ = parse(["worker", "--orchestrator", "http://127.0.0.1:8000/v1"])
    assert settings.orchestrator == "http://127.0.0.1:8000"  # the shared check normalises too


def test_user_facing_errors_derive_from_swarmrl_error_and_keep_their_old_base():
    from swarmrl.assets.prepare import AssetError
    from swarmrl.assets.sources import SourceError
    from swarmrl.config import ConfigError
    from swarmrl.errors import SwarmrlError, WrongPrecision
    from swarmrl.inference import worker
    from swarmrl.inference.remote import EndpointError
    from swarmrl.inference.vllm_engine import VllmUnavailable
    from swarmrl.proofs.limits import LimitsError
    from swarmrl.protocol.client import ProtocolMismatch, Refused, Unavailable
    from swarmrl.protocol.manifest import BroadcastError
    from swarmrl.protocol.tls import TLSError
    from swarmrl.sandbox.runner import SandboxUnavailable
    from swarmrl.sandbox.uids import UidsUnavailable
    from swarmrl.trainer.loop import RunStopped
    from swarmrl.validator import core

    old_bases = {
        ConfigError: ValueError,
        LimitsError: ValueError,
        SourceError: ValueError,
        AssetError: ValueError,
        SandboxUnavailable: RuntimeError,
        UidsUnavailable: RuntimeError,
        RunStopped: RuntimeError,
        EndpointError: RuntimeError,
        VllmUnavailable: RuntimeError,
        worker.RefusedEngine: Exception,
        worker.UnknownEnvironment: Exception,
        TLSError: RuntimeError,
        Refused: RuntimeError,
        Unavailable: RuntimeError,
        ProtocolMismatch: RuntimeError,
        BroadcastError: RuntimeError,
    }
    for cls, old in old_bases.items():
        assert issubclass(cls, SwarmrlError) and issubclass(cls, old), cls
    assert worker.WrongPrecision is core.WrongPrecision is WrongPrecision  # one class, both roles raise it
    assert issubclass(WrongPrecision, SwarmrlError)


def test_a_swarmrl_error_from_any_role_is_one_line_without_a_traceback(capsys, monkeypatch):
    from swarmrl.errors import SwarmrlError

    def raises(settings, cfg):
        raise SwarmrlError("the thing is wrong: do this instead")

    monkeypatch.setattr(MODULES["tasks"], "main", raises)
    code, out, err = run(["tasks", "--output", "t.jsonl"], capsys)
    assert code == 2 and err == "swarmrl: error: the thing is wrong: do this instead\n", err
    # The command run as a user runs it: tests/integration/test_cli.py (`swarmrl assets`).
