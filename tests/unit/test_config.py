"""Tests for swarmrl.config: defaults, the shipped TOML files, overrides, errors, docs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel

from swarmrl.config import Config, ConfigError, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOML = ROOT / "configs" / "default.toml"
SEED_TOML = ROOT / "configs" / "intellect2-qwq32b.toml"


def _flatten(data: dict, prefix: str = "") -> dict:
    """{"trainer": {"lr": 1}} -> {"trainer.lr": 1}."""
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _diff(a: dict, b: dict) -> list[str]:
    fa, fb = _flatten(a), _flatten(b)
    missing = object()
    return [
        f"{k}: {fa.get(k, '<absent>')!r} != {fb.get(k, '<absent>')!r}"
        for k in sorted(set(fa) | set(fb))
        if fa.get(k, missing) != fb.get(k, missing)
    ]


def _dump(cfg: Config) -> dict:
    return cfg.model_dump(by_alias=True, mode="json")


def _leaf_fields(cls: type[BaseModel], prefix: str = ""):
    """(dotted name, FieldInfo) for every non-section field, recursively."""
    for name, field in cls.model_fields.items():
        dotted = prefix + (field.alias or name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaf_fields(ann, dotted + ".")
        else:
            yield dotted, field


def _get(cfg: Config, dotted: str):
    node = cfg
    for key in dotted.split("."):
        node = getattr(node, "async_" if key == "async" else key)
    return node


# -- defaults and shipped files -------------------------------------------------------------


def test_defaults_validate():
    cfg = Config()
    assert Config.model_validate(_dump(cfg)) == cfg
    assert load_config() == cfg
    # The embedded default is small enough for a CPU: samples divide into optimizer steps.
    samples = cfg.sampling.prompts_per_step * cfg.sampling.group_size
    assert samples % cfg.trainer.optimizer_steps == 0


def test_default_toml_matches_defaults_field_by_field():
    """configs/default.toml is generated from the defaults: same keys, same values."""
    in_file = tomllib.loads(DEFAULT_TOML.read_text())
    generated = tomllib.loads(Config().to_toml())
    differences = _diff(in_file, generated)
    assert not differences, "configs/default.toml differs from Config() defaults (file != default):\n  " + "\n  ".join(
        differences
    )
    assert load_config(DEFAULT_TOML) == Config()


def test_seed_config_has_the_intellect2_recipe():
    cfg = load_config(SEED_TOML)
    s, t, a = cfg.sampling, cfg.trainer, cfg.algorithm
    assert s.group_size == 16
    assert s.prompts_per_step == 32
    assert s.prompts_per_step * s.group_size == 512
    assert t.optimizer_steps == 8
    assert 512 // t.optimizer_steps == 64
    assert t.lr == pytest.approx(3e-7)
    assert t.warmup_steps == 25
    assert t.betas == (0.9, 0.99)
    assert t.weight_decay == pytest.approx(0.01)
    assert t.grad_clip == pytest.approx(0.1)
    assert a.delta == 4.0
    assert a.eps_low == pytest.approx(0.2) and a.eps_high == pytest.approx(0.2)
    assert s.temperature == pytest.approx(0.6)
    assert cfg.async_.bound == 2
    assert cfg.length.enabled
    assert min(cfg.length.targets) == 2000 and max(cfg.length.targets) == 10000
    assert cfg.length.targets == [2000, 4000, 6000, 8000, 10000]
    assert cfg.tasks.solve_rate_range == (0.1, 0.8)
    assert cfg.model.dtype == "bfloat16"


def test_seed_values_quoted_in_docstrings_match_seed_config():
    """A field documented as "Seed run: X" has value X in the seed run's config file."""
    cfg = load_config(SEED_TOML)
    pattern = re.compile(r"Seed run: (-?\d+(?:\.\d+)?(?:e-?\d+)?)(?![\d-])")
    checked = []
    for dotted, field in _leaf_fields(Config):
        m = pattern.search(field.description or "")
        value = _get(cfg, dotted)
        if m is None or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        assert value == pytest.approx(float(m.group(1))), (
            f"{dotted} is documented as 'Seed run: {m.group(1)}' but {SEED_TOML.name} has {value!r}"
        )
        checked.append(dotted)
    # The scan must actually see the recipe's fields, or it checks nothing.
    for name in ("sampling.group_size", "trainer.lr", "trainer.optimizer_steps", "async.bound"):
        assert name in checked


# -- overrides ------------------------------------------------------------------------------


def test_overrides_of_every_value_kind():
    cfg = load_config(
        None,
        [
            "--trainer.steps",
            "7",  # int
            "--trainer.lr",
            "3e-7",  # float
            "--length.enabled",
            "true",  # bool
            "--length.targets",
            "[10, 20, 30]",  # list
            "--trainer.betas",
            "[0.8, 0.95]",  # tuple from a list
            "--tasks.source",
            "data/my tasks.jsonl",  # bare string, no quotes needed
            "--model.dtype",
            "bfloat16",  # literal
            "--algorithm.normalize_std",
            "false",
            "--seed",
            "3",  # top-level field
        ],
    )
    assert cfg.trainer.steps == 7
    assert cfg.trainer.lr == pytest.approx(3e-7)
    assert cfg.length.enabled is True
    assert cfg.length.targets == [10, 20, 30]
    assert cfg.trainer.betas == (0.8, 0.95)
    assert cfg.tasks.source == "data/my tasks.jsonl"
    assert cfg.model.dtype == "bfloat16"
    assert cfg.algorithm.normalize_std is False
    assert cfg.seed == 3
    # Untouched fields keep their defaults.
    assert cfg.trainer.optimizer_steps == Config().trainer.optimizer_steps


def test_equals_form_and_alias_section():
    cfg = load_config(None, ["--trainer.lr=1e-3", "--async.bound=0", "--model.device=cuda:1", "--tasks.ops=+"])
    assert cfg.trainer.lr == pytest.approx(1e-3)
    assert cfg.async_.bound == 0
    assert cfg.model.device == "cuda:1"
    assert cfg.tasks.ops == "+"
    assert parse_overrides(["--a.b=1", "--c.d", "x", "--e=[1, 2]"]) == [("a.b", 1), ("c.d", "x"), ("e", [1, 2])]


def test_string_fields_keep_text_that_looks_like_another_type():
    cfg = load_config(
        None,
        ["--run_dir", "2024", "--tasks.source", "123", "--model.device", "true", "--logging.wandb_project", '"quoted"'],
    )
    assert cfg.run_dir == "2024"
    assert cfg.tasks.source == "123"
    assert cfg.model.device == "true"
    assert cfg.logging.wandb_project == "quoted"


def test_overrides_apply_on_top_of_a_file():
    cfg = load_config(SEED_TOML, ["--trainer.lr", "1e-6", "--sampling.group_size", "8"])
    assert cfg.trainer.lr == pytest.approx(1e-6)
    assert cfg.sampling.group_size == 8
    assert cfg.trainer.warmup_steps == 25  # from the file


# -- errors ---------------------------------------------------------------------------------


def test_unknown_key_names_key_and_lists_allowed_fields():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--trainer.lrr", "1e-3"])
    msg = str(e.value)
    assert "trainer.lrr" in msg
    for allowed in ("lr", "warmup_steps", "grad_clip", "optimizer_steps"):
        assert allowed in msg
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--bogus.x", "1"])
    assert "bogus" in str(e.value) and "trainer" in str(e.value) and "async" in str(e.value)
    with pytest.raises(ConfigError, match="not a section"):
        load_config(None, ["--trainer.lr.x", "1"])


@pytest.mark.parametrize(
    ("args", "field", "allowed"),
    [
        (["--length.mode", "sometimes"], "length.mode", "'exact', 'max' or 'clip'"),
        (["--sampling.group_size", "1"], "sampling.group_size", "greater than or equal to 2"),
        (["--trainer.lr", "fast"], "trainer.lr", "valid number"),
        (["--trainer.lr", "-1"], "trainer.lr", "greater than 0"),
        (["--tasks.ops", "*"], "tasks.ops", "pattern"),
        (["--length.enabled", "maybe"], "length.enabled", "valid boolean"),
    ],
)
def test_bad_value_names_field_and_what_is_allowed(args, field, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    msg = str(e.value)
    assert field in msg and allowed in msg, msg


def test_malformed_override_arguments():
    with pytest.raises(ConfigError, match="no value"):
        load_config(None, ["--trainer.lr"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        load_config(None, ["trainer.lr", "1"])


def test_unknown_key_in_toml_file_fails(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[trainer]\nlr = 1e-3\nlearning_rate = 1e-3\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "trainer.learning_rate" in msg
    assert "lr" in msg and "warmup_steps" in msg  # what is allowed there
    path.write_text("[trainr]\nlr = 1e-3\n")
    with pytest.raises(ConfigError, match="trainr"):
        load_config(path)


def test_missing_or_invalid_toml_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\nlr = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_optimizer_steps_must_divide_samples():
    # Default: 16 prompts x 8 = 128 samples; 3 does not divide it.
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--trainer.optimizer_steps", "3"])
    msg = str(e.value)
    assert "optimizer_steps=3" in msg and "128" in msg and "divide" in msg
    assert load_config(None, ["--trainer.optimizer_steps", "4"]).trainer.optimizer_steps == 4


def test_solve_rate_range_is_checked():
    with pytest.raises(ConfigError, match="solve_rate_range"):
        load_config(None, ["--tasks.solve_rate_range", "[0.9, 0.1]"])


# -- to_toml and docs -----------------------------------------------------------------------


@pytest.mark.parametrize("source", ["defaults", "seed", "overridden"])
def test_to_toml_round_trips(tmp_path, source):
    cfg = {
        "defaults": lambda: Config(),
        "seed": lambda: load_config(SEED_TOML),
        "overridden": lambda: load_config(
            None,
            [
                "--run_dir",
                "runs/x",
                "--algorithm.tis_cap",
                "2.5",
                "--async.max_pending_groups",
                "9",
                "--trainer.betas",
                "[0.85, 0.9]",
                "--tasks.solve_rate_range",
                "[0.2, 0.7]",
            ],
        ),
    }[source]()
    path = tmp_path / "dumped.toml"
    path.write_text(cfg.to_toml())
    again = load_config(path)
    assert again == cfg, _diff(_dump(again), _dump(cfg))


def test_every_field_is_documented():
    leaves = list(_leaf_fields(Config))
    assert len(leaves) > 50
    undocumented = [name for name, field in leaves if not (field.description or "").strip()]
    assert not undocumented, f"config fields without a docstring: {undocumented}"


def test_off_policy_correction_settings_are_checked():
    cfg = load_config(
        None, ["--algorithm.tis_cap", "2", "--algorithm.tis_level", "sequence", "--algorithm.tis_mask_band", "4"]
    )
    assert (cfg.algorithm.tis_cap, cfg.algorithm.tis_level, cfg.algorithm.tis_mask_band) == (2.0, "sequence", 4.0)
    for bad, needle in (
        (["--algorithm.tis_cap", "-1"], "tis_cap"),
        (["--algorithm.tis_cap", "2", "--algorithm.tis_mask_band", "0.5"], "tis_mask_band"),
        (["--algorithm.tis_cap", "off", "--algorithm.tis_mask_band", "3"], "needs algorithm.tis_cap"),
        (["--algorithm.tis_cap", "0"], "greater than 0"),
        (["--algorithm.tis_cap", "sometimes"], "tis_cap"),
        (["--algorithm.old_logprobs", "inference", "--algorithm.tis_cap", "2"], "recompute"),
        (["--algorithm.old_logprobs", "inference", "--algorithm.tis_mask_band", "3"], "recompute"),
    ):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, bad)


def test_decoupled_ppo_is_the_default_and_off_survives_a_round_trip(tmp_path):
    assert load_config(None, []).algorithm.tis_cap == 2.0  # chosen by the async study
    for text in ("off", "none", "OFF"):
        assert load_config(None, ["--algorithm.tis_cap", text]).algorithm.tis_cap == "off"
    # Behaviour PPO alone is valid: the default cap does not apply there (its ratio is 1).
    behaviour = load_config(None, ["--algorithm.old_logprobs", "inference"])
    assert behaviour.algorithm.tis_cap == "off"
    # A run's config.toml is what its trainer reloads: "off" must not come back as the default.
    for cfg in (behaviour, load_config(None, ["--algorithm.tis_cap", "off"])):
        path = tmp_path / "config.toml"
        path.write_text(cfg.to_toml())
        assert load_config(path, []).algorithm.tis_cap == "off"
        assert load_config(path, []) == cfg
