"""User code plugged in by dotted path: the rollout workflow and extra reward checkers.

The config names a class as "package.module.Class" (`rollout.workflow`,
`reward.checkers`). Each is imported where it runs (the rollout stage's actor, the
reward checker's process) and once more by `check_plugins` before Ray starts, so a
path that does not import, names no class, or names a class without the method its
role needs fails the job in seconds with a message naming the key, not minutes later
inside an actor. Nothing here imports torch; user code that does pays for it only in
processes that import it.
"""

from __future__ import annotations

import importlib
import inspect

from areal_ray.config import ConfigError


class PluginError(ConfigError):
    """A dotted path in the config that cannot be used; the message names the key."""


def import_class(path: object, key: str, method: str, coroutine: bool = False) -> type:
    """The class at `path`, which must have `method` (an `async def` if `coroutine`).
    `key` is the config key that named it, for the message."""
    where = f"{key} {path!r}"
    cls, name = _import_attr(path, where, "Class")
    if not inspect.isclass(cls):
        raise PluginError(f"{where}: {name} is a {type(cls).__name__}, not a class")
    fn = getattr(cls, method, None)
    if not callable(fn):
        raise PluginError(f"{where}: class {name} has no method {method}()")
    if coroutine and not inspect.iscoroutinefunction(fn):
        raise PluginError(f"{where}: {name}.{method} must be a coroutine (async def)")
    return cls


def import_entry(entry: str) -> object:
    """The object a registry entry names ("module:Name", as in `ENGINES` and `LOSSES`),
    or None when the module has no such attribute: the registry says what it expected."""
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name, None)


def _import_attr(path: object, where: str, kind: str) -> tuple[object, str]:
    """The object at dotted `path` and its name; PluginError starting with `where`."""
    if not isinstance(path, str) or "." not in path.strip("."):
        raise PluginError(f"{where}: not a dotted path of the form 'package.module.{kind}'")
    module_name, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PluginError(f"{where}: {str(e)[:1].lower()}{str(e)[1:]}") from e
    except Exception as e:  # noqa: BLE001 - user code raising on import is the user's to see
        raise PluginError(f"{where}: importing {module_name} failed: {type(e).__name__}: {e}") from e
    obj = getattr(module, name, None)
    if obj is None:
        raise PluginError(f"{where}: module {module_name} has no attribute {name!r}")
    return obj, name


def import_function(path: object, key: str, coroutine: bool = False):
    """The function at `path` (an `async def` if `coroutine`), e.g. an agent;
    `key` is the config key that named it, for the message."""
    where = f"{key} {path!r}"
    fn, name = _import_attr(path, where, "function")
    if inspect.isclass(fn) or not callable(fn):
        raise PluginError(f"{where}: {name} is a {type(fn).__name__}, not a function")
    if coroutine and not inspect.iscoroutinefunction(fn):
        raise PluginError(f"{where}: {name} must be a coroutine function (async def)")
    return fn


def check_plugins(cfg) -> tuple[str, ...]:
    """Import every class the config names by path and check its shape (the rollout
    workflow; each extra reward checker); raises `PluginError` naming the key.
    Returns the verifier names a dataset row may give."""
    from areal_ray.reward.registry import check_checkers
    from areal_ray.rollout.workflows.base import EpisodeConfig, check_workflow
    check_workflow(cfg.rollout.workflow, EpisodeConfig.from_config(cfg), cfg.rollout.workflow_kwargs)
    from areal_ray.config.judge import served_verifiers
    served = served_verifiers(cfg.reward.judge, cfg.reward.reward_model)  # reward.judge, reward.reward_model
    return tuple(sorted({*check_checkers(cfg.reward.checkers), *served}))
