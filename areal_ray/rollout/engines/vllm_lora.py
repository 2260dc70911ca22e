"""LoRA on vLLM (`model.lora` with `rollout.backend=vllm`): the engine arguments and
`VLLMAdapters`, `VLLMEngine`'s hooks of `AdapterServing` (adapters.py, which says
how pushed adapters are served: one id per version, the prefix cache, `lora_push`).

vLLM serves an adapter per request (`LoRARequest`) on top of the base weights it
loaded, with its own LoRA kernels (punica; `PunicaWrapperCPU` on the CPU build), so
nothing is merged into the base: the served logits are base + the adapter's low-rank
term computed apart, which equals the trainer's merged model only up to float
rounding (the test measures how far). A `LoRARequest` names the adapter's directory,
which vLLM's worker reads with `PEFTHelper.from_local_dir` when it is added
(`AsyncLLM.add_lora`). `lora_slots` adapters at once: vLLM's `max_loras` (adapters in
one batch) and `max_cpu_loras` (adapters held); past that vLLM still serves every
request, an evicted adapter reloaded from its directory, only slower.
"""

from __future__ import annotations

from pathlib import Path

from areal_ray.rollout.engines.adapters import PAUSED_PUSH_SLOTS, AdapterServing

# vLLM's `LoRAConfig.max_lora_rank` takes only these (vllm/config/lora.py: MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


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


class VLLMAdapters(AdapterServing):
    """`VLLMEngine`'s hooks (`self` is the engine: its `engine`, an AsyncLLM, and its
    sleep state). Requests pass `self._lora[lora_id]`, the `LoRARequest`."""

    engine_name = "vllm"

    def _check_lora_enabled(self) -> None:
        if not self.engine.vllm_config.lora_config:
            raise RuntimeError("this vLLM engine was built without LoRA: the replica passes "
                               "model.lora.rank as lora_rank (enable_lora)")

    async def _add_lora(self, lora_id: int, name: str, path: Path):
        from vllm.lora.request import LoRARequest  # the engine exists: vLLM is installed
        request = LoRARequest(name, lora_id, str(path))
        async with self._memory:  # asleep, vLLM's LoRA slots sleep with the weights
            if "weights" in self.asleep:
                await self._wake(["weights"])
            if not await self.engine.add_lora(request):
                raise RuntimeError(f"vLLM refused adapter {name} (id {lora_id})")
        return request

    async def _remove_lora(self, lora_id: int, handle) -> None:
        """Remove the adapter from vLLM, unless its weights sleep: vLLM's LoRA slots live
        in the weights' memory pool (its model is loaded inside it), so a remove then
        would write into unmapped memory, and waking the weights for it would put them
        back on the GPU during a trainer step. It is then removed when they wake."""
        async with self._memory:
            if "weights" in self.asleep:
                self._removals.add(lora_id)
                return
            await self.engine.remove_lora(lora_id)

    async def _remove_deferred(self) -> None:
        """The removes that found the weights asleep (`_memory` held, weights awake)."""
        while self._removals:
            await self.engine.remove_lora(self._removals.pop())
