"""The Ray Train worker loop of `jobs.sft`: the RL trainer's model, optimizer,
schedule and checkpoints, with an SFT step in place of the PPO one.

Start (every rank): the policy as RL builds it (train/loop.py: build_models, FSDP2 on
the worker's device), then from the latest checkpoint when Ray Train hands one back
(a resumed run, or a restart after a failure): its weights, AdamW and LR schedule
state. Per step: the step's rows (sft/dataset.py: step_indices, a function of the
step), one `sft_step`; rank 0 appends the step's record to `<run_dir>/steps.jsonl`
and prints a line. Every `sft.eval_every` steps, and before and after, the held-out
loss. Every `train.checkpoint_every` steps a resume checkpoint (train/checkpoint.py;
its data position is the step's row count). At the end rank 0 writes the weights in
HF format to `<run_dir>/final_model` (the RL run's `save_hf`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ray
import ray.train
import torch
import torch.distributed as dist

from areal_ray.sft.dataset import as_seqs, step_indices
from areal_ray.sft.step import eval_loss, sft_step
from areal_ray.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
    save_hf,
    trainer_state,
)
from areal_ray.train.fsdp import full_state_dict
from areal_ray.train.loop import build_models

STEPS_FILE = "steps.jsonl"
FINAL_MODEL = "final_model"


def sft_loop_per_worker(config: dict) -> None:
    cfg = config["cfg"]
    torch.set_num_threads(cfg.train.torch_threads)
    torch.manual_seed(cfg.train.seed)
    rank = ray.train.get_context().get_world_rank()
    rows, held = ray.get(config["rows"]), ray.get(config["held_out"])
    run_dir, model_path = Path(config["run_dir"]), config["model_path"]
    bs, steps, every = cfg.sft.batch_size, cfg.train.steps, cfg.train.checkpoint_every

    ckpt_dir = latest_checkpoint(config["checkpoint_root"], ray.train.get_checkpoint())
    start = read_trainer_state(ckpt_dir)["version"] if ckpt_dir else 0
    m = build_models(cfg, model_path, model_path)
    if ckpt_dir:
        load_checkpoint(m, ckpt_dir)
    pad_id = m.policy.config.pad_token_id if m.policy.config.pad_token_id is not None else 0
    held_seqs = as_seqs(held)

    def record(rec: dict) -> None:
        if rank == 0:
            with (run_dir / STEPS_FILE).open("a") as f:
                f.write(json.dumps(rec) + "\n")

    def evaluate(step: int) -> None:
        if held_seqs:
            loss = eval_loss(m, held_seqs, cfg, pad_id)
            record({"eval_step": step, "eval_loss": loss})
            if rank == 0:
                print(f"[areal-ray sft] step {step:5d}/{steps} eval loss {loss:.4f}", flush=True)

    if rank == 0:
        print(f"[areal-ray sft] trainer starts at step {start}"
              f"{' (from checkpoint ' + ckpt_dir.name + ')' if ckpt_dir else ''}", flush=True)
    if start == 0:
        evaluate(0)
    t0 = time.perf_counter()
    for step in range(start, steps):
        batch = [rows[i] for i in step_indices(len(rows), step, bs, cfg.train.seed)]
        stats = sft_step(m, as_seqs(batch), cfg, pad_id)
        epoch = (step + 1) * bs / len(rows)
        record({"step": step, "epoch": epoch, "time_s": time.perf_counter() - t0, **stats})
        if rank == 0:
            print(f"[areal-ray sft] step {step + 1:5d}/{steps} epoch {epoch:6.2f} loss "
                  f"{stats['loss']:.4f} lr {stats['lr']:.2e} grad_norm {stats['grad_norm']:.3f}", flush=True)
        if cfg.sft.eval_every and (step + 1) % cfg.sft.eval_every == 0 and step + 1 < steps:
            evaluate(step + 1)
        if every and ((step + 1) % every == 0 or step + 1 == steps):
            weights = full_state_dict(m.policy)
            # the data position: rows trained so far, as "tickets" of one row each
            save_checkpoint(m, weights, trainer_state(step + 1, (step + 1) * bs, bs, []),
                            model_path, cfg.train.checkpoint_hf_model, keep=cfg.run.keep_checkpoints)
    if start < steps:
        evaluate(steps)
    weights = full_state_dict(m.policy)  # every rank: it all-gathers
    if rank == 0:
        save_hf(weights, model_path, run_dir / FINAL_MODEL)
    if dist.is_initialized():
        dist.barrier()
