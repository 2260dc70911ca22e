"""Benchmark: LoRA against full fine-tuning on one model: push bytes and seconds, trainer
step time and memory.

    python -m benchmarks.bench_lora [out=runs/bench_lora.json] [hidden=256] [layers=4]
                                    [rank=8] [steps=3] [seqs=32] [seq_len=128]

One process, one randomly initialised Qwen2-architecture model (the embedded model's
tokenizer; `hidden`/`layers` set its size), trained two ways with the real pieces:

* **train**: `train_step` (train/step.py) on the same random batch (`seqs` sequences of
  `seq_len` tokens), full fine-tuning vs `model.lora` (peft's adapter injected as the
  trainer does, `train/lora.py`; AdamW on the adapter alone). Step time is the median
  of `steps` steps after one warm-up; memory is what the trainer holds (parameters,
  gradients, AdamW state), counted from the tensors: both variants run in one process,
  so its resident set would mix them. Activations are the same for both (the frozen
  base still runs forward and backward through every layer).
* **push**: what a push sends (the gathered model, or only `lora_A`/`lora_B`), staged by
  the shm path's sender, received by a replica's `WeightReceiver` and loaded by a real
  `HFEngine` (`update_weights`, or `update_adapter`: merged into its kept base).
  Seconds from the gather to the engine serving the new version, median of `steps`.

Writes JSON and one summary line.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from areal_ray.config import ConfigError, WeightsConfig, load_config, opt
from jobs.cli import bench_main


def make_model_dir(root: Path, hidden: int, layers: int) -> str:
    from transformers import AutoModelForCausalLM

    from areal_ray.task.tiny_model import TinyModelSpec, qwen2_config
    from areal_ray.task.tokenizer import save_char_tokenizer
    tok = save_char_tokenizer(root)
    torch.manual_seed(0)
    spec = TinyModelSpec(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64))
    AutoModelForCausalLM.from_config(qwen2_config(spec, tok)).save_pretrained(str(root))
    return str(root)


def random_batch(vocab: int, seqs: int, seq_len: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(seqs):
        n = seq_len // 2
        out.append({"prompt_ids": torch.randint(4, vocab, (seq_len - n,), generator=g).tolist(),
                    "output_ids": torch.randint(4, vocab, (n,), generator=g).tolist(),
                    "logprobs": [-1.0] * n, "versions": [0] * n,
                    "advantage": float(torch.randn(1, generator=g)), "ticket": i // 8})
    return out


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_variant(model_dir: str, lora_overrides: list[str], c, weights_dir: Path) -> dict:
    from areal_ray.rollout.engines.hf import HFEngine
    from areal_ray.train.fsdp import load_sharded_model
    from areal_ray.train.lora import adapter_meta, trainable_parameters
    from areal_ray.train.schedule import make_scheduler
    from areal_ray.train.step import Models, train_step
    from areal_ray.weights.receivers import WeightReceiver
    from areal_ray.weights.senders import SenderContext, ShmSender

    cfg = load_config(None, ["algo.optim.lr=1e-4", "weights.path=shm", *lora_overrides])
    lora = cfg.model.lora if cfg.model.lora.enabled else None
    policy = load_sharded_model(model_dir, lora=lora)
    params = trainable_parameters(policy)
    optim = torch.optim.AdamW(params, lr=cfg.algo.optim.lr)
    m = Models(policy, optim, make_scheduler(optim, c.steps + 1, 0, "constant"))
    batch = random_batch(policy.config.vocab_size, c.seqs, c.seq_len)
    step_s = []
    for _ in range(c.steps + 1):
        t0 = time.perf_counter()
        train_step(m, [dict(s) for s in batch], cfg, pad_id=0, version=0)
        step_s.append(time.perf_counter() - t0)
    state = [s for p in params for s in optim.state[p].values() if torch.is_tensor(s)]
    memory = {"param_bytes": tensor_bytes(policy.parameters()),
              "trainable_param_bytes": tensor_bytes(params),
              "grad_bytes": tensor_bytes(p.grad for p in params if p.grad is not None),
              "optimizer_state_bytes": tensor_bytes(state)}

    meta = adapter_meta(policy, lora, model_dir, "float32") if lora else None
    ctx = SenderContext(WeightsConfig(path="shm"), None, 0, weights_dir, adapter=meta)
    sender, receiver = ShmSender(ctx), WeightReceiver("bench-replica")
    engine = HFEngine(model_dir)
    push_s, nbytes = [], 0
    try:
        for version in range(1, c.steps + 1):
            t0 = time.perf_counter()
            weights = ctx.gather(policy)
            nbytes = sender.sent_bytes(weights)
            got = asyncio.run(receiver.receive(ctx.wrap(sender.stage(version, weights))))
            load = engine.update_adapter if lora else engine.update_weights
            asyncio.run(load(got, version))
            push_s.append(time.perf_counter() - t0)
            assert engine.version == version
    finally:
        sender.close()
        engine.shutdown()
    return {"overrides": lora_overrides, "step_s": statistics.median(step_s[1:]),
            "push_bytes": nbytes, "push_s": statistics.median(push_s), **memory}


@dataclass
class BenchLoraConfig:
    out: str = opt("runs/bench_lora.json", "JSON report path")
    hidden: int = opt(256, "model hidden size")
    layers: int = opt(4, "model layers")
    rank: int = opt(8, "LoRA rank (alpha = 2 x rank), every linear module but the tied head")
    steps: int = opt(3, "timed train steps and pushes per variant (medians reported)")
    seqs: int = opt(32, "sequences per train step")
    seq_len: int = opt(128, "tokens per sequence (half prompt, half output)")


def check(c: BenchLoraConfig) -> None:
    for key in ("hidden", "layers", "rank", "steps", "seqs", "seq_len"):
        if getattr(c, key) < 1:
            raise ConfigError(f"{key} must be >= 1 (got {getattr(c, key)})")
    if c.seq_len < 2:
        raise ConfigError(f"seq_len must be >= 2 (got {c.seq_len})")


def run(c: BenchLoraConfig, argv: list[str]) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    lora = ["model.lora.enabled=true", f"model.lora.rank={c.rank}", f"model.lora.alpha={2 * c.rank}",
            "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"]
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        model_dir = make_model_dir(Path(tmp) / "model", c.hidden, c.layers)
        res = {"full": run_variant(model_dir, [], c, Path(tmp)),
               "lora": run_variant(model_dir, lora, c, Path(tmp))}
    full, low = res["full"], res["lora"]
    report = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}", "argv": argv,
              "params": full["param_bytes"] // 4, "results": res,
              "push_bytes_ratio": full["push_bytes"] / low["push_bytes"],
              "push_s_ratio": full["push_s"] / low["push_s"],
              "step_s_ratio": full["step_s"] / low["step_s"],
              "trainer_state_ratio": (full["grad_bytes"] + full["optimizer_state_bytes"])
              / (low["grad_bytes"] + low["optimizer_state_bytes"])}
    Path(c.out).write_text(json.dumps(report, indent=2))
    mib = 1 << 20
    print(f"bench_lora [{report['machine']}, {report['params'] / 1e6:.1f}M params, rank {c.rank}] "
          f"push {full['push_bytes'] / mib:.2f} MiB in {full['push_s'] * 1e3:.0f} ms full vs "
          f"{low['push_bytes'] / mib:.3f} MiB in {low['push_s'] * 1e3:.0f} ms LoRA "
          f"({report['push_bytes_ratio']:.0f}x bytes, {report['push_s_ratio']:.1f}x time); step "
          f"{full['step_s']:.2f} s vs {low['step_s']:.2f} s; grads+AdamW "
          f"{(full['grad_bytes'] + full['optimizer_state_bytes']) / mib:.1f} MiB vs "
          f"{(low['grad_bytes'] + low['optimizer_state_bytes']) / mib:.2f} MiB -> {c.out}")


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, "python -m benchmarks.bench_lora", __doc__.splitlines()[0],
                      BenchLoraConfig, check, run)


if __name__ == "__main__":
    sys.exit(main())
