"""Classes named by dotted path: the job's check imports them before Ray starts, and
neither it nor the workflow and checker modules import torch (the rollout stage's
actor, Ray Data's coordinator and the job's config check would pay ~1 GiB for it)."""

import subprocess
import sys

import pytest

from areal_ray.plugins import PluginError, import_class


class Flow:
    async def arun_episode(self, client, row):
        return None


def test_import_class_returns_the_class_with_its_method():
    assert import_class(f"{__name__}.Flow", "k", "arun_episode", coroutine=True) is Flow


def test_code_that_raises_on_import_is_named_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('needs a GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"^k 'broken_plugin.C': importing broken_plugin failed: "
                                          r"RuntimeError: needs a GPU"):
        import_class("broken_plugin.C", "k", "check")


def test_a_missing_module_or_a_bad_path_is_named():
    with pytest.raises(PluginError, match=r"^k 'json.decoder.x.Y': no module named 'json.decoder.x'"):
        import_class("json.decoder.x.Y", "k", "check")
    with pytest.raises(PluginError, match=r"^k '\.\.': not a dotted path"):
        import_class("..", "k", "check")


def test_the_check_and_the_plugin_modules_import_no_torch():
    code = ("import sys; from areal_ray.config import Config; from areal_ray.plugins import check_plugins; "
            "import areal_ray.rollout.engine_client, areal_ray.reward.pool; check_plugins(Config()); "
            "print(' '.join(m for m in ('torch', 'transformers', 'math_verify') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True)
    assert out.stdout.split() == []
