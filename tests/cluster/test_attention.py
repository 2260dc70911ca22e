"""check_attention answers, before the cluster is touched, what transformers 5.19 decides
in every Train worker's from_pretrained: flash-attn, else the hub kernel through
`kernels` (in its supported range; offline only from the local cache), else ImportError."""

import subprocess
import sys

import pytest

from areal_ray.cluster import attention
from areal_ray.cluster.attention import FLASH, attention_path, check_attention
from areal_ray.config import ConfigError

FA2 = FLASH["flash_attention_2"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def have(monkeypatch):
    """Pretend these (module, distribution) pairs are installed, at these versions."""
    def install(**versions):
        table = {("flash_attn", "flash-attn"): versions.get("flash_attn"),
                 ("flash_attn", "flash-attn-4"): versions.get("flash_attn_4"),
                 ("kernels", "kernels"): versions.get("kernels")}
        monkeypatch.setattr(attention, "installed", lambda m, d: table.get((m, d)))
    return install


def cache_kernel(root, layout="kernels"):
    """What `hf download kernels-community/flash-attn2 --repo-type kernel --revision v3`
    leaves in a hub cache: refs/v3 naming a snapshot with one build variant."""
    repo = root / "kernels--kernels-community--flash-attn2"
    (root / f"{layout}--kernels-community--flash-attn2" / "refs").mkdir(parents=True, exist_ok=True)
    (root / f"{layout}--kernels-community--flash-attn2" / "refs" / "v3").write_text(COMMIT + "\n")
    (repo / "snapshots" / COMMIT / "build" / "torch-stable-abi29-cu130-x86_64-linux").mkdir(parents=True)
    return repo / "snapshots" / COMMIT


def test_the_tables_match_the_installed_transformers():
    from transformers.modeling_flash_attention_utils import FLASH_ATTN_KERNEL_FALLBACK, FLASH_ATTN_KERNEL_VERSIONS
    from transformers.utils import import_utils
    for impl, spec in FLASH.items():
        assert FLASH_ATTN_KERNEL_FALLBACK[impl] == spec.repo
        assert FLASH_ATTN_KERNEL_VERSIONS[spec.repo] == spec.major
    lo, hi = (".".join(map(str, v)) + ".0" for v in attention.KERNELS_RANGE)
    assert (import_utils.KERNELS_MIN_VERSION, import_utils.KERNELS_MAX_VERSION) == (lo, hi)
    assert attention.in_kernels_range(attention.KERNELS_PIN.split("==")[1])


def test_this_cpu_venv_has_no_flash_path_and_says_so():
    """The real environment, nothing faked: the CPU venv has neither package."""
    with pytest.raises(ConfigError, match="flash_attention_2 needs flash-attn or kernels"):
        check_attention("flash_attention_2", True, env={})


@pytest.mark.parametrize("impl,use_gpu", [("sdpa", True), ("", True), ("eager", False),
                                          ("flash_attention_2", False)])
def test_nothing_to_load_without_a_flash_kernel_on_a_gpu(have, impl, use_gpu):
    have()
    assert "no flash kernel" in attention_path(impl, use_gpu, env={})


def test_flash_attn_installed_is_used(have, capsys):
    have(flash_attn="2.8.3.post2")
    check_attention("flash_attention_2", True, env={"HF_HUB_OFFLINE": "1"})
    assert capsys.readouterr().out.strip() == \
        "[areal-ray] trainer attention: flash_attention_2: flash-attn 2.8.3.post2"


def test_flash_attn_4_does_not_count_as_flash_attention_2(have):
    """sglang's env installs flash-attn-4, which also provides the flash_attn module."""
    have(flash_attn_4="4.0.0b36")
    with pytest.raises(ConfigError, match="neither is installed"):
        attention_path("flash_attention_2", True, env={})


def test_neither_package_is_refused_with_the_ways_out(have):
    have()
    with pytest.raises(ConfigError) as e:
        attention_path("flash_attention_2", True, env={})
    for way in ("kernels==0.17.2", "FLASH_ATTN=1", "attn_implementation=sdpa"):
        assert way in str(e.value)


def test_kernels_outside_transformers_range_is_refused(have):
    have(kernels="0.14.1")  # what sglang 0.5.23 pins
    with pytest.raises(ConfigError, match=r"kernels 0.14.1 is installed, but .* \[0.17, 0.18\)"):
        attention_path("flash_attention_2", True, env={})


def test_online_the_kernel_comes_from_the_hub(have, tmp_path):
    have(kernels="0.17.2")
    line = attention_path("flash_attention_2", True, env={"HF_HOME": str(tmp_path)})
    assert "kernels-community/flash-attn2 v3 through kernels 0.17.2" in line
    assert f"downloaded from the Hugging Face Hub by each Train worker into {tmp_path / 'hub'}" in line


def test_offline_without_the_cached_kernel_says_how_to_prefetch_it(have, tmp_path):
    have(kernels="0.17.2")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    with pytest.raises(ConfigError) as e:
        attention_path("flash_attention_2", True, env=env)
    msg = str(e.value)
    assert "not in the local cache" in msg
    assert (f"hf download kernels-community/flash-attn2 --repo-type kernel --revision v3 "
            f"--include 'build/*-cu*-x86_64-linux/*' --cache-dir {tmp_path}") in msg


def test_offline_a_ref_without_its_snapshot_is_not_enough(have, tmp_path):
    have(kernels="0.17.2")
    (tmp_path / "kernels--kernels-community--flash-attn2" / "refs").mkdir(parents=True)
    (tmp_path / "kernels--kernels-community--flash-attn2" / "refs" / "v3").write_text(COMMIT)
    with pytest.raises(ConfigError, match="not in the local cache"):
        attention_path("flash_attention_2", True, env={"HF_HUB_OFFLINE": "true",
                                                       "KERNELS_CACHE": str(tmp_path)})


@pytest.mark.parametrize("layout", ["kernels", "models"])
@pytest.mark.parametrize("cache_key", ["KERNELS_CACHE", "HF_HUB_CACHE"])
def test_offline_with_the_cached_kernel_loads_from_the_cache(have, tmp_path, layout, cache_key):
    have(kernels="0.17.2")
    snapshot = cache_kernel(tmp_path, layout)
    line = attention_path("flash_attention_2", True,
                          env={"TRANSFORMERS_OFFLINE": "1", cache_key: str(tmp_path)})
    assert line.endswith(f"from the local cache {snapshot} (hub offline)")


def test_the_default_cache_follows_hf_home_then_xdg(tmp_path):
    assert attention.kernels_cache({"HF_HOME": str(tmp_path)}) == tmp_path / "hub"
    assert attention.kernels_cache({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "huggingface" / "hub"
    assert attention.kernels_cache({"KERNELS_CACHE": "/k", "HF_HUB_CACHE": "/h"}).as_posix() == "/k"


def test_local_kernels_override_needs_no_hub(have):
    have(kernels="0.17.2")
    env = {"HF_HUB_OFFLINE": "1", "LOCAL_KERNELS": "other/k=/x:kernels-community/flash-attn2=/opt/fa2"}
    assert attention_path("flash_attention_2", True, env=env).endswith("from LOCAL_KERNELS /opt/fa2")


def test_offline_is_read_as_huggingface_hub_reads_it():
    assert attention.offline({"HF_HUB_OFFLINE": "yes"}) and not attention.offline({"HF_HUB_OFFLINE": "0"})
    assert not attention.offline({})


def test_it_imports_neither_torch_nor_transformers():
    """Planning a run (jobs) can ask without paying for either."""
    code = ("import sys, areal_ray.cluster.attention; "
            "print(' '.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []


# ---- every GPU node checks its own path (the Train workers' nodes)

def ray_node(node_id, address, gpus, alive=True):
    """A node as `ray.nodes()` lists it."""
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive,
            "Resources": {"CPU": 8.0, **({"GPU": float(gpus)} if gpus else {})}}


def test_only_alive_gpu_nodes_are_asked():
    nodes = [ray_node("a" * 56, "10.0.0.1", 8), ray_node("b" * 56, "10.0.0.2", 0),
             ray_node("c" * 56, "10.0.0.3", 8, alive=False), ray_node("d" * 56, "10.0.0.4", 1)]
    assert attention.gpu_nodes(nodes) == {"a" * 56: "10.0.0.1 (aaaaaaaaaaaa)",
                                          "d" * 56: "10.0.0.4 (dddddddddddd)"}


def test_each_node_answers_from_its_own_environment(have, tmp_path):
    """The same pure check per node: one node's cache holds the kernel, the other's not."""
    have(kernels="0.17.2")
    cache_kernel(tmp_path / "filled")
    (tmp_path / "empty").mkdir()
    answers = {node: attention.node_answer("flash_attention_2", True, {
        "HF_HUB_OFFLINE": "1", "KERNELS_CACHE": str(tmp_path / cache)})
        for node, cache in (("10.0.0.1 (aaaa)", "filled"), ("10.0.0.2 (bbbb)", "empty"))}
    assert answers["10.0.0.1 (aaaa)"][0] and not answers["10.0.0.2 (bbbb)"][0]
    with pytest.raises(ConfigError) as e:
        attention.nodes_verdict(answers)
    msg = str(e.value)
    assert msg.startswith("the trainer's flash attention would not load on 1 of 2 GPU node(s)")
    assert "node 10.0.0.2 (bbbb): model.attn_implementation=flash_attention_2" in msg
    assert "hf download kernels-community/flash-attn2" in msg and "10.0.0.1" not in msg


def test_nodes_that_all_load_are_listed():
    answers = {"n2": (True, "flash_attention_2: flash-attn 2.8.3"), "n1": (True, "sdpa")}
    assert attention.nodes_verdict(answers) == ["n1: sdpa", "n2: flash_attention_2: flash-attn 2.8.3"]


@pytest.mark.parametrize("impl,use_gpu", [("sdpa", True), ("flash_attention_2", False)])
def test_no_flash_kernel_runs_nothing_on_the_cluster(impl, use_gpu):
    """CPU runs and non-flash attention ask no node: not even Ray is needed."""
    assert attention.check_attention_on_nodes(impl, use_gpu, nodes=[ray_node("a" * 56, "x", 8)]) == []


def test_a_node_without_a_flash_path_fails_by_its_address(ray_cluster):
    """A real task pinned to this cluster's node (listed as a GPU node): this CPU venv has
    neither flash-attn nor kernels there, and the error names the node."""
    import ray
    node = next(n for n in ray.nodes() if n["Alive"])
    fake = {**node, "Resources": {**node["Resources"], "GPU": 1.0}}
    with pytest.raises(ConfigError) as e:
        attention.check_attention_on_nodes("flash_attention_2", True, nodes=[fake])
    assert f"node {node['NodeManagerAddress']} ({node['NodeID'][:12]}): model.attn_implementation" \
        f"=flash_attention_2 needs flash-attn or kernels" in str(e.value)
