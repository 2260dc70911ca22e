"""Serving pushed LoRA adapters on an engine that applies them per request (vLLM,
SGLang) rather than merging them into its weights (HFEngine): `AdapterServing`, the
engine-neutral calls, and the pure pieces they use (the peft directory, the base
check, `AdapterSlots`), which unit tests reach without an engine. Each engine supplies
three hooks: whether it was built with LoRA, how to add an adapter directory under a
name and id, and how to remove one (rollout/engines/vllm_lora.py, sglang.py).

One adapter id and name per pushed version. Both engines key prefix-cache entries by
the request's adapter (vLLM: `v1/core/kv_cache_utils.py: _gen_lora_extra_hash_keys`,
name and path; SGLang: `Req.extra_key` ends with the adapter's `lora_id`, a fresh uuid
per load), so a fresh id, name and dir per version never reuse a block computed under
an older adapter, with no prefix-cache reset (reloading under one name in place would:
vLLM #42125). A request records its adapter with its version at admission; an old id
is unloaded once the last request admitted under it has ended (`AdapterSlots`).

Running requests at a push (`rollout.lora_push`): "pause" treats them as a full push
does (aborted and resumed under the new adapter, or waited for); "finish" lets them
finish under the adapter they started with, the push closing the gate only while new
requests move onto the new id (admission.py: `FINISH`). Adapters in use at once:
requests admitted at version v are trained by step v + eta (data/staleness.py), so
while one runs the engine serves at most version v + eta, and the next is added
before its swap: eta + 2 slots (`lora_slots`).

Adapters go to the engine as a directory in peft's format (`adapter_config.json` +
`adapter_model.safetensors`, the names peft's `save_pretrained` uses), written where
staged weight files go (`staging_dir`: /dev/shm while it has room) and kept until its
id is unloaded, since an engine that evicted the adapter from its cache reads it again.
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

# Adapters resident at once when a push pauses running requests: the version being
# served and the next one, added before the push's pause so its load happens while
# requests still run on the current one. rollout.lora_push=finish needs eta + 2.
PAUSED_PUSH_SLOTS = 2


def lora_slots(eta: int, finish: bool) -> int:
    """Adapters an engine must hold at once (see the module docstring)."""
    return eta + 2 if finish else PAUSED_PUSH_SLOTS


def peft_adapter_config(adapter: Adapter) -> dict:
    """The `adapter_config.json` peft writes for this adapter (the keys vLLM and SGLang read)."""
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
    """An engine's LoRA calls (a mixin: `self` is the engine, with its gate's `_swap`,
    `owner`, `model_path` and `dtype`), around three hooks of the engine:
    `_check_lora_enabled()`, `_add_lora(lora_id, name, path)` and
    `_remove_lora(lora_id, name)`. A request passes `self.lora_name(lora_id)` or
    `self._lora[lora_id]` to the engine, per its API."""

    engine_name = ""  # names the adapter directories (their owner sweep finds them)

    def _init_lora(self) -> None:
        self.slots = AdapterSlots()  # the adapter ids the engine holds
        self._lora: dict[int, object] = {}  # id -> what the engine's requests name it by
        self._lora_dirs: dict[int, Path] = {}
        self._base_checked = False  # the first adapter's base digest was compared

    def _check_lora_enabled(self) -> None:
        raise NotImplementedError

    async def _add_lora(self, lora_id: int, name: str, path: Path) -> object:
        """Load the adapter at `path`; what requests name it by (kept in `_lora`)."""
        raise NotImplementedError

    async def _remove_lora(self, lora_id: int, handle: object) -> None:
        raise NotImplementedError

    async def _activate(self, version: int, mode: str, activate) -> dict:
        """The swap that moves new requests onto the new adapter (the gate's)."""
        return await self._swap(version, mode, activate)

    async def update_adapter(self, adapter, version: int, mode: str = "abort") -> dict:
        """Serve a pushed LoRA adapter (`weights.adapter.Adapter`) under a new adapter id
        from `version` on. The adapter is written and added to the engine before the
        pause, while requests run on the previous one; the swap only moves new requests
        onto it, and the old id is unloaded once no request uses it. A refused adapter
        (bad shape, other base) leaves the served one as it was."""
        self._check_lora_enabled()
        adapter.check()
        t0 = time.perf_counter()
        if not self._base_checked:
            await asyncio.to_thread(check_base, adapter, self.model_path, self.dtype)
            self._base_checked = True
        lora_id = self.slots.new_id()
        nbytes = sum(t.numel() * t.element_size() for t in adapter.tensors.values())
        from areal_ray.cluster.cleanup import weight_file_name
        path = staging_dir(nbytes) / weight_file_name(self.engine_name, self.owner,
                                                      adapter_dir_name())
        try:
            await asyncio.to_thread(write_peft_dir, adapter, path)
            t_written = time.perf_counter()
            self._lora[lora_id] = await self._add_lora(lora_id, f"areal-v{version}-{lora_id}", path)
        except BaseException:
            self.slots.unloaded(lora_id)
            self._lora.pop(lora_id, None)
            shutil.rmtree(path, ignore_errors=True)
            raise
        self._lora_dirs[lora_id] = path
        t_added = time.perf_counter()

        async def activate():
            self.slots.activate(lora_id)
        info = await self._activate(version, mode, activate)
        await self._unload_unused()
        return {**info, "adapter_modules": len(adapter.modules), "adapter_bytes": nbytes,
                "adapter_write_s": t_written - t0, "adapter_add_s": t_added - t_written}

    def _serve_plain_weights(self) -> None:
        """A full weight load: no adapter serves from now on. The loaded weights are the
        base of any later adapter, and their digest is not kept (it would cost a hash
        of the model per push): the checkpoint on disk no longer applies."""
        self.slots.activate(None)
        self._base_checked = True

    async def _unload_unused(self) -> None:
        """Remove from the engine (and from disk) the adapters no request uses any more."""
        for lora_id in self.slots.unused():
            self.slots.unloaded(lora_id)
            handle = self._lora.pop(lora_id, None)
            await self._remove_lora(lora_id, handle)
            shutil.rmtree(self._lora_dirs.pop(lora_id, ""), ignore_errors=True)

    def _remove_lora_dirs(self) -> None:
        """At shutdown: the adapter directories still on disk."""
        for path in self._lora_dirs.values():
            shutil.rmtree(path, ignore_errors=True)
        self._lora_dirs.clear()
        self._lora.clear()

    def adapters(self) -> dict:
        """The adapter ids this engine holds, which one serves new requests, and how many
        running requests use each (tests, stats)."""
        return {"current": self.slots.current, "loaded": sorted(self.slots.loaded),
                "users": dict(self.slots.users)}
