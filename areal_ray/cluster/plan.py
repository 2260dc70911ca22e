"""Where a run's actors go on a cluster, and whether GPUs shared by an engine and a
trainer worker have the memory for both: decided before anything is deployed.

Ray places actors by logical resources alone and waits without end for a request no
node can meet: Serve's `serve.run` waits for every replica, Ray Train retries a worker
group it cannot place forever. Neither knows that a replica asking for half a GPU and
a trainer worker asking for the other half need more memory than the device has. So
the job places the run on the cluster's shape here first (`place`) and refuses a plan
that cannot work, naming the numbers, in seconds; `jobs/plan.py` prints the same plan
for a cluster that does not exist yet.

Placement follows Ray's rules on a node (its raylet's `TryAllocate`,
src/ray/common/scheduling/resource_instance_set.cc): a request of one GPU or more takes
whole free GPUs on one node, lowest index first; a fraction takes part of a single GPU,
never parts of two, and the GPU it takes is the best fit: the one it leaves least free
(the lowest index of equals). So on a node with several GPUs fractions pile onto the
fullest GPU that still fits them, and one replica and one trainer worker are not paired
per GPU (that pairing would need a placement group, which the job does not make):
fractional sharing is a layout for nodes of one GPU. Actors are placed in the order the
job starts them (replicas, then trainer workers, then reward actors), each on the first
node that fits; which node Ray picks is its own choice (Serve spreads replicas, Ray
Train packs its workers), so across nodes this is one possible placement, checked GPU by
GPU. Passing here is necessary, not sufficient: other jobs' actors may hold what this
plan counts on, which is what the placement deadline (`run.placement_timeout_s`) is for.

A placement Ray would make can still not start, and `sharing_error` refuses it by rule:
two trainer workers on one GPU (NCCL), and engines whose memory shares leave less than
the margin of a GPU they share (each engine's start-up measures what is free).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_ray.cluster.roles import RESERVED, NodeRequirement
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
    resources: dict = field(default_factory=dict)  # custom resources (roles.py)
    labels: dict = field(default_factory=dict)  # Ray node labels

    @classmethod
    def from_ray(cls, info: dict) -> Node:
        """A node of `ray.nodes()`."""
        res = info.get("Resources", {})
        custom = {k: float(v) for k, v in res.items() if k not in RESERVED
                  and not k.startswith(("node:", "accelerator_type:"))}
        return cls(info.get("NodeManagerAddress") or info.get("NodeID", "?")[:8],
                   float(res.get("CPU", 0)), int(res.get("GPU", 0)),
                   resources=custom, labels=dict(info.get("Labels") or {}))

    def node_type(self) -> str:
        """The node's name with its custom resources and labels (roles.py)."""
        res = ", ".join(f"{k}={v:g}" for k, v in self.resources.items()) or "no custom resources"
        labels = ", ".join(f"{k}={v}" for k, v in self.labels.items())
        return f"{self.name} ({res}{', labels ' + labels if labels else ''})"


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
    needs: NodeRequirement = field(default_factory=NodeRequirement)  # the role's node type

    def label(self) -> str:
        gpu = f", {self.gpus:g} GPU" if self.gpus else ""
        pinned = f", {self.needs.describe()}" if self.needs.describe() else ""
        return f"{self.count} {self.role}{'s' if self.count != 1 else ''} x ({self.cpus:g} CPU{gpu}{pinned})"


REPLICA, TRAINER, REWARD = "rollout replica", "trainer worker", "reward actor"
TEACHER = "teacher replica"  # algo.distill's scoring app (deployments/teacher.py)
JUDGE, REWARD_MODEL = "judge replica", "reward model replica"  # reward.judge, reward.reward_model (deployments/judge.py)


def demands(cfg, training: bool = True) -> list[Demand]:
    """What the run asks Ray for, in the order the job starts it (`training=False`: the
    eval job, replicas alone). The driver actor, the Data stages that call the replicas
    and the OpenAI endpoint take no CPU."""
    r, t = cfg.rollout, cfg.train
    replicas = Demand(REPLICA, r.num_cpus, r.num_gpus, r.min_replicas, NodeRequirement.of(r))
    if not training:
        return [replicas]
    d = cfg.algo.distill
    teacher = [Demand(TEACHER, d.num_cpus, d.num_gpus, d.min_replicas)] if d.enabled else []
    served = [Demand(role, s.num_cpus, s.num_gpus, s.min_replicas)
              for role, s in ((JUDGE, cfg.reward.judge), (REWARD_MODEL, cfg.reward.reward_model))
              if s.enabled]
    # in the job's order: the teacher right after the rollout app, then the served rewards
    return [replicas, *teacher, *served,
            Demand(TRAINER, t.num_cpus_per_worker, t.num_gpus_per_worker if t.use_gpu else 0.0,
                   t.num_workers, NodeRequirement.of(t)),
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
    resources: dict = field(default_factory=dict)  # free custom resources

    def take(self, d: Demand) -> tuple[int, ...] | None:
        eps = 1e-9
        if self.cpus + eps < d.cpus or not d.needs.matches(
                {k: v + eps for k, v in self.resources.items()}, self.node.labels):
            return None
        if d.gpus >= 1:
            whole = [i for i, f in enumerate(self.gpus) if f >= 1 - eps][:int(d.gpus)]
            if len(whole) < d.gpus:
                return None
            got = tuple(whole)
        elif d.gpus > 0:  # best fit: least left over, lowest index of equals
            fit = [(f - d.gpus, i) for i, f in enumerate(self.gpus) if f + eps >= d.gpus]
            if not fit:
                return None
            got = (min(fit, key=lambda x: (round(x[0], 9), x[1]))[1],)
        else:
            got = ()
        self.cpus -= d.cpus
        for k, v in d.needs.resources.items():
            self.resources[k] -= v
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


def _idle(n: Node) -> _Free:
    return _Free(n, n.cpus, [1.0] * n.gpus, dict(n.resources))


def can_host(n: Node, d: Demand) -> bool:
    """Whether node `n`, idle, could host one actor of `d` (by `place`'s rules)."""
    return _idle(n).take(d) is not None


def place(needs: list[Demand], nodes: list[Node]) -> Placement:
    free = [_idle(n) for n in nodes]
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
    for d in {d.role: d for d, _ in p.unplaced}.values():
        if d.needs.describe():  # a role pinned to a node type: which nodes are of it
            hosts = [n.name for n in p.nodes if d.needs.matches(n.resources, n.labels)]
            lines.append(f"{d.role}s need nodes with {d.needs.describe()}: "
                         + (f"only {', '.join(hosts)} {'has' if len(hosts) == 1 else 'have'} them"
                            if hosts else "no node has them (ray start --resources / --labels)")
                         + "; nodes: " + "; ".join(n.node_type() for n in p.nodes) + ".")
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


# Why engines sharing a GPU must leave the margin free between their shares: each
# measures the device when it starts, and the others already hold (or, started at the
# same moment, are about to take) their own share of it.
START_RULE = {
    "vllm": "vLLM needs gpu_memory_utilization x the GPU's total memory free when it starts "
            "(vllm/v1/worker/utils.py, request_memory: 'Free memory on device ... on startup is "
            "less than desired GPU memory utilization'), while every other engine holds its "
            "share",
    "sglang": "sglang sizes its static memory (weights and KV pool) as mem_fraction_static x "
              "the memory it finds free when it starts (sglang/srt/mem_cache/"
              "kv_cache_configurator.py, _profile_available_bytes): engines starting together "
              "each find the whole GPU free and take that share of all of it",
}


def sharing_error(cfg, p: Placement) -> str | None:
    """Why a placement Ray would make cannot start, by rule; None when it can.
    - NCCL ranks per GPU: torch.distributed's NCCL backend refuses two ranks of a group
      on one device ("Duplicate GPU detected"), so a GPU holds at most one trainer worker.
    - Engine shares per GPU: on a GPU shared by several actors, the engines' memory
      fractions (gpu_memory_utilization / mem_fraction_static) and MARGIN must fit in 1
      (START_RULE). A GPU an engine has alone is its own business."""
    frac, backend = engine_fraction(cfg), cfg.rollout.backend
    problems = []
    for (node, idx), slots in sorted(p.sharing().items()):
        trainers = [s.index for s in slots if s.role == TRAINER]
        engines = [s.index for s in slots if s.role == REPLICA]
        if len(trainers) > 1:
            problems.append(
                f"NCCL ranks per GPU: {node} GPU {idx} holds trainer workers "
                f"{', '.join(map(str, trainers))}, and NCCL refuses two ranks on one GPU "
                "('Duplicate GPU detected'): one trainer worker per GPU")
        if len(slots) > 1 and engines and frac and len(engines) * frac + MARGIN > 1 + 1e-9:
            who = ", ".join(f"{s.role} {s.index}" for s in slots)
            problems.append(
                f"engine shares per GPU: {node} GPU {idx} holds {who}; its engines take "
                f"{len(engines)} x {frac:g} of its memory, over 1 with the {MARGIN:g} kept "
                f"free ({START_RULE[backend]})")
    if not problems:
        return None
    key, _ = DEFAULT_FRACTION.get(backend, ("", 0.0))
    fractional = any(0 < s.share < 1 for s in p.slots)
    hint = ["larger shares, so that fewer actors share a GPU (rollout.num_gpus, "
            "train.num_gpus_per_worker; Ray puts each fraction on the fullest GPU it fits)"]
    if key:
        hint.append(f"a smaller rollout.engine_kwargs.{key}")
    if fractional and any(n.gpus > 1 for n in p.nodes):
        hint.append("whole GPUs on nodes with several GPUs (fractional sharing is for one GPU "
                    "per node: pairing one replica with one trainer worker per GPU would take "
                    "a placement group)")
    return ("this run's placement cannot start: " + "; ".join(problems) + ". Change: "
            + "; or ".join(hint) + ". `python -m jobs.plan` checks a layout.")


def engine_gib(cfg, shape: DecoderShape, gpu_gib: float) -> dict[str, float]:
    """GiB one engine holds on its GPU while it generates (`awake`) and while released
    for a trainer step (`asleep`; rollout.release_memory)."""
    backend = cfg.rollout.backend
    dtype_bytes = DTYPE_BYTES[cfg.rollout.dtype or cfg.model.dtype]
    weights = shape.params * dtype_bytes / GIB
    if backend == "vllm":  # gpu_memory_utilization bounds the whole instance
        awake = engine_fraction(cfg) * gpu_gib
        asleep = CONTEXT_GIB  # sleep level 1: weights to host, KV cache discarded
    elif backend == "sglang":  # weights + KV pool within the fraction, graphs and sampler beyond
        awake = engine_fraction(cfg) * gpu_gib + SGLANG_OUTSIDE_GIB
        asleep = SGLANG_OUTSIDE_GIB  # release_memory_occupation frees weights and KV pool
    else:  # hf: the model and a KV cache that grows with the running batch
        kv_per_token = 2 * shape.layers * shape.kv_dim * dtype_bytes
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
    `gpu_gib` less MARGIN. A GPU of one engine alone is its own business (its fraction
    is what it may take); a GPU with a trainer worker or several engines is checked in
    both phases."""
    engine, trainer = engine_gib(cfg, shape, gpu_gib), trainer_gib(cfg, shape)
    budget = gpu_gib * (1 - MARGIN)
    gpus = []
    for (node, idx), slots in sorted(p.sharing().items()):
        roles = [s.role for s in slots]
        phases = gpu_phases(roles, engine, trainer, cfg.rollout.release_memory)
        checked = TRAINER in roles or roles.count(REPLICA) > 1
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
