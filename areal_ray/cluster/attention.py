"""Whether the trainer's flash attention can load, checked before the cluster is touched.

transformers 5.19 decides in `from_pretrained` (modeling_utils.py,
`_check_and_adjust_attn_implementation`), on every Train worker: a `flash_attention_N`
runs on its flash-attn package when that is installed; otherwise on the hub kernel
`FLASH[impl].repo` at major version `FLASH[impl].major`, loaded through the `kernels`
package, but only when `kernels` is in transformers' supported range; with neither it
raises ImportError. That comes after the rollout app has started and eval-before has
run, so this module answers the same question in seconds: first from the job's
environment (`check_attention`, before the cluster is touched), then on every alive
node with GPUs, where a Train worker may land (`check_attention_on_nodes`: one tiny Ray
task per node, pinned to it), since each node has its own packages and kernel cache.

Offline (`HF_HUB_OFFLINE`), `kernels` looks the kernel up only in the local cache: the
file `refs/v<major>` of the kernel repo names a snapshot, whose `build/` holds one
directory per build variant (kernels 0.17 `_versions.py`, `resolver.py`).

Nothing here imports torch or transformers: `jobs` that only plan a run can call it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from areal_ray.config import ConfigError


class FlashImpl(NamedTuple):
    module: str        # what flash-attn installs
    dist: str          # the distribution that must provide it (flash-attn-4 also installs flash_attn)
    repo: str          # the hub kernel transformers falls back to
    major: int         # the kernel version transformers asks for


# transformers 5.19: FLASH_ATTENTION_COMPATIBILITY_MATRIX, FLASH_ATTN_KERNEL_FALLBACK and
# FLASH_ATTN_KERNEL_VERSIONS (modeling_flash_attention_utils.py); KERNELS_MIN_VERSION and
# KERNELS_MAX_VERSION (utils/import_utils.py). tests/cluster/test_attention.py compares.
FLASH = {
    "flash_attention_2": FlashImpl("flash_attn", "flash-attn", "kernels-community/flash-attn2", 3),
    "flash_attention_3": FlashImpl("flash_attn_interface", "flash-attn-3",
                                   "kernels-community/vllm-flash-attn3", 1),
    "flash_attention_4": FlashImpl("flash_attn", "flash-attn-4", "kernels-community/flash-attn4", 0),
}
KERNELS_RANGE = ((0, 17), (0, 18))  # min inclusive, max exclusive
KERNELS_PIN = "kernels==0.17.2"     # requirements-gpu-vllm.txt, requirements-gpu-kernels.txt
TRUE = {"1", "ON", "YES", "TRUE"}   # huggingface_hub's reading of a boolean env var
NODE_CHECK_TIMEOUT_S = 120.0        # a GPU node whose check has not run by then fails the job


def installed(module: str, dist: str) -> str | None:
    """The version of `dist` when it is installed and `module` imports; transformers asks
    for both, as another distribution may install the same module."""
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def in_kernels_range(version: str) -> bool:
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    return KERNELS_RANGE[0] <= parts < KERNELS_RANGE[1]


def offline(env: Mapping[str, str]) -> bool:
    value = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in TRUE


def kernels_cache(env: Mapping[str, str]) -> Path:
    """Where `kernels` keeps hub kernels: KERNELS_CACHE, else the Hugging Face hub cache."""
    for key in ("KERNELS_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(os.path.expandvars(env[key])).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def local_override(repo: str, env: Mapping[str, str]) -> str | None:
    """A path LOCAL_KERNELS ("repo=path:repo=path") gives the kernel, which `kernels` then
    loads without the hub."""
    for entry in env.get("LOCAL_KERNELS", "").split(":"):
        name, _, path = entry.partition("=")
        if name == repo and path:
            return path
    return None


def cached_snapshot(spec: FlashImpl, env: Mapping[str, str]) -> Path | None:
    """The cached snapshot an offline `get_kernel(repo, version=major)` would load."""
    root = kernels_cache(env)
    name = spec.repo.replace("/", "--")
    for layout in ("kernels", "models"):  # kernels reads refs from both
        ref = root / f"{layout}--{name}" / "refs" / f"v{spec.major}"
        if ref.is_file():
            build = root / f"kernels--{name}" / "snapshots" / ref.read_text().strip() / "build"
            if build.is_dir() and any(p.is_dir() for p in build.iterdir()):
                return build.parent
    return None


def prefetch_hint(spec: FlashImpl, env: Mapping[str, str]) -> str:
    """How to fill the cache an offline load reads. By the branch name: a download of
    `v<major>` writes refs/v<major>, while an online get_kernel fetches by commit and
    leaves no ref, so a cache filled by a first online run still fails offline."""
    cache = kernels_cache(env)
    return (f"Pre-fetch it while online into the cache every GPU node reads ({cache}: "
            f"KERNELS_CACHE, else HF_HUB_CACHE or HF_HOME/hub): `hf download {spec.repo} "
            f"--repo-type kernel --revision v{spec.major} --include 'build/*-cu*-x86_64-linux/*' "
            f"--cache-dir {cache}` (by the branch name v{spec.major}: that writes the "
            f"refs/v{spec.major} the offline lookup reads; a first online run does not). Or set "
            f"LOCAL_KERNELS={spec.repo}=<dir with build/>, or build flash-attn "
            f"(`make gpu-venv FLASH_ATTN=1`)")


def hub_kernel_path(impl: str, spec: FlashImpl, kernels: str, env: Mapping[str, str]) -> str:
    via = f"hub kernel {spec.repo} v{spec.major} through kernels {kernels}"
    local = local_override(spec.repo, env)
    if local:
        return f"{impl}: {via}, from LOCAL_KERNELS {local}"
    if not offline(env):
        return (f"{impl}: {via}, downloaded from the Hugging Face Hub by each Train worker "
                f"into {kernels_cache(env)} unless already there")
    snapshot = cached_snapshot(spec, env)
    if snapshot is None:
        raise ConfigError(
            f"model.attn_implementation={impl}: flash-attn is not installed, so transformers "
            f"loads {spec.repo} (version {spec.major}) through kernels; the hub is offline "
            f"(HF_HUB_OFFLINE) and the kernel is not in the local cache, so every Train worker "
            f"would fail to load the model. {prefetch_hint(spec, env)}")
    return f"{impl}: {via}, from the local cache {snapshot} (hub offline)"


def attention_path(attn_implementation: str, use_gpu: bool, env: Mapping[str, str] = os.environ) -> str:
    """Which code runs the trainer's attention, as one line; ConfigError when a flash
    implementation has no path that would load."""
    impl = attn_implementation.removeprefix("paged|")
    if not needs_flash(impl, use_gpu):
        return f"{impl or 'the model default'}: no flash kernel to load"
    spec = FLASH.get(impl)
    native = installed(spec.module, spec.dist) if spec else None
    if native:
        return f"{impl}: {spec.dist} {native}"
    kernels = installed("kernels", "kernels")
    needs = f"{spec.dist} or kernels" if spec else "kernels (a hub kernel)"
    if kernels is None:
        raise ConfigError(
            f"model.attn_implementation={impl} needs {needs}, and neither is installed here: "
            f"transformers would raise ImportError in every Train worker after the rollout app "
            f"and eval-before have run. Install {KERNELS_PIN} (requirements-gpu-vllm.txt and "
            f"`make gpu-venv` do), build flash-attn (`make gpu-venv FLASH_ATTN=1`, needs nvcc), "
            f"or set model.attn_implementation=sdpa")
    if not in_kernels_range(kernels):
        lo, hi = (".".join(map(str, v)) for v in KERNELS_RANGE)
        raise ConfigError(
            f"model.attn_implementation={impl}: kernels {kernels} is installed, but transformers "
            f"uses kernels only in [{lo}, {hi}) and would raise ImportError in every Train worker. "
            f"Install {KERNELS_PIN} over it (`make gpu-venv` does: requirements-gpu-kernels.txt "
            f"says why sglang's older pin can be overridden)")
    if spec is None:
        return f"{impl}: hub kernel through kernels {kernels} (its cache is not checked)"
    return hub_kernel_path(impl, spec, kernels, env)


def check_attention(attn_implementation: str, use_gpu: bool, env: Mapping[str, str] = os.environ) -> None:
    """Refuse a flash attention that would not load on the Train workers; print the path."""
    print(f"[areal-ray] trainer attention: {attention_path(attn_implementation, use_gpu, env)}",
          flush=True)


def needs_flash(attn_implementation: str, use_gpu: bool) -> bool:
    """Whether the Train workers load a flash kernel at all (never on CPU)."""
    return use_gpu and "flash" in attn_implementation


def node_answer(attn_implementation: str, use_gpu: bool,
                env: Mapping[str, str] = os.environ) -> tuple[bool, str]:
    """`attention_path` where it runs, as (loads, line or error): what a node reports."""
    try:
        return True, attention_path(attn_implementation, use_gpu, env)
    except ConfigError as e:
        return False, str(e)


def gpu_nodes(nodes: Iterable[Mapping]) -> dict[str, str]:
    """Node id -> "address (id prefix)" of each alive node with GPUs, of `ray.nodes()`:
    where a Train worker may land with `train.use_gpu`."""
    return {n["NodeID"]: f"{n.get('NodeManagerAddress') or '?'} ({n['NodeID'][:12]})"
            for n in nodes if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0}


def nodes_verdict(answers: Mapping[str, tuple[bool, str]]) -> list[str]:
    """One line per node ("<node>: <path>"), or ConfigError naming every node on which
    the Train workers' flash attention would not load, each with its own reason."""
    failed = {node: text for node, (ok, text) in answers.items() if not ok}
    if failed:
        raise ConfigError(
            f"the trainer's flash attention would not load on {len(failed)} of {len(answers)} "
            f"GPU node(s), where Train workers may run: "
            + " | ".join(f"node {node}: {text}" for node, text in sorted(failed.items())))
    return [f"{node}: {text}" for node, (_, text) in sorted(answers.items())]


def check_attention_on_nodes(attn_implementation: str, use_gpu: bool,
                             nodes: Iterable[Mapping] | None = None) -> list[str]:
    """`check_attention` on every alive GPU node of the connected cluster, each by a Ray
    task pinned to that node (it reads that node's packages, environment and kernel
    cache). Nothing runs when no flash kernel is loaded, so CPU runs pay nothing.
    `nodes`: `ray.nodes()` by default."""
    if not needs_flash(attn_implementation, use_gpu):
        return []
    import ray
    targets = gpu_nodes(ray.nodes() if nodes is None else nodes)
    task = ray.remote(num_cpus=0, max_retries=0)(node_answer)  # one function, every node
    refs = {label: _ask_node(task, node_id, attn_implementation, use_gpu)
            for node_id, label in targets.items()}
    answers = dict(zip(refs, ray.get(list(refs.values()), timeout=NODE_CHECK_TIMEOUT_S)))
    lines = nodes_verdict(answers)
    for line in lines:
        print(f"[areal-ray] trainer attention on {line}", flush=True)
    return lines



def _ask_node(task, node_id: str, attn_implementation: str, use_gpu: bool):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                        ).remote(attn_implementation, use_gpu)
