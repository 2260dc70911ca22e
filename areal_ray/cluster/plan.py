"""Where a run's actors go on a cluster, and whether GPUs shared by an engine and a
trainer worker have the memory for both: decided before anything is deployed.

Ray places actors by logical resources alone and waits without end for a request no
node can meet: Serve's `serve.run` waits for every replica, Ray Train retries a worker
group it cannot place forever. Neither knows that a replica asking for half a GPU and
a trainer worker asking for the other half need more memory than the device has. So
the job places the run on the cluster's shape here first (`place`) and refuses a plan
that cannot work, naming the numbers, in seconds; `jobs/plan.py` prints the same plan
for a cluster that does not exist yet.

Placement follows Ray's rules: a request of one GPU or more takes whole free GPUs on one
node; a fraction takes part of a single GPU (first one with enough left), never parts of
two. Actors are placed in the order the job starts them (replicas, then trainer
workers, then reward actors), first fit. Passing here is necessary, not sufficient:
other jobs' actors may hold what this plan counts on, which is what the placement
deadline (`run.placement_timeout_s`) is for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_ray.train.memory import DTYPE_BYTES, GIB, DecoderShape, lora_kwargs, trainer_memory

MARGIN = 0.1  # of each GPU left free: fragmentation, NCCL buffers, what no model counts
# Engine memory outside its configured fraction or model: sglang's CUDA graphs, sampler
# and activations live beyond mem_fraction_static (GPU_AUDIT O1); every engine process
# has a CUDA context.
CONTEXT_GIB = 0.75
SGLANG_OUTSIDE_GIB = 2.0
# Prompt tokens assumed per sequence for the hf engine's KV cache, which grows with
# its batch (vLLM and sglang preallocate a fraction instead).
HF_PROMPT_TOKENS = 512
DEFAULT_FRACTION = {"vllm": ("gpu_memory_utilization", 0.9), "sglang": ("mem_fraction_static", 0.88)}


@dataclass(frozen=True)
class Node:
    name: str
    cpus: float
    gpus: int
    gpu_memory_gib: float = 0.0  # 0: unknown (Ray does not report it)

    @classmethod
    def from_ray(cls, info: dict) -> Node:
        """A node of `ray.nodes()`."""
        res = info.get("Resources", {})
        return cls(info.get("NodeManagerAddress") or info.get("NodeID", "?")[:8],
                   float(res.get("CPU", 0)), int(res.get("GPU", 0)))


def cluster_shape(nodes: int = 1, cpus: float = 16, gpus: int = 1,
                  gpu_memory_gib: float = 80.0) -> list[Node]:
    """`nodes` identical nodes: the shape `jobs.plan` is asked about."""
    return [Node(f"node{i}", cpus, gpus, gpu_memory_gib) for i in range(nodes)]


@dataclass(frozen=True)
class Demand:
    role: str
    cpus: float
    gpus: float
    count: int

    def label(self) -> str:
        gpu = f", {self.gpus:g} GPU" if self.gpus else ""
        return f"{self.count} {self.role}{'s' if self.count != 1 else ''} x ({self.cpus:g} CPU{gpu})"


REPLICA, TRAINER, REWARD = "rollout replica", "trainer worker", "reward actor"


def demands(cfg, training: bool = True) -> list[Demand]:
    """What the run asks Ray for, in the order the job starts it (`training=False`: the
    eval job, replicas alone). The driver actor, the Data stages that call the replicas
    and the OpenAI endpoint take no CPU."""
    r, t = cfg.rollout, cfg.train
    if not training:
        return [Demand(REPLICA, r.num_cpus, r.num_gpus, r.min_replicas)]
    return [Demand(REPLICA, r.num_cpus, r.num_gpus, r.min_replicas),
            Demand(TRAINER, t.num_cpus_per_worker, t.num_gpus_per_worker if t.use_gpu else 0.0,
                   t.num_workers),
            Demand(REWARD, cfg.reward.num_cpus, 0.0, cfg.reward.min_actors)]


@dataclass
class Slot:
    role: str
    index: int
    node: str
    gpus: tuple[int, ...] = ()  # GPU indices on the node
    share: float = 0.0  # of each of those GPUs


@dataclass
class _Free:
    node: Node
    cpus: float
    gpus: list[float]  # free share of each GPU

    def take(self, d: Demand) -> tuple[int, ...] | None:
        eps = 1e-9
        if self.cpus + eps < d.cpus:
            return None
        if d.gpus >= 1:
            whole = [i for i, f in enumerate(self.gpus) if f >= 1 - eps][:int(d.gpus)]
            if len(whole) < d.gpus:
                return None
            got = tuple(whole)
        elif d.gpus > 0:
            part = next((i for i, f in enumerate(self.gpus) if f + eps >= d.gpus), None)
            if part is None:
                return None
            got = (part,)
        else:
            got = ()
        self.cpus -= d.cpus
        for i in got:
            self.gpus[i] -= min(d.gpus, 1.0)
        return got


@dataclass
class Placement:
    nodes: list[Node]
    slots: list[Slot] = field(default_factory=list)
    unplaced: list[tuple[Demand, int]] = field(default_factory=list)  # (demand, which one)

    @property
    def fits(self) -> bool:
        return not self.unplaced

    def sharing(self) -> dict[tuple[str, int], list[Slot]]:
        """(node, GPU index) -> the slots on that GPU."""
        out: dict[tuple[str, int], list[Slot]] = {}
        for s in self.slots:
            for g in s.gpus:
                out.setdefault((s.node, g), []).append(s)
        return out


def place(needs: list[Demand], nodes: list[Node]) -> Placement:
    free = [_Free(n, n.cpus, [1.0] * n.gpus) for n in nodes]
    out = Placement(nodes)
    for d in needs:
        for i in range(d.count):
            for f in free:
                got = f.take(d)
                if got is not None:
                    out.slots.append(Slot(d.role, i, f.node.name, got, min(d.gpus, 1.0)))
                    break
            else:
                out.unplaced.append((d, i))
    return out


def placement_error(needs: list[Demand], p: Placement) -> str:
    """Why `p` does not fit: what the run asks for against what the cluster has."""
    want_gpu = sum(d.gpus * d.count for d in needs)
    want_cpu = sum(d.cpus * d.count for d in needs)
    have = ", ".join(f"{n.name}: {n.cpus:g} CPU, {n.gpus} GPU" for n in p.nodes) or "no nodes"
    missing = {}
    for d, _ in p.unplaced:
        missing[d.role] = missing.get(d.role, 0) + 1
    lines = [f"this run cannot be placed on the cluster: it asks for {want_gpu:g} GPU and "
             f"{want_cpu:g} CPU ({'; '.join(d.label() for d in needs if d.count)}); the cluster has "
             f"{sum(n.gpus for n in p.nodes)} GPU and {sum(n.cpus for n in p.nodes):g} CPU ({have}).",
             "Could not place: " + ", ".join(f"{k} x{v}" for k, v in missing.items()) + "."]
    if any(d.gpus for d in needs):
        lines.append("Fewer replicas or workers (rollout.min_replicas, train.num_workers), or "
                     "fractional GPUs (rollout.num_gpus, train.num_gpus_per_worker) sharing a "
                     "GPU, as in conf/gsm8k_qwen_1gpu.yaml; `python -m jobs.plan` checks a shape.")
    return "\n".join(lines)


# ------------------------------------------------------------------ GPU memory
def engine_fraction(cfg) -> float:
    """The share of its GPU a vLLM/sglang engine preallocates (engine_kwargs, or the
    engine's default)."""
    key, default = DEFAULT_FRACTION.get(cfg.rollout.backend, ("", 0.0))
    return float(cfg.rollout.engine_kwargs.get(key, default)) if key else 0.0


def engine_gib(cfg, shape: DecoderShape, gpu_gib: float) -> dict[str, float]:
    """GiB one engine holds on its GPU while it generates (`awake`) and while released
    for a trainer step (`asleep`; rollout.release_memory)."""
    backend = cfg.rollout.backend
    weights = shape.params * DTYPE_BYTES[cfg.model.dtype] / GIB
    if backend == "vllm":  # gpu_memory_utilization bounds the whole instance
        awake = engine_fraction(cfg) * gpu_gib
        asleep = CONTEXT_GIB  # sleep level 1: weights to host, KV cache discarded
    elif backend == "sglang":  # weights + KV pool within the fraction, graphs and sampler beyond
        awake = engine_fraction(cfg) * gpu_gib + SGLANG_OUTSIDE_GIB
        asleep = SGLANG_OUTSIDE_GIB  # release_memory_occupation frees weights and KV pool
    else:  # hf: the model and a KV cache that grows with the running batch
        kv_per_token = 2 * shape.layers * shape.kv_dim * DTYPE_BYTES[cfg.model.dtype]
        rows = cfg.rollout.max_batch_size
        kv = rows * (HF_PROMPT_TOKENS + cfg.rollout.max_new_tokens) * kv_per_token / GIB
        awake = CONTEXT_GIB + weights + kv
        asleep = CONTEXT_GIB + weights  # release only returns the cache to the device
    return {"awake": round(awake, 2), "asleep": round(asleep, 2)}


def trainer_gib(cfg, shape: DecoderShape) -> dict[str, float]:
    """GiB one trainer worker holds at its step's peak (`step`) and between steps
    (`resident`), by the memory model (areal_ray/train/memory.py)."""
    mem = trainer_memory(shape, cfg.algo.microbatch.max_tokens or 4096, cfg.train.num_workers,
                         compute_bytes=DTYPE_BYTES[cfg.model.dtype],
                         master_bytes=DTYPE_BYTES[cfg.train.master_dtype or cfg.model.dtype],
                         checkpointing=cfg.train.activation_checkpointing,
                         chunk_bytes=cfg.train.logits_chunk_mb << 20,
                         reference=cfg.algo.loss.kl_coef > 0, **lora_kwargs(cfg))
    return {"step": round(mem.total / GIB, 2), "resident": round(mem.resident / GIB, 2)}


def gpu_phases(roles: list[str], engine: dict, trainer: dict, release: bool) -> dict[str, float]:
    """GiB in use on one GPU holding `roles`, in each phase of a step: while the engines
    generate and while the trainer steps (engines released or not)."""
    n_eng, n_tr = roles.count(REPLICA), roles.count(TRAINER)
    generate = n_eng * engine["awake"] + n_tr * trainer["resident"]
    step = n_eng * (engine["asleep"] if release else engine["awake"]) + n_tr * trainer["step"]
    return {"generate": round(generate, 2), "step": round(step, 2)}


def memory_plan(cfg, shape: DecoderShape, p: Placement, gpu_gib: float) -> dict:
    """Per GPU in use: who is on it, GiB per phase, and whether each phase fits
    `gpu_gib` less MARGIN. A GPU with no trainer worker is the engine's alone (its
    fraction is its own business); a trainer worker's GPU is checked in both phases."""
    engine, trainer = engine_gib(cfg, shape, gpu_gib), trainer_gib(cfg, shape)
    budget = gpu_gib * (1 - MARGIN)
    gpus = []
    for (node, idx), slots in sorted(p.sharing().items()):
        roles = [s.role for s in slots]
        phases = gpu_phases(roles, engine, trainer, cfg.rollout.release_memory)
        checked = TRAINER in roles
        gpus.append({"node": node, "gpu": idx, "on": [f"{s.role} {s.index}" for s in slots],
                     "gib": phases, "fits": not checked or max(phases.values()) <= budget})
    return {"gpu_gib": gpu_gib, "budget_gib": round(budget, 2), "engine_gib": engine,
            "trainer_gib": trainer, "release_memory": cfg.rollout.release_memory, "gpus": gpus,
            "fits": all(g["fits"] for g in gpus)}


def memory_error(plan: dict) -> str:
    bad = [g for g in plan["gpus"] if not g["fits"]]
    where = "; ".join(f"{g['node']} GPU {g['gpu']} ({', '.join(g['on'])}): {g['gib']}" for g in bad)
    hint = ("lower the engine's share (rollout.engine_kwargs gpu_memory_utilization / "
            "mem_fraction_static), algo.microbatch.max_tokens")
    if not plan["release_memory"]:
        hint += ", or free the engine's memory during steps (rollout.release_memory=true)"
    return (f"GPU memory does not fit {plan['budget_gib']} GiB of {plan['gpu_gib']} "
            f"(engine {plan['engine_gib']}, trainer {plan['trainer_gib']} GiB): {where}; {hint}")
