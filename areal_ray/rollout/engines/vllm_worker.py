"""Methods we add to vLLM's worker (`worker_extension_cls`): in-place weight loads.

vLLM runs the model in its engine-core process; `AsyncLLM.collective_rpc(name, ...)`
calls a method of the worker there. vLLM mixes this class into its worker class, so
`self` is the worker and `self.model_runner` its model runner (GPU and CPU alike).

Weights arrive as the path of one safetensors file that the replica wrote (in
/dev/shm where it exists). Tensors passed in `collective_rpc` arguments are turned
into lists by its serializer (and crashed the CPU engine when probed), a file keeps
the bytes exact and costs one copy on each side.

Two CPU-build facts shape `areal_load_weights`:
- the CPU linear layers keep a packed copy of each weight for their GEMM kernel and
  drop the original; `reload_weights` restores the parameters, loads, and re-packs;
- a tied lm_head is the embedding's weight, never loaded under its own name, so its
  packed copy is not rebuilt: we re-pack it after every load, or logits would come
  from the old embedding.

Because the CPU build drops packed weights, their bytes cannot be read back. What we
can prove is recorded instead: `areal_weights_digest` reports the hash of every tensor
exactly as vLLM's loader consumed it (when the load was asked to record it: tests do,
runs do not) and of the parameters that stay readable (embeddings, norms, biases) in
the trainer's names; tests add a logprob check of the packed copies.
"""

from __future__ import annotations

import logging

import torch
from safetensors import safe_open

from areal_ray.weights.encoding import digest


def _tied_head(model):
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    head = getattr(model, "lm_head", None)
    return head if getattr(text, "tie_word_embeddings", False) and head is not None else None


def readable_params(model) -> dict[str, torch.Tensor]:
    """The model's parameters that still hold their values, in checkpoint (HF) names:
    fused projections (qkv_proj, gate_up_proj) split back into their parts, vocabulary
    padding cut off."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.numel() == 0 or p.is_meta:
            continue  # dropped after packing (CPU GEMM kernels)
        module_name, _, attr = name.rpartition(".")
        leaf = module_name.rpartition(".")[2]
        if leaf in packed:
            module = model.get_submodule(module_name)
            sizes = list(getattr(module, "output_partition_sizes", []))
            if sum(sizes) != p.shape[0]:
                continue  # a layout we cannot split exactly (e.g. tensor parallel shards)
            prefix = module_name[: -len(leaf)]
            for part, t in zip(packed[leaf], torch.split(p.detach(), sizes, dim=0)):
                out[f"{prefix}{part}.{attr}"] = t
        else:
            module = model.get_submodule(module_name) if module_name else model
            vocab = getattr(module, "num_embeddings", None)  # vocab rows padded by vLLM
            t = p.detach()
            if vocab is not None and t.shape[0] != vocab:
                if getattr(module, "tp_size", 1) != 1:
                    continue
                t = t[:vocab]
            out[name] = t
    return out


class WeightSync:
    """Mixed into vLLM's worker class; every name is prefixed so none can clash."""

    def areal_load_weights(self, path: str, record_digest: bool = False) -> dict:
        """Load the file in place; with `record_digest`, keep the digest of every tensor
        as the loader consumed it (for tests: it holds them all until hashed)."""
        consumed: dict[str, torch.Tensor] = {}
        device = str(self.model_runner.device) if hasattr(self.model_runner, "device") else "cpu"
        n = 0

        def tensors():
            nonlocal n
            with safe_open(path, framework="pt", device=device) as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    n += 1
                    if record_digest:
                        consumed[name] = t
                    yield name, t

        # The layerwise reloader warns on every load that rotary embeddings (buffers
        # computed from the config, not weights) got none.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.model_runner.reload_weights(weights_iterator=tensors())
        head = _tied_head(self.model_runner.get_model())
        if head is not None and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)
        self._areal_loaded_digest = digest(consumed) if record_digest else None
        return {"tensors": n}

    def areal_weights_digest(self) -> dict:
        readable = readable_params(self.model_runner.get_model())
        return {"loaded": getattr(self, "_areal_loaded_digest", None),
                "readable": {k: digest({k: v}) for k, v in readable.items()}}
