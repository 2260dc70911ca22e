"""What every config section is built from: `opt` (a field with its default and help),
`ConfigError`, `require` and `check_sections`.

A section is a small kw-only dataclass in its component's module. omegaconf checks the
types (and the choices, which are enums); a section's `check()` says what types cannot
(ranges, keys that depend on each other), so a key's meaning, default and limits are
found in one place. Checks that span sections live in root.py.
"""

from __future__ import annotations

from dataclasses import field, fields, is_dataclass
from typing import Any


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


def opt(default: Any, help: str):  # noqa: A002 - "help" reads best at the call sites
    if isinstance(default, (dict, list)):  # mutable: each config gets its own copy
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def section(cls: type, help: str):  # noqa: A002
    """A sub-section field: its own dataclass, a fresh one per config."""
    return field(default_factory=cls, metadata={"help": help})


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_sections(node: Any) -> None:
    """`check()` of `node` and of every section below it, parents first."""
    check = getattr(node, "check", None)
    if callable(check):
        check()
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value) and not isinstance(value, type):
            check_sections(value)
