"""Resume checkpoints, written through Ray Train so its failure handling can use them.

A checkpoint taken after step t (policy version v = t + 1) is one directory:

  model/               the policy in HF format (config, safetensors, tokenizer):
                       transformers and SGLang load it as is
  optimizer.pt         full (unsharded) AdamW state, re-sharded on load
  scheduler.pt         the LR scheduler's state
  critic.pt, critic_optimizer.pt   the critic and its optimizer (GAE runs only)
  trainer_state.json   version, next ticket, rejected count, consumed prompt
                       positions: what the staleness gate and the pipeline need to
                       continue exactly, with no prompt trained twice
  rng_rank{r}.pt       torch and Python RNG state of every rank

Everything is saved as CPU tensors and loaded onto the CPU; loading into the models
and optimizers then puts each state on its parameters' device (the worker's GPU with
`train.use_gpu`), so a checkpoint moves between GPU and CPU trainers.

Every rank calls `save_checkpoint` (gathering the optimizer state is collective) and
reports its part with `ray.train.report`; Ray Train puts the parts in one directory
under `<run_dir>/train/` and hands the latest back through `ray.train.get_checkpoint()`
after a worker-group restart, or to a new job that reuses the run dir (`run.resume`).
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import ray.train
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from areal_ray.train.fsdp import full_state_dict

STATE_FILE = "trainer_state.json"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def full_optimizer_state(model, opt) -> dict:
    if _distributed():
        return get_optimizer_state_dict(model, opt, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
    state = opt.state_dict()
    return {**state, "state": {k: {n: v.cpu() if torch.is_tensor(v) else v for n, v in per.items()}
                               for k, per in state["state"].items()}}


def _load(path: Path):
    """A saved state on the CPU, whichever device wrote it; `load_state_dict`,
    `set_*_state_dict` and `set_rng_state` take it from there."""
    return torch.load(path, map_location="cpu", weights_only=False)


def load_optimizer_state(model, opt, state: dict) -> None:
    if _distributed():
        set_optimizer_state_dict(model, opt, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(state)


def save_hf(weights: dict, model_src: str, out: Path) -> Path:
    """Full weights -> an HF model directory (with `model_src`'s config and tokenizer)."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_src))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"weights do not fit {model_src}: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(model_src).save_pretrained(str(out))
    return out


def save_checkpoint(models, weights: dict, trainer_state: dict, model_src: str) -> None:
    """Every rank: `weights` is the policy's full state dict (filled on rank 0 only)."""
    rank = dist.get_rank() if _distributed() else 0
    optim = full_optimizer_state(models.policy, models.opt)
    critic = critic_optim = None
    if models.critic is not None:
        critic = full_state_dict(models.critic)
        critic_optim = full_optimizer_state(models.critic, models.critic_opt)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()},
                   d / f"rng_rank{rank}.pt")
        if rank == 0:
            save_hf(weights, model_src, d / "model")
            torch.save(optim, d / "optimizer.pt")
            torch.save(models.sched.state_dict(), d / "scheduler.pt")
            if critic is not None:
                torch.save(critic, d / "critic.pt")
                torch.save(critic_optim, d / "critic_optimizer.pt")
            (d / STATE_FILE).write_text(json.dumps(trainer_state))
        ray.train.report({"version": trainer_state["version"]},
                         checkpoint=ray.train.Checkpoint.from_directory(str(d)))


REQUIRED = (STATE_FILE, "model/config.json", "optimizer.pt", "scheduler.pt")


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """Every checkpoint directory Ray Train wrote under `root`, complete or not."""
    return sorted(p for p in Path(root).glob("checkpoint_*") if p.is_dir())


def latest_checkpoint(root: str | Path, reported=None) -> Path | None:
    """The complete checkpoint with the highest version under `root`, or Ray Train's
    `reported` one if it is as new. Scanning the storage as well matters: Ray Train
    registers a report only when its controller next polls the worker, so a worker
    killed shortly after saving can leave a newer checkpoint on disk than the one
    `ray.train.get_checkpoint()` returns after the restart."""
    best, best_version = None, -1
    candidates = checkpoint_dirs(root)
    if reported is not None:
        candidates.append(Path(reported.path))
    for d in candidates:
        if all((d / f).exists() for f in REQUIRED):
            version = read_trainer_state(d)["version"]
            if version > best_version:
                best, best_version = d, version
    return best


def read_trainer_state(ckpt_dir: str | Path) -> dict:
    return json.loads((Path(ckpt_dir) / STATE_FILE).read_text())


def load_checkpoint(models, ckpt_dir: str | Path) -> None:
    """Every rank, after building the models (the policy from `ckpt_dir/model`)."""
    d = Path(ckpt_dir)
    rank = dist.get_rank() if _distributed() else 0
    load_optimizer_state(models.policy, models.opt, _load(d / "optimizer.pt"))
    models.sched.load_state_dict(_load(d / "scheduler.pt"))
    if models.critic is not None:
        critic = _load(d / "critic.pt")
        if _distributed():
            set_model_state_dict(models.critic, critic, options=StateDictOptions(full_state_dict=True))
        else:
            models.critic.load_state_dict(critic)
        load_optimizer_state(models.critic, models.critic_opt,
                             _load(d / "critic_optimizer.pt"))
    rng = d / f"rng_rank{rank}.pt"
    if rng.exists():  # a restart with more workers than the checkpoint had: fresh RNG
        state = _load(rng)
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
