"""A command's settings model as argparse flags, and the settings resolved from a file and flags.

Each field of a command's `Settings` is one flag: `run_dir` is `--run-dir`, the field's docstring
is its help text, a `Literal` gives its choices and a bool is a switch. A field without a default is
a required flag. Flags that are not given stay out of the parsed namespace, so that a settings file
(`--config FILE` of the roles that take one) can set them and the command line still wins.
"""

from __future__ import annotations

import argparse
import tomllib
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo


class RoleSettings(BaseModel):
    """Base of every command's `Settings`: unknown keys are errors, docstrings are help texts."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def flag(
    default: Any = ...,
    *,
    spelled: str | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    group: str | None = None,
    exclusive: str | None = None,
    description: str | None = None,
) -> Any:
    """A field with what argparse needs beyond its type: its flag when not the field's name
    (`as_json` is `--json`), other spellings (`--max-batch-rows`), a metavar, the titled help group
    it is listed in, or the mutually exclusive set it belongs to."""
    extra = {"spelled": spelled, "aliases": list(aliases), "metavar": metavar, "group": group, "exclusive": exclusive}
    return Field(default, description=description, json_schema_extra={k: v for k, v in extra.items() if v})


def _extra(info: FieldInfo | None) -> dict:
    extra = info.json_schema_extra if info is not None else None
    return extra if isinstance(extra, dict) else {}


def flag_name(field: str, settings: type[BaseModel] | None = None) -> str:
    """The command-line spelling of `field`: `--run-dir` for run_dir."""
    info = settings.model_fields.get(field) if settings is not None else None
    return _extra(info).get("spelled") or "--" + field.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def argparse_kwargs(info: FieldInfo, *, required: bool) -> dict:
    """`add_argument` keywords for one field (its flag names apart)."""
    kind = _unwrap_optional(info.annotation)
    kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": info.description}
    if kind is bool:
        kwargs["action"] = "store_true"
        return kwargs
    if get_origin(kind) is Literal:
        kwargs["choices"] = list(get_args(kind))
    elif kind in (int, float):
        kwargs["type"] = kind
    if _extra(info).get("metavar"):
        kwargs["metavar"] = _extra(info)["metavar"]
    if info.is_required():
        if required:
            kwargs["required"] = True
        else:  # it may come from a settings file; the settings check says when it is missing
            kwargs["help"] = f"{info.description or ''} (required)".strip()
    return kwargs


def add_settings_flags(
    parser: argparse.ArgumentParser,
    settings: type[BaseModel],
    *,
    groups: dict[str, str] | None = None,
    required: bool = True,
) -> None:
    """One flag per field of `settings`. `groups` gives each titled group its description;
    `required=False` leaves required fields to the settings check (they may come from a file)."""
    titled: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    for name, info in settings.model_fields.items():
        extra = _extra(info)
        target: Any = parser
        if extra.get("group"):
            title = extra["group"]
            if title not in titled:
                titled[title] = parser.add_argument_group(title, (groups or {}).get(title))
            target = titled[title]
        if extra.get("exclusive"):
            key = extra["exclusive"]
            if key not in exclusive:
                exclusive[key] = target.add_mutually_exclusive_group(required=required)
            target = exclusive[key]
        target.add_argument(
            flag_name(name, settings), *extra.get("aliases", []), dest=name, **argparse_kwargs(info, required=required)
        )


def file_key(field: str, settings: type[BaseModel]) -> str:
    """The key of `field` in a settings file: its flag without dashes (`run_dir`, `json`)."""
    return flag_name(field, settings)[2:].replace("-", "_")


def read_settings_file(path: str, settings: type[BaseModel]) -> dict:
    """The field values in a settings file (TOML): keys are the flags' names, `key_file` or `key-file`."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path} does not exist")
    try:
        data = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path} is not valid TOML: {e}") from None
    fields = {file_key(name, settings): name for name in settings.model_fields}
    data = {key.replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"--config {path}: unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(fields)}")
    return {fields[key]: value for key, value in data.items()}


def missing_flags(err: ValidationError, settings: type[BaseModel]) -> list[str]:
    """The required flags a validation error says are missing."""
    return [flag_name(str(e["loc"][0]), settings) for e in err.errors() if e["type"] == "missing" and e["loc"]]


def explain(err: ValidationError, settings: type[BaseModel]) -> str:
    """A settings validation error in the command line's terms: each problem names its flag."""
    lines = []
    for e in err.errors():
        where = flag_name(str(e["loc"][0]), settings) if e["loc"] else ""
        if e["type"] == "value_error":  # our own checks: the message already names the flag
            lines.append(str(e["ctx"]["error"]))
        elif e["type"] == "missing":
            lines.append(f"{where} is required")
        else:
            lines.append(f"{where}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def settings_toml(settings: BaseModel, *, commented: bool = False) -> str:
    """The settings as TOML, usable as a settings file; unset fields are listed as comments
    (TOML has no null). `commented` turns every line into a comment."""
    data = {file_key(k, type(settings)): v for k, v in settings.model_dump(mode="json").items()}
    text = tomli_w.dumps({k: v for k, v in data.items() if v is not None})
    unset = [k for k, v in data.items() if v is None]
    if unset:
        text += "# Settings without a value:\n" + "".join(f"# {k} =\n" for k in unset)
    return comment_out(text) if commented else text


def comment_out(text: str) -> str:
    """Every line of `text` as a TOML comment."""
    return "".join(line if line.startswith("#") else f"# {line}" for line in text.splitlines(keepends=True))
