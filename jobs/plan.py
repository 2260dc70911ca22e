"""Plan a run on a cluster shape, without a cluster: where each replica, trainer worker
and reward actor goes, and the GPU memory of each phase on every GPU a trainer uses.

    python -m jobs.plan --config conf/gsm8k_qwen_1gpu.yaml gpus=1 gpu_memory_gib=80 \\
        [nodes=1 cpus=16 model_config=conf/models/qwen2.5-1.5b.json out=plan.json] [key=value ...]

`nodes`, `cpus`, `gpus` (per node), `gpu_memory_gib`, `model_config` (an HF config.json
of the model's architecture, when model.path is not on this machine) and `out` describe
the question; every other key=value overrides the run config. Exit status 0 when the
plan fits, 1 when it does not (the reason is printed), 2 for bad input. The job runs
the same check against the live cluster before it deploys anything
(areal_ray/cluster/placement.py).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from areal_ray.cluster.plan import (
    cluster_shape,
    demands,
    engine_fraction,
    memory_error,
    memory_plan,
    place,
    placement_error,
    sharing_error,
)
from areal_ray.config import ConfigError, load_config, opt

SHAPE_KEYS = ("nodes", "cpus", "gpus", "gpu_memory_gib", "model_config", "out")


@dataclass
class Shape:
    nodes: int = opt(1, "nodes of the cluster")
    cpus: float = opt(16, "CPUs per node")
    gpus: int = opt(1, "GPUs per node")
    gpu_memory_gib: float = opt(80.0, "memory of each GPU")
    model_config: str = opt("", "HF config (file or dir) of the model's architecture; empty: model.path's")
    out: str = opt("", "also write the plan as JSON here")


def split_args(argv: list[str]) -> tuple[str | None, list[str], list[str]]:
    """(--config, shape key=values, run config overrides)."""
    config, shape, over = None, [], []
    it = iter(argv)
    for a in it:
        if a == "--config":
            config = next(it, None)
        elif a.startswith("--config="):
            config = a.split("=", 1)[1]
        elif a.split("=", 1)[0] in SHAPE_KEYS:
            shape.append(a)
        else:
            over.append(a)
    return config, shape, over


def model_shape(cfg, model_config: str):
    from transformers import AutoConfig

    from areal_ray.train.memory import DecoderShape
    src = model_config or cfg.model.path
    if not (Path(src).is_file() or (Path(src) / "config.json").exists()):
        raise ConfigError(f"no model config at {src!r}: pass model_config= with the architecture's "
                          "config.json (conf/models/qwen2.5-1.5b.json is Qwen2.5-1.5B's)")
    return DecoderShape.from_hf(AutoConfig.from_pretrained(src))


def make_plan(cfg, shape: Shape, model) -> dict:
    nodes = cluster_shape(shape.nodes, shape.cpus, shape.gpus, shape.gpu_memory_gib)
    needs = demands(cfg)
    p = place(needs, nodes)
    out = {"cluster": [asdict(n) for n in nodes], "demands": [asdict(d) for d in needs],
           "placement": [asdict(s) for s in p.slots], "fits": p.fits}
    if not p.fits:
        out["error"] = placement_error(needs, p)
        return out
    errors = [e for e in [sharing_error(cfg, p)] if e]
    mem = memory_plan(cfg, model, p, shape.gpu_memory_gib)
    out["memory"] = mem
    if not mem["fits"]:
        errors.append(memory_error(mem))
    if errors:
        out.update(fits=False, error="\n".join(errors))
    return out


def render(cfg, plan: dict, shape: Shape, config: str | None) -> str:
    lines = [f"plan: {config or 'defaults'} on {shape.nodes} node(s) x ({shape.cpus:g} CPU, "
             f"{shape.gpus} GPU of {shape.gpu_memory_gib:g} GiB)"]
    for d in plan["demands"]:
        if d["count"]:
            lines.append(f"  asks: {d['count']} x {d['role']} ({d['cpus']:g} CPU, {d['gpus']:g} GPU)")
    by_gpu: dict[str, list[str]] = {}
    for s in plan["placement"]:
        for g in s["gpus"]:
            by_gpu.setdefault(f"{s['node']} GPU {g}", []).append(f"{s['role']} {s['index']} ({s['share']:g})")
    for where, who in by_gpu.items():
        lines.append(f"  {where}: {', '.join(who)}")
    if shape.gpus > 1 and any(0 < d["gpus"] < 1 and d["count"] for d in plan["demands"]):
        lines.append("  (fractions as Ray places them: each on the fullest GPU it fits. Sharing a GPU "
                     "is a layout for one-GPU nodes: pairing one replica with one trainer worker per "
                     "GPU of a larger node would take a placement group)")
    if shape.nodes > 1:
        lines.append("  (nodes filled in order: Ray chooses the nodes itself, Serve spreading the "
                     "replicas, so trainer workers may be on any node; run.run_dir must be storage "
                     "every node mounts at the same path)")
    if "memory" in plan:
        m = plan["memory"]
        frac = engine_fraction(cfg)
        eng = f"{cfg.rollout.backend}" + (f" at {frac:g} of the GPU" if frac else "")
        lines.append(f"memory (GiB; budget {m['budget_gib']} of {m['gpu_gib']:g}, 10% kept free):")
        lines.append(f"  engine ({eng}): generating {m['engine_gib']['awake']}, released "
                     f"{m['engine_gib']['asleep']}" + ("" if m["release_memory"] else " (not released: "
                                                        "rollout.release_memory=false)"))
        lines.append(f"  trainer worker (algo.microbatch.max_tokens={cfg.algo.microbatch.max_tokens}): "
                     f"step {m['trainer_gib']['step']}, between steps {m['trainer_gib']['resident']}")
        for g in m["gpus"]:
            if len(g["on"]) > 1 or any(o.startswith("trainer") for o in g["on"]):
                lines.append(f"  {g['node']} GPU {g['gpu']}: while generating {g['gib']['generate']}, "
                             f"while stepping {g['gib']['step']}  {'fits' if g['fits'] else 'DOES NOT FIT'}")
    lines.append("verdict: fits" if plan["fits"] else f"verdict: does not fit\n{plan['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    config, shape_args, over = split_args(argv)
    try:
        cfg = load_config(config, over)
        shape = load_config(None, shape_args, schema=Shape)
        model = model_shape(cfg, shape.model_config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.train.gpu_memory_gib and not any(a.startswith("gpu_memory_gib=") for a in shape_args):
        shape.gpu_memory_gib = cfg.train.gpu_memory_gib
    plan = make_plan(cfg, shape, model)
    print(render(cfg, plan, shape, config))
    if shape.out:
        Path(shape.out).parent.mkdir(parents=True, exist_ok=True)
        Path(shape.out).write_text(json.dumps(plan, indent=1))
    return 0 if plan["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
