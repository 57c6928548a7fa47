"""Typed per-process configuration filled from CLI flags, a YAML file and environment variables.

Every process (bootstrap peer, block server, gateway, `up`) has one pydantic model describing its settings.
`build_parser` turns that model into an argparse parser whose `--help` shows each field's description, and
`load_config` merges the sources with this precedence: CLI flags > YAML file (`--config`) > environment
variables (`SWARMGATE_<FIELD>`) > the model's defaults. Unknown YAML keys and invalid values are errors
that name the offending setting.
"""
from __future__ import annotations

import argparse
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Optional, Type, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

ENV_PREFIX = "SWARMGATE_"
_AS_FLAG = "__as_flag"  # dest suffix of `--NAME` for a list-valued positional NAME (both are joined)
C = TypeVar("C", bound="ProcessConfig")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message names it."""


class ProcessConfig(BaseModel):
    """Base class: forbids unknown keys so that a typo in YAML is an error, not a silent default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _unwrap_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(_unwrap_optional(annotation)) in (list, tuple)


def _is_bool(annotation: Any) -> bool:
    return _unwrap_optional(annotation) is bool


def build_parser(
    config_cls: Type[ProcessConfig], prog: str, description: str, positional: Optional[str] = None
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field (and optionally one positional field)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--config", type=str, default=None, help="YAML file with settings (CLI flags override it)")
    for name, field in config_cls.model_fields.items():
        help_text = (field.description or "").replace("%", "%%")
        default = field.get_default(call_default_factory=True)
        if name == positional and _is_list(field.annotation):  # MODEL [MODEL ...] and/or --model M, repeatable
            parser.add_argument(name, nargs="*", default=argparse.SUPPRESS, help=help_text)
            parser.add_argument(f"--{name}", dest=name + _AS_FLAG, action="extend", nargs="+", metavar=name.upper(),
                                default=argparse.SUPPRESS, help="the same as a flag, which may be given several times "
                                                                "(after the positional ones)")
            continue
        if name == positional:
            parser.add_argument(name, nargs="?", default=argparse.SUPPRESS, help=help_text)
            continue
        flag = f"--{name}"
        if _is_bool(field.annotation):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                help=f"{help_text} (default: {default})",
            )
        elif _is_list(field.annotation):
            parser.add_argument(
                flag, nargs="*", default=argparse.SUPPRESS, help=f"{help_text} (default: {default})"
            )
        else:
            parser.add_argument(flag, type=str, default=argparse.SUPPRESS, help=f"{help_text} (default: {default})")
    return parser


def _from_env(config_cls: Type[ProcessConfig], environ: typing.Mapping[str, str]) -> dict:
    values = {}
    for name, field in config_cls.model_fields.items():
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if _is_list(field.annotation):
            raw = raw.strip()
            values[name] = json.loads(raw) if raw.startswith("[") else [p for p in raw.replace(",", " ").split() if p]
        else:
            values[name] = raw
    return values


def load_config(
    config_cls: Type[C],
    cli: Optional[argparse.Namespace] = None,
    yaml_path: Optional[str] = None,
    environ: Optional[typing.Mapping[str, str]] = None,
    section: Optional[str] = None,
) -> C:
    """Merge defaults < env < YAML < CLI into a validated config object; raises ConfigError on bad input."""
    environ = os.environ if environ is None else environ
    merged: dict = _from_env(config_cls, environ)
    cli_values = {k: v for k, v in vars(cli).items() if k != "config"} if cli is not None else {}
    for key in [k for k in cli_values if k.endswith(_AS_FLAG)]:  # a list positional given as flags too: one list
        name = key[:-len(_AS_FLAG)]
        cli_values[name] = [*cli_values.get(name, []), *cli_values.pop(key)]
    yaml_path = yaml_path or (vars(cli).get("config") if cli is not None else None)
    if yaml_path:
        path = Path(yaml_path)
        if not path.is_file():
            raise ConfigError(f"config file {yaml_path!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {yaml_path!r} is not valid YAML: {e}") from None
        if section is not None and isinstance(data, dict) and isinstance(data.get(section), dict):
            data = data[section]  # a file with several processes' sections, like configs/local.yaml
        if not isinstance(data, dict):
            raise ConfigError(f"config file {yaml_path!r} must hold a mapping of settings")
        merged.update(data)
    merged.update(cli_values)
    try:
        return config_cls.model_validate(merged)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<config>'}: {err['msg']}" for err in e.errors()
        )
        raise ConfigError(f"invalid {config_cls.__name__}: {problems}") from None


def config_from_argv(config_cls: Type[C], argv, prog: str, description: str, positional: Optional[str] = None,
                     section: Optional[str] = None, yaml_only: tuple = ()) -> C:
    """A process's `main`: parse its CLI (with `--help`), merge YAML and env, exit with a usage error if bad."""
    parser = build_parser(config_cls, prog, description, positional=positional)
    args = parser.parse_args(argv)
    for name in yaml_only:  # structured settings come from the YAML file only
        if hasattr(args, name):
            parser.error(f"--{name} can only be set in the YAML file")
    try:
        return load_config(config_cls, args, section=section)
    except ConfigError as e:
        parser.error(str(e))


def setup_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def parse_span(text: str) -> tuple[int, int]:
    """'a:b' -> (a, b) with 0 <= a < b; a ValueError with a readable message otherwise."""
    try:
        start_s, end_s = text.split(":")
        start, end = int(start_s), int(end_s)
    except ValueError:
        raise ValueError(f"block range must look like 'start:end', got {text!r}") from None
    if not 0 <= start < end:
        raise ValueError(f"block range {text!r} must satisfy 0 <= start < end")
    return start, end


def parse_device(text: str) -> str:
    """A torch device name for `--device`: what `torch.device` accepts of type cpu or cuda ('cpu', 'cpu:N', 'cuda',
    'cuda:N'; not 'cuda:01' or ' cuda', which torch refuses), as torch spells it, except that 'cpu:N' is 'cpu'
    (torch has one CPU device: a CPU tensor's device is 'cpu' whatever index it was made with, so the name compares
    equal to it); a ValueError with a readable message otherwise. Whether the device exists is checked where it is
    used (a process's start)."""
    import torch

    try:
        device = torch.device(text) if isinstance(text, str) else None
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {text!r}: use cpu, cuda or cuda:N")
    return "cpu" if device.type == "cpu" else str(device)
