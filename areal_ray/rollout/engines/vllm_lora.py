"""LoRA on vLLM (`model.lora` with `rollout.backend=vllm`): `AdapterServing`, the
`VLLMEngine` calls that serve pushed adapters, and the pure pieces they use (engine
arguments, the peft directory, the base check, `AdapterSlots`), which unit tests reach
without an engine.

vLLM serves an adapter per request (`LoRARequest`) on top of the base weights it
loaded, with its own LoRA kernels (punica; `PunicaWrapperCPU` on the CPU build), so
nothing is merged into the base: the served logits are base + the adapter's low-rank
term computed apart, which equals the trainer's merged model only up to float
rounding (the test measures how far).

One adapter id per pushed version. vLLM keys prefix-cache blocks by the request's
adapter (`v1/core/kv_cache_utils.py: _gen_lora_extra_hash_keys`, name and path), so a
fresh id, name and dir per version never reuse a block computed under an older
adapter, with no prefix-cache reset (reloading under one name in place would: vLLM
#42125). A request records its adapter with its version at admission; an old id is
unloaded once the last request admitted under it has ended (`AdapterSlots`).

Running requests at a push (`rollout.lora_push`): "pause" treats them as a full push
does (aborted and resumed under the new adapter, or waited for); "finish" lets them
finish under the adapter they started with, the push closing the gate only while new
requests move onto the new id (admission.py: `FINISH`). Adapters in use at once:
requests admitted at version v are trained by step v + eta (data/staleness.py), so
while one runs the engine serves at most version v + eta, and the next is added
before its swap: eta + 2 slots (`lora_slots`), vLLM's `max_loras` (adapters in one
batch) and `max_cpu_loras` (adapters held). Past that vLLM still serves every
request, an evicted adapter reloaded from its directory, only slower.

Adapters go to vLLM as a directory in peft's format (`adapter_config.json` +
`adapter_model.safetensors`): `LoRARequest` names a path and vLLM's worker reads it
with `PEFTHelper.from_local_dir` when the adapter is added (`AsyncLLM.add_lora`).
The directory is written where staged weight files go (`staging_dir`: /dev/shm while
it has room) and is kept until its id is unloaded, since vLLM's worker may read it
again if its LRU cache evicted the adapter.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path

from areal_ray.weights.adapter import Adapter, base_digest, peft_tensors
from areal_ray.weights.staging import staging_dir

# vLLM's `LoRAConfig.max_lora_rank` takes only these (vllm/config/lora.py: MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Adapters resident at once when a push pauses running requests: the version being
# served and the next one, added before the push's pause so its load happens while
# requests still run on the current one. rollout.lora_push=finish needs eta + 2.
PAUSED_PUSH_SLOTS = 2


def lora_slots(eta: int, finish: bool) -> int:
    """Adapters vLLM must hold at once (see the module docstring)."""
    return eta + 2 if finish else PAUSED_PUSH_SLOTS


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds a rank-`rank` adapter."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"model.lora.rank={rank} is above vLLM's largest max_lora_rank "
                     f"({VLLM_LORA_RANKS[-1]})")


def lora_engine_args(rank: int, slots: int = PAUSED_PUSH_SLOTS) -> dict:
    """AsyncEngineArgs for serving adapters of `rank` (none when 0: LoRA off), `slots` of
    them at once."""
    if rank <= 0:
        return {}
    return dict(enable_lora=True, max_lora_rank=max_lora_rank(rank), max_loras=slots,
                max_cpu_loras=slots)


def peft_adapter_config(adapter: Adapter) -> dict:
    """The `adapter_config.json` peft writes for this adapter (the keys vLLM reads)."""
    m = adapter.meta
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": m.rank, "lora_alpha": m.alpha,
            "target_modules": sorted({t.rsplit(".", 1)[-1] for t in m.targets}),
            "base_model_name_or_path": m.base, "bias": "none", "use_rslora": False,
            "use_dora": False, "lora_dropout": 0.0}


def write_peft_dir(adapter: Adapter, path: Path) -> Path:
    """`adapter` in peft's on-disk format in the new directory `path`; removed again
    if writing fails. Blocking: callers run it in a thread."""
    from safetensors.torch import save_file
    path.mkdir()
    try:
        (path / "adapter_config.json").write_text(json.dumps(peft_adapter_config(adapter)))
        save_file({k: v.contiguous() for k, v in peft_tensors(adapter).items()},
                  str(path / "adapter_model.safetensors"))
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def adapter_dir_name() -> str:
    return f"lora-{uuid.uuid4().hex}"


def read_base(model_path: str, modules: list[str]) -> dict:
    """module -> its `weight` as the checkpoint at `model_path` holds it (safetensors,
    one file or sharded with an index), read tensor by tensor."""
    from safetensors import safe_open
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    where = (json.loads(index.read_text())["weight_map"] if index.exists()
             else {None: "model.safetensors"})
    out = {}
    for m in modules:
        name = f"{m}.weight"
        file = where.get(name) if index.exists() else where[None]
        if file is None:
            raise ValueError(f"the adapter adapts {m}, which the model at {model_path} does not have")
        with safe_open(str(root / file), framework="pt") as f:
            if name not in f.keys():
                raise ValueError(f"the adapter adapts {m}, which the model at {model_path} "
                                 "does not have")
            out[m] = f.get_tensor(name)
    return out


def check_base(adapter: Adapter, model_path: str, dtype: str) -> None:
    """Refuse an adapter trained on other base weights than the checkpoint vLLM loaded
    (`AdapterMeta.base_digest`; empty: not checked)."""
    if not adapter.meta.base_digest:
        return
    if base_digest(read_base(model_path, adapter.modules), dtype) != adapter.meta.base_digest:
        raise ValueError(f"the adapter was trained on base {adapter.meta.base} with other "
                         f"weights than this engine serves ({model_path}): base digests differ")


class AdapterSlots:
    """Which vLLM adapter id serves new requests, how many running requests use each
    id, and which ids can be unloaded. Pure bookkeeping; the engine does the calls.

    `current` is None while the engine serves its base weights (before the first
    adapter, or after a full weight push)."""

    def __init__(self):
        self._next = 1  # vLLM's lora_int_id must be > 0
        self.current: int | None = None
        self.users: Counter[int] = Counter()
        self.loaded: set[int] = set()
        # Added to vLLM ahead of its push's swap: not serving yet, but not to unload.
        self.pending: set[int] = set()

    def new_id(self) -> int:
        """A fresh id, never reused within the engine's life (vLLM #42125)."""
        i, self._next = self._next, self._next + 1
        self.loaded.add(i)
        self.pending.add(i)
        return i

    def activate(self, lora_id: int | None) -> None:
        """New requests use `lora_id` (None: the base weights) from now on."""
        if lora_id is not None and lora_id not in self.loaded:
            raise ValueError(f"adapter id {lora_id} is not loaded")
        self.pending.discard(lora_id)
        self.current = lora_id

    def acquire(self) -> int | None:
        """A request starts: it runs under the current id (returned)."""
        if self.current is not None:
            self.users[self.current] += 1
        return self.current

    def release(self, lora_id: int | None) -> None:
        """A request that ran under `lora_id` ended."""
        if lora_id is None:
            return
        if self.users[lora_id] <= 0:
            raise ValueError(f"adapter id {lora_id} released more often than acquired")
        self.users[lora_id] -= 1
        if not self.users[lora_id]:
            del self.users[lora_id]

    def unused(self) -> list[int]:
        """Loaded ids that neither serve new requests nor run any: to unload now."""
        return sorted(i for i in self.loaded - self.pending
                      if i != self.current and not self.users[i])

    def unloaded(self, lora_id: int) -> None:
        """`lora_id` is gone from vLLM (or its add failed)."""
        self.loaded.discard(lora_id)
        self.pending.discard(lora_id)


class AdapterServing:
    """`VLLMEngine`'s LoRA calls (a mixin: `self` is the engine, with its `engine`, an
    AsyncLLM, its gate's `_swap`, `owner`, `model_path`, `dtype` and sleep state)."""

    def _init_lora(self) -> None:
        self.slots = AdapterSlots()  # the adapter ids vLLM holds
        self._lora: dict[int, object] = {}  # id -> its LoRARequest
        self._base_checked = False  # the first adapter's base digest was compared

    async def update_adapter(self, adapter, version: int, mode: str = "abort") -> dict:
        """Serve a pushed LoRA adapter (`weights.adapter.Adapter`) under a new adapter id
        from `version` on (vllm_lora.py). The adapter is written and added to vLLM
        before the pause, while requests run on the previous one; the swap only moves new
        requests onto it, and the old id is unloaded once no request uses it. A refused
        adapter (bad shape, other base) leaves the served one as it was."""
        if not self.engine.vllm_config.lora_config:
            raise RuntimeError("this vLLM engine was built without LoRA: the replica passes "
                               "model.lora.rank as lora_rank (enable_lora)")
        adapter.check()
        t0 = time.perf_counter()
        if not self._base_checked:
            await asyncio.to_thread(check_base, adapter, self.model_path, self.dtype)
            self._base_checked = True
        lora_id = self.slots.new_id()
        nbytes = sum(t.numel() * t.element_size() for t in adapter.tensors.values())
        from areal_ray.cluster.cleanup import weight_file_name
        path = staging_dir(nbytes) / weight_file_name("vllm", self.owner, adapter_dir_name())
        try:
            await asyncio.to_thread(write_peft_dir, adapter, path)
            t_written = time.perf_counter()
            from vllm.lora.request import LoRARequest  # the engine exists: vLLM is installed
            request = LoRARequest(f"areal-v{version}-{lora_id}", lora_id, str(path))
            async with self._memory:  # asleep, vLLM's LoRA slots sleep with the weights
                if "weights" in self.asleep:
                    await self._wake(["weights"])
                if not await self.engine.add_lora(request):
                    raise RuntimeError(f"vLLM refused adapter v{version} (id {lora_id})")
        except BaseException:
            self.slots.unloaded(lora_id)
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._lora[lora_id] = request
        t_added = time.perf_counter()

        async def activate():
            self.slots.activate(lora_id)
        info = await self._swap(version, mode, activate)
        await self._unload_unused()
        return {**info, "adapter_modules": len(adapter.modules), "adapter_bytes": nbytes,
                "adapter_write_s": t_written - t0, "adapter_add_s": t_added - t_written}

    async def _unload_unused(self) -> None:
        """Remove from vLLM (and from disk) the adapters no request uses any more."""
        for lora_id in self.slots.unused():
            self.slots.unloaded(lora_id)
            request = self._lora.pop(lora_id, None)
            await self.engine.remove_lora(lora_id)
            if request is not None:
                shutil.rmtree(request.lora_path, ignore_errors=True)

    def adapters(self) -> dict:
        """The adapter ids this engine holds, which one serves new requests, and how many
        running requests use each (tests, stats)."""
        return {"current": self.slots.current, "loaded": sorted(self.slots.loaded),
                "users": dict(self.slots.users)}

