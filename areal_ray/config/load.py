"""Reading a config: dataclass defaults, then a YAML file, then `key=value` overrides,
merged by omegaconf; then every check. Also `to_dict` and `help_lines` (`--help`).

Every problem is a `ConfigError` of one line that names the key (or the file and line
of a YAML syntax error), raised before any work starts.
"""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from enum import Enum

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal_ray.config.root import Config, check_across
from areal_ray.config.section import ConfigError, check_sections


def validate(cfg: Config) -> Config:
    """`cfg` when its types, choices and values are usable, else a ConfigError. For a
    config built or changed in code: the types are checked here, as loading does."""
    try:
        OmegaConf.structured(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad config: {_omegaconf_problem(e)}") from e
    return _check_values(cfg)


def _check_values(cfg: Config) -> Config:
    check_sections(cfg)
    check_across(cfg)
    return cfg


def load_config(path: str | None = None, overrides: list[str] | None = None, schema=Config):
    """`schema`: the dataclass of the keys (the run `Config`, or a benchmark's own)."""
    try:
        merged = OmegaConf.structured(schema)
        if path:
            try:
                loaded = OmegaConf.load(path)
            except yaml.YAMLError as e:
                raise ConfigError(f"config file {path}: not valid YAML: {_yaml_problem(e)}") from e
            merged = OmegaConf.merge(merged, loaded)
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
            try:
                parsed = OmegaConf.from_dotlist([item])
            except yaml.YAMLError as e:
                raise ConfigError(f"override {item!r}: the value is not valid YAML: "
                                  f"{_yaml_problem(e, where=False)}") from e
            _refuse_value_for_section(merged, parsed, item)
            merged = OmegaConf.merge(merged, parsed)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad config ({path or 'defaults'}): {_omegaconf_problem(e)}") from e
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    return _check_values(cfg) if schema is Config else cfg  # omegaconf has checked the types


def _refuse_value_for_section(merged, parsed, item: str) -> None:
    """`algo.optim=1e-4`: omegaconf's merge error would not name the key. Sections
    that were keys once (e.g. `algo.dynamic_filter`) make this a likely slip."""
    key = item.split("=", 1)[0]
    node = OmegaConf.select(merged, key, default=None)
    if isinstance(node, DictConfig) and is_dataclass(OmegaConf.get_type(node)) \
            and not isinstance(OmegaConf.select(parsed, key), DictConfig):
        raise ConfigError(f"override {item!r}: {key} is a section, not a value; "
                          f"its keys: {', '.join(f'{key}.{k}' for k in node)}")


def _omegaconf_problem(e: OmegaConfBaseException) -> str:
    """omegaconf's message in one line, led by the key: `rollout.backend: Invalid value
    'tgi', expected one of [hf, vllm, sglang]`."""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__  # the rest: omegaconf's types
    key = getattr(e, "full_key", None)
    return f"{key}: {msg}" if key else msg


def _yaml_problem(e: Exception, where: bool = True) -> str:
    """PyYAML's message in one line: what it expected, and (in a file) where."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark and where else problem


# Keys whose values are credentials: `to_dict` (what config records and MLflow params
# are made of) shows them as REDACTED, so a run's files and logs never hold its key.
SECRETS = ("rollout.openai.api_key", "rollout.workflow_kwargs.api_key")
REDACTED = "<redacted>"


def to_dict(cfg) -> dict:
    """Plain nested dicts of plain values (choices as their strings), secrets redacted."""
    d = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    for key in SECRETS:
        *path, leaf = key.split(".")
        node = d
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf):
            node[leaf] = REDACTED
    return d


def help_lines(cls=Config, prefix: str = "") -> list[str]:
    """`key = default  # help` for every leaf key, in schema order, sub-sections inline."""
    lines = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        sub = f.default_factory if f.default_factory is not MISSING else None
        if sub is not None and is_dataclass(sub):
            lines.extend(help_lines(sub, key + "."))
        else:
            default = sub() if sub is not None else f.default
            if isinstance(default, Enum):
                default = default.value
            lines.append(f"  {key} = {default!r}    # {f.metadata.get('help', '')}")
    return lines
