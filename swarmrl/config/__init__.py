"""Every knob of a run, documented where it is defined.

Defaults are the embedded default (a ~1M-parameter model learning arithmetic on a 2-core CPU).
Where a value comes from the INTELLECT-2 seed run (PrimeIntellect, "INTELLECT-2: A Reasoning
Model Trained Through Globally Decentralized Reinforcement Learning", 2025) or another paper,
the field says so; `configs/intellect2-qwq32b.toml` holds the seed run's values.

Config files are TOML; any field can be overridden on the command line with its dotted name
(`--trainer.lr 3e-7`). Unknown keys and bad values fail at start with the field's name and what
is allowed.

The sections live by concern in this package (base, task, training, services); this module holds
the root `Config`, its cross-section rules and the loader, and re-exports every section.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from swarmrl import plugins
from swarmrl.config.base import ADVERSARY_KINDS, Section
from swarmrl.config.services import BroadcastConfig, LoggingConfig, OrchestratorConfig, ValidatorConfig, read_key_file
from swarmrl.config.task import LengthConfig, ModelConfig, RewardsConfig, SamplingConfig, SandboxConfig, TasksConfig
from swarmrl.config.training import (
    LORA_TARGETS_DEFAULT,
    AlgorithmConfig,
    AsyncConfig,
    EvalConfig,
    LoRAConfig,
    SFTConfig,
    TrainerConfig,
)
from swarmrl.errors import SwarmrlError


class Config(Section):
    run_dir: str | None = None
    """Run directory; None: a new folder under runs/."""
    seed: int = 0
    """Global seed (sampling seeds, trainer RNG)."""
    plugins: list[str] = Field(default_factory=list)
    """Modules to import before anything else is resolved (installed packages or on PYTHONPATH), which
    register the run's own task sources, environments, engine backends or task types
    (docs/plugins.md). Every process of the run imports them; workers and validators learn them
    from the orchestrator and stop, naming the module, when one is not installed on their machine."""
    model: ModelConfig = ModelConfig()
    tasks: TasksConfig = TasksConfig()
    sampling: SamplingConfig = SamplingConfig()
    length: LengthConfig = LengthConfig()
    rewards: RewardsConfig = RewardsConfig()
    sandbox: SandboxConfig = SandboxConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    async_: AsyncConfig = Field(AsyncConfig(), alias="async")
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    validator: ValidatorConfig = ValidatorConfig()
    broadcast: BroadcastConfig = BroadcastConfig()
    eval: EvalConfig = EvalConfig()
    sft: SFTConfig = SFTConfig()
    logging: LoggingConfig = LoggingConfig()

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True)

    @model_validator(mode="after")
    def _check(self) -> Config:
        for kind in self.async_.adversaries:
            if kind not in ADVERSARY_KINDS:
                raise ValueError(f"async.adversaries: unknown kind {kind!r}; one of: {', '.join(ADVERSARY_KINDS)}")
        samples = self.sampling.prompts_per_step * self.sampling.group_size
        if samples % self.trainer.optimizer_steps:
            raise ValueError(
                f"trainer.optimizer_steps={self.trainer.optimizer_steps} must divide the "
                f"{samples} samples per step (sampling.prompts_per_step x sampling.group_size)"
            )
        self._check_trainer_ranks(samples // self.trainer.optimizer_steps)
        self._check_precision()
        budget = self.trainer.max_tokens_per_micro_batch
        if budget is not None and budget <= self.sampling.max_new_tokens:
            # The longest prompt is known only once tasks are tokenized (checked at launch); a
            # sequence is at least one prompt token + a full-length completion.
            raise ValueError(
                f"trainer.max_tokens_per_micro_batch={budget} cannot hold one sequence: a completion alone "
                f"can be sampling.max_new_tokens={self.sampling.max_new_tokens} tokens, plus its prompt; "
                "set it to at least the longest prompt + sampling.max_new_tokens, or leave it unset"
            )
        if self.trainer.lora.rank and self.trainer.nproc * self.trainer.nnodes > 1:
            raise ValueError(
                f"trainer.lora.rank={self.trainer.lora.rank} needs a single trainer rank, but "
                f"trainer.nproc x trainer.nnodes = {self.trainer.nproc * self.trainer.nnodes}: FSDP2 "
                "sharding of a frozen base with adapters is not supported yet; set trainer.nproc = 1 "
                "(a LoRA update is small enough for one device) or trainer.lora.rank = 0"
            )
        alg = self.algorithm
        if alg.old_logprobs == "inference":
            explicit_cap = "tis_cap" in alg.model_fields_set and alg.tis_cap != "off"
            if explicit_cap or alg.tis_mask_band is not None:
                raise ValueError(
                    "algorithm.tis_cap and algorithm.tis_mask_band weigh tokens by p_old / p_inference, "
                    'which is 1 when old_logprobs = "inference": set algorithm.old_logprobs = '
                    '"recompute" (decoupled PPO) or drop them'
                )
            alg.tis_cap = "off"  # the default cap does not apply: written out as off, so a reload agrees
        if alg.tis_mask_band is not None and alg.tis_cap == "off":
            raise ValueError(
                "algorithm.tis_mask_band needs algorithm.tis_cap (the importance weights it masks); "
                "set e.g. --algorithm.tis_cap 2.0"
            )
        if self.tasks.solve_rate_range is not None:
            lo, hi = self.tasks.solve_rate_range
            if not 0.0 <= lo <= hi <= 1.0:
                raise ValueError(f"tasks.solve_rate_range must satisfy 0 <= lo <= hi <= 1, got {lo, hi}")
        return self

    def _check_precision(self) -> None:
        """trainer.precision against model.dtype, its compute dtype: either one alone sets the
        other (written out, so a reload agrees); both set and disagreeing is an error."""
        t, m = self.trainer, self.model
        computes: dict[str, Literal["float32", "bfloat16"]] = {
            "fp32": "float32",
            "mixed": "bfloat16",
            "bf16": "bfloat16",
        }
        if t.precision is None:
            t.precision = "mixed" if m.dtype == "bfloat16" else "fp32"
        elif "dtype" not in m.model_fields_set and m.dtype != computes[t.precision]:
            m.dtype = computes[t.precision]
        if m.dtype != computes[t.precision]:
            fits = " or ".join(f'"{p}"' for p, d in computes.items() if d == m.dtype)
            raise ValueError(
                f'trainer.precision = "{t.precision}" computes in {computes[t.precision]}, but model.dtype = '
                f'"{m.dtype}": set model.dtype = "{computes[t.precision]}", or trainer.precision to '
                f"{fits} (or leave one of the two unset: it follows the other)"
            )
        if t.cpu_offload and t.nproc * t.nnodes == 1 and m.device != "cpu":
            raise ValueError(
                f"trainer.cpu_offload offloads FSDP2's sharded state, and one trainer rank on "
                f'model.device = "{m.device}" runs without FSDP2: set trainer.nproc above 1, or '
                "trainer.cpu_offload = false"
            )

    def _check_trainer_ranks(self, mini: int) -> None:
        """trainer.nproc / nnodes / rdzv_endpoint: what torchrun and FSDP2 need, checked before
        any process starts (GRPOTrainer._my_share would refuse the first batch otherwise)."""
        t = self.trainer
        world = t.nproc * t.nnodes
        if mini % world:
            fits = [n for n in range(1, mini + 1) if mini % (n * t.nnodes) == 0]
            raise ValueError(
                f"trainer.nproc={t.nproc} x trainer.nnodes={t.nnodes} = {world} trainer ranks must divide the "
                f"{mini} sequences of each optimizer step (sampling.prompts_per_step {self.sampling.prompts_per_step} "
                f"x sampling.group_size {self.sampling.group_size} / trainer.optimizer_steps {t.optimizer_steps}), "
                f"so that every rank trains on an equal share: set trainer.nproc to one of "
                f"{', '.join(map(str, fits)) or '(none: change trainer.nnodes)'}, or change those"
            )
        if t.nnodes > 1 and t.rdzv_endpoint is None:
            raise ValueError(
                f'trainer.nnodes={t.nnodes} needs trainer.rdzv_endpoint = "HOST:PORT": node 0\'s address '
                "as the other nodes reach it and a free port there, where they meet (docs/deploy.md)"
            )
        if world > 1 and self.model.device.startswith("cuda:"):
            raise ValueError(
                f"model.device={self.model.device!r} names one GPU, but trainer.nproc x trainer.nnodes = "
                f'{world} ranks each need their own: set model.device = "cuda" (rank i of a node '
                "uses cuda:i; choose the GPUs with CUDA_VISIBLE_DEVICES)"
            )

    def to_toml(self, *, show_unset: bool = False) -> str:
        """The config as TOML. TOML has no null, so fields whose value is None are left out; with
        `show_unset` (what --dry-run prints) they are listed at the end as comments."""
        data = self.model_dump(by_alias=True, exclude_none=True, mode="json")
        text = tomli_w.dumps(data)
        if show_unset:
            unset = []

            def walk(prefix: str, value) -> None:
                for key, v in value.items():
                    if v is None:
                        unset.append(prefix + key)
                    elif isinstance(v, dict):
                        walk(f"{prefix}{key}.", v)

            walk("", self.model_dump(by_alias=True, mode="json"))
            if unset:
                text += "\n# Fields without a value (None: TOML cannot write it), set with --FIELD VALUE:\n" + "".join(
                    f"# {name} =\n" for name in unset
                )
        return text


class ConfigError(SwarmrlError, ValueError):
    """A config problem, phrased for the person who wrote the config."""


def _parse_value(text: str) -> Any:
    """Command-line values are read as TOML values when they parse (numbers, true, [1, 2]),
    otherwise as plain strings, so `--tasks.source data.jsonl` needs no quotes."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _takes_str(annotation: Any) -> bool:
    return annotation is str or (get_origin(annotation) in (Union, UnionType) and str in get_args(annotation))


def _set_dotted(data: dict, dotted: str, text: str) -> None:
    """Set the field named `dotted` from its command-line text. A string field keeps the text
    as written when it reads as another TOML type (`--run_dir 2024` is the string "2024")."""
    keys = dotted.split(".")
    node: Any = data
    cls: type[BaseModel] = Config
    for i, key in enumerate(keys):
        fields = {**cls.model_fields, **{f.alias: f for f in cls.model_fields.values() if f.alias}}
        if key not in fields:
            where = ".".join(keys[:i]) or "the top level"
            allowed = sorted(f.alias or n for n, f in cls.model_fields.items())
            raise ConfigError(
                f"unknown config key '{dotted}': '{key}' is not a field of {where}; allowed there: {', '.join(allowed)}"
            )
        field = fields[key]
        name = field.alias or key
        if i == len(keys) - 1:
            value = _parse_value(text)
            node[name] = text if _takes_str(field.annotation) and not isinstance(value, str) else value
            return
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            raise ConfigError(f"unknown config key '{dotted}': '{'.'.join(keys[: i + 1])}' is a value, not a section")
        node = node.setdefault(name, {})
        cls = ann


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """`--a.b value` and `--a.b=value` pairs; anything else is an error that says so."""
    return [(key, _parse_value(text)) for key, text in _split_overrides(args)]


def _split_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`(dotted key, value text)` for each override, before the value is parsed."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --trainer.lr 3e-7")
        key = arg[2:]
        if "=" in key:
            key, text = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value: write {arg} VALUE")
            text = args[i + 1]
            i += 2
        out.append((key, text))
    return out


def _allowed_at(loc: tuple) -> str:
    """The field names allowed in the section at `loc` (for unknown-key messages)."""
    cls: Any = Config
    for key in loc:
        fields = {**cls.model_fields, **{f.alias: f for f in cls.model_fields.values() if f.alias}}
        cls = fields[key].annotation if key in fields else None
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return ""
    return ", ".join(sorted(f.alias or n for n, f in cls.model_fields.items()))


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        if e["type"] == "extra_forbidden" and (allowed := _allowed_at(e["loc"][:-1])):
            lines.append(f"  {loc}: unknown key; allowed there: {allowed}")
            continue
        lines.append(
            f"  {loc}: {e['msg']} (got {e.get('input')!r})"
            if "input" in e and not isinstance(e.get("input"), dict)
            else f"  {loc}: {e['msg']}"
        )
    return "invalid config:\n" + "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file, then dotted overrides; validated once at the end."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    for key, text in _split_overrides(overrides or []):
        _set_dotted(data, key, text)
    # Plug-ins first: the sections below may name what they register (a task source, an engine).
    names = data.get("plugins", [])
    if not isinstance(names, list):
        raise ConfigError(f'plugins: give a list of module names, e.g. plugins = ["my_pkg.plugin"] (got {names!r})')
    try:
        plugins.load(names, where="the run config's plugins")
    except plugins.PluginError as e:
        raise ConfigError(str(e)) from e.__cause__
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        # Unknown keys inside a file land here too ("Extra inputs are not permitted").
        raise ConfigError(_format_validation_error(e)) from None
