"""The engine table and the engine contract: every backend builds from the registry,
implements the whole contract, and the replica calls nothing the contract lacks."""

import ast
import inspect
from pathlib import Path

import pytest

from areal_ray.config.choices import RolloutBackend
from areal_ray.rollout.engines import registry
from areal_ray.rollout.engines.base import InferenceEngine

REPLICA = Path(__file__).resolve().parents[3] / "deployments" / "rollout.py"


@pytest.mark.parametrize("backend", sorted(registry.ENGINES))
def test_every_registered_engine_implements_the_whole_contract(backend):
    cls = registry.engine_class(backend)
    assert issubclass(cls, InferenceEngine)
    assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)}"


def test_the_config_offers_exactly_the_registered_engines():
    assert RolloutBackend.values() == tuple(registry.ENGINES)


def test_the_replica_calls_only_what_the_contract_declares():
    """deployments/rollout.py uses `self.engine.<name>`: each name must be on the base
    class, so a new engine learns everything it must provide from one place."""
    used = {node.attr for node in ast.walk(ast.parse(REPLICA.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "engine" and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"}
    assert used, "the replica no longer calls its engine through self.engine"
    missing = {name for name in used
               if not hasattr(InferenceEngine, name) and name not in InferenceEngine.__annotations__}
    assert not missing, f"the replica calls {sorted(missing)}, which InferenceEngine does not declare"


def test_an_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="'tgi' is not one of"):
        registry.build_engine("tgi", "model")


def test_a_registered_class_that_is_not_an_engine_is_refused(monkeypatch):
    monkeypatch.setitem(registry.ENGINES, "bogus", "collections:OrderedDict")
    with pytest.raises(TypeError, match="not an InferenceEngine"):
        registry.engine_class("bogus")


def test_defaults_say_what_an_engine_cannot_do():
    class Minimal(InferenceEngine):
        version = 0

        @classmethod
        def from_options(cls, model_path, opts):
            return cls()

        async def generate(self, req): ...
        async def pause(self, mode="abort"): ...
        async def resume(self): ...
        async def update_weights(self, state_dict, version, mode="abort"): return {}
        def load(self): return {}

    import asyncio
    m = Minimal.from_options("model", None)
    assert m.get_version() == 0 and m.load_failure() is None and not m.streams_buckets
    for call in (m.weights_digest(), m.release_memory(), m.resume_memory(),
                 m.update_weights_from_buckets(iter(()), 1)):
        with pytest.raises(NotImplementedError, match="Minimal"):
            asyncio.run(call)
