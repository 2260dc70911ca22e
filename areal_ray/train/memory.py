"""How much GPU memory one trainer worker needs, and so how large a micro-batch may be.

A model, not a measurement: bytes that do not depend on the micro-batch (sharded fp32
master weights, gradients and AdamW state, the gathered copies FSDP2 holds, the CUDA
context) plus bytes per token of the micro-batch (what autograd keeps for the backward),
plus the logits chunk. The per-token terms follow what a Qwen2/Llama-style decoder
layer saves, term by term (see `layer_bytes_per_token`); tests check them exactly
against saved-tensor hooks on the real Qwen2.5-1.5B architecture on CPU (sdpa), and
`jobs/gpu_check.py` compares the whole model with `torch.cuda.max_memory_allocated` on
a GPU. What it leaves out (allocator fragmentation, NCCL buffers, transient gradients
beyond one layer) is what `margin` is for. The parts are summed although the optimizer
step's temporaries and the activations are never alive together: an upper bound.

With a LoRA adapter (`model.lora`, `lora_params`) the base stays frozen: its weights
are held (sharded) as before, but gradients, AdamW's moments, the optimizer step's
temporaries and the layers' gradients in flight exist for the adapter's parameters
only. Per token, each adapted module adds its `lora_A` output (rank values) to what a
layer saves, and the full fine-tuning terms stay: an upper bound, since a frozen base
saves less (the norms' normalised inputs, which only their weights' gradients need;
measured 10% below the bound on Qwen2.5-1.5B's layers with every projection adapted).

`plan()` gives, for a run config and a model config, the bytes by part, whether
`algo.microbatch.max_tokens` fits `train.gpu_memory_gib`, and the largest budget that does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

GIB = 1 << 30
# CUDA context, cuBLAS/NCCL workspaces, allocator slack of a training process.
OVERHEAD_BYTES = int(1.5 * GIB)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a Qwen2/Llama-style decoder that memory depends on."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_hf(cls, config) -> DecoderShape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(hidden=config.hidden_size, intermediate=config.intermediate_size,
                   layers=config.num_hidden_layers, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=head_dim, vocab=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)),
                   qkv_bias=bool(getattr(config, "attention_bias", config.model_type == "qwen2")))

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h = self.hidden
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        return attn + 3 * h * self.intermediate + 2 * h  # + two RMSNorm weights

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers (FSDP2's root unit): embeddings, the
        final norm, and an untied output projection."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear module of a decoder layer, by the name peft
        matches (`model.lora.target_modules`)."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i),
                "down_proj": (i, h)}

    def lora_params(self, rank: int, targets) -> int:
        """Parameters of a rank-`rank` adapter on `targets` in one decoder layer
        (A: rank x in, B: out x rank per module)."""
        shapes = self.linear_shapes()
        unknown = sorted(set(targets) - set(shapes))
        if unknown:
            raise ValueError(f"the memory model knows no decoder-layer module {unknown}; "
                             f"it models {', '.join(shapes)}")
        return sum(rank * sum(shapes[t]) for t in set(targets))


def layer_bytes_per_token(s: DecoderShape, b: int) -> int:
    """What autograd keeps per token of one decoder layer, compute dtype of `b` bytes."""
    norms = 2 * (4 * s.hidden + b * s.hidden + 4)  # fp32 input, rsqrt, normalised (b), twice
    proj_inputs = 2 * b * s.hidden  # the norms' outputs: inputs of q/k/v and of gate/up
    attention = b * (2 * s.q_dim + 2 * s.kv_dim) + 4 * s.heads  # q, k, v, output; fp32 LSE
    mlp = 4 * b * s.intermediate  # gate, silu(gate), up, down_proj's input
    return norms + proj_inputs + attention + mlp


def activation_bytes_per_token(s: DecoderShape, b: int, checkpointing: bool,
                               lora_outputs: int = 0) -> int:
    """Saved for the backward per token of a micro-batch, whole model (the logits
    excepted: they are chunked, `logits_bytes`). With checkpointing a layer keeps only
    its input; the rotary cos/sin then live inside the recomputed layers.
    `lora_outputs`: rank x adapted modules per layer (LoRA: each `lora_A` output)."""
    per_layer = b * s.hidden if checkpointing else layer_bytes_per_token(s, b) + b * lora_outputs
    final_norm = 4 * s.hidden + b * s.hidden + 4
    head_input = b * s.hidden
    rotary = 0 if checkpointing else 2 * s.head_dim * b
    token_ids = 8
    return s.layers * per_layer + final_norm + head_input + rotary + token_ids


def logits_bytes(s: DecoderShape, tokens: int, chunk_bytes: int) -> int:
    """The fp32 logits alive at once: one chunk (or the whole micro-batch if smaller),
    about three times over (logits, their exp in the log-sum-exp, their gradient)."""
    rows = max(1, chunk_bytes // (4 * s.vocab))
    return 3 * min(tokens, rows) * s.vocab * 4


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes by part for one trainer worker; `total` is what must fit the GPU."""
    weights: int  # sharded master weights
    grads: int  # sharded master-dtype gradients
    optimizer: int  # AdamW's two moments, sharded
    gathered: int  # compute-dtype copies FSDP2 gathers: the root unit, two layers in flight, their grads
    reference: int  # the frozen KL reference model, if any
    activations: int  # saved for the backward, all tokens of one micro-batch
    backward_work: int  # one layer's activations being recomputed or its gradients in flight
    logits: int
    optimizer_step: int  # AdamW's foreach temporaries (one master-dtype shard), grads still alive
    overhead: int

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    @property
    def resident(self) -> int:
        """What stays allocated between steps (the process keeps its state, gradients
        until the next step's zero_grad, and its context): what a rollout engine sharing
        the GPU must leave room for while it generates."""
        return self.weights + self.grads + self.optimizer + self.reference + self.overhead

    def table(self) -> dict[str, float]:
        return {**{k: round(v / GIB, 2) for k, v in asdict(self).items()},
                "total": round(self.total / GIB, 2)}


def trainer_memory(s: DecoderShape, tokens: int, world: int, compute_bytes: int = 2,
                   master_bytes: int = 4, checkpointing: bool = False,
                   chunk_bytes: int = 256 << 20, reference: bool = False,
                   lora_rank: int = 0, lora_targets: tuple[str, ...] = ()) -> TrainerMemory:
    """`lora_rank` > 0: a LoRA adapter on `lora_targets` is trained, the rest is frozen."""
    adapter = s.lora_params(lora_rank, lora_targets) if lora_rank else 0
    layer = s.layer_params + adapter  # what FSDP2 gathers of a layer
    layer_trained = adapter if lora_rank else s.layer_params  # ... and the grads it reduces
    shard = (s.params + s.layers * adapter) / world
    trained = (s.layers * adapter if lora_rank else s.params) / world
    lora_outputs = lora_rank * len(set(lora_targets))
    gathered = s.root_params * compute_bytes + 2 * (layer * compute_bytes + layer_trained * 4)
    ref = (shard + s.root_params + 2 * s.layer_params) * compute_bytes if reference else 0
    return TrainerMemory(
        weights=int(shard * master_bytes), grads=int(trained * master_bytes),
        optimizer=int(2 * trained * master_bytes), gathered=int(gathered), reference=int(ref),
        activations=tokens * activation_bytes_per_token(s, compute_bytes, checkpointing,
                                                        lora_outputs),
        backward_work=tokens * (layer_bytes_per_token(s, compute_bytes) + compute_bytes * lora_outputs),
        logits=logits_bytes(s, tokens, chunk_bytes), optimizer_step=int(trained * master_bytes),
        overhead=OVERHEAD_BYTES)


def lora_kwargs(cfg) -> dict:
    """`trainer_memory`'s LoRA arguments from a run config (none without `model.lora`)."""
    lora = cfg.model.lora
    return dict(lora_rank=lora.rank, lora_targets=tuple(lora.target_modules)) if lora.enabled else {}


def max_tokens(budget_bytes: int, **kwargs) -> int:
    """The largest micro-batch (tokens) whose `trainer_memory(...)` total fits the budget."""
    lo, hi = 0, 1 << 22
    while lo < hi:  # the total grows with tokens: bisect
        mid = (lo + hi + 1) // 2
        if trainer_memory(tokens=mid, **kwargs).total <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan(cfg, shape: DecoderShape, gpu_gib: float | None = None, margin: float = 0.1) -> dict:
    """The memory plan of run config `cfg` for a model of `shape` on GPUs of `gpu_gib`
    (default `train.gpu_memory_gib`): the model's bytes by part at `algo.microbatch.max_tokens`,
    the largest budget that leaves `margin` of the GPU free, and whether the config fits."""
    gpu_gib = gpu_gib or cfg.train.gpu_memory_gib
    kwargs = dict(s=shape, world=cfg.train.num_workers,
                  compute_bytes=DTYPE_BYTES[cfg.model.dtype],
                  master_bytes=DTYPE_BYTES[cfg.train.master_dtype or cfg.model.dtype],
                  checkpointing=cfg.train.activation_checkpointing,
                  chunk_bytes=cfg.train.logits_chunk_mb << 20, reference=cfg.algo.loss.kl_coef > 0,
                  **lora_kwargs(cfg))
    budget = int(gpu_gib * GIB * (1 - margin))
    best = max_tokens(budget, **kwargs)
    tokens = cfg.algo.microbatch.max_tokens or best
    mem = trainer_memory(tokens=tokens, **kwargs)
    return {"gpu_gib": gpu_gib, "margin": margin, "max_tokens_per_mb": tokens,
            "fits": mem.total <= budget, "largest_max_tokens_per_mb": best,
            "free_gib": round((gpu_gib * GIB - mem.total) / GIB, 2),
            "activation_bytes_per_token": mem.activations // max(tokens, 1),
            "gib": mem.table()}


def random_decoder(config, dtype: torch.dtype = torch.bfloat16, device="cpu",
                   attn_implementation: str = "sdpa"):
    """A causal LM of `config`'s architecture with random weights (normal, std 0.02),
    built without transformers' per-module initialisation (minutes on CPU for 1.5B)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    with no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    model.tie_weights()  # skipped under no_init_weights
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model


def saved_storages(fn, model=None) -> tuple[object, list[int]]:
    """(fn(), the byte sizes of the storages autograd saves for its backward), each
    storage once, `model`'s parameters (if given) left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, [v for k, v in seen.items() if k not in params]


def saved_activation_bytes(fn, model) -> tuple[object, int]:
    """(fn(), bytes autograd saves for its backward, `model`'s parameters left out):
    what `activation_bytes_per_token` models."""
    out, sizes = saved_storages(fn, model)
    return out, sum(sizes)
