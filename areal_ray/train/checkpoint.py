"""Resume checkpoints, written through Ray Train so its failure handling can use them.

A checkpoint taken after step t (policy version v = t + 1) is one directory:

  state/               the policy and its AdamW state (and the critic's, GAE runs), sharded:
                       torch.distributed.checkpoint, every rank writes its own shards
                       (`__<rank>_0.distcp`), rank 0 the metadata; DCP re-shards on load,
                       so a run resumes on a different number of trainer workers
  model/               the policy in HF format (config, safetensors, tokenizer), from the
                       full weights rank 0 gathers for the weight push anyway: transformers,
                       vLLM and SGLang load it as is (`train.checkpoint_hf_model`)
  scheduler.pt         the LR scheduler's state
  trainer_state.json   version, next ticket, rejected count, consumed prompt
                       positions: what the staleness gate and the pipeline need to
                       continue exactly, with no prompt trained twice (`trainer_state`)
  rng_rank{r}.pt       torch and Python RNG state of every rank

The first version gathered the whole optimizer state on rank 0 (`optimizer.pt`): at
7B that is 56 GB of fp32 moments through one process. Now nothing but the HF export
is gathered. Tensors are loaded onto the parameters' devices by DCP, so a checkpoint
moves between GPU and CPU trainers.

Every rank calls `save_checkpoint` (DCP's save is collective) and reports its part
with `ray.train.report`; Ray Train puts the parts in one directory under
`<run_dir>/train/` and hands the latest back through `ray.train.get_checkpoint()`
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

from areal_ray.task.tokenizer import load_tokenizer

STATE_FILE = "trainer_state.json"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _load(path: Path):
    """A saved state on the CPU, whichever device wrote it."""
    return torch.load(path, map_location="cpu", weights_only=False)


def _trained(models) -> list[tuple[str, object, object]]:
    """(name, model, optimizer) of every model with an optimizer: policy, critic (GAE)."""
    return [(name, model, opt) for name, model, opt in
            (("policy", models.policy, models.opt), ("critic", models.critic, models.critic_opt))
            if model is not None]


def sharded_state(models) -> dict:
    """The models' and optimizers' state as DCP sees it: each rank's own shards (DTensors)."""
    out = {}
    for name, model, opt in _trained(models):
        msd, osd = get_state_dict(model, opt)
        out[name] = {"model": msd, "optim": osd}
    return out


def save_sharded(models, path: Path) -> None:
    """Every rank: its shards (and rank 0 the metadata) under `path`."""
    dcp.save(sharded_state(models), storage_writer=FileSystemWriter(str(path)))


def load_sharded(models, path: Path) -> None:
    """Every rank: fill the models and optimizers from `path`, re-sharded to this world."""
    state = sharded_state(models)
    dcp.load(state, storage_reader=FileSystemReader(str(path)))
    for name, model, opt in _trained(models):
        set_state_dict(model, opt, model_state_dict=state[name]["model"],
                       optim_state_dict=state[name]["optim"])


def save_hf(weights: dict, model_src: str, out: Path) -> Path:
    """Full weights -> an HF model directory (with `model_src`'s config and tokenizer)."""
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_src))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"weights do not fit {model_src}: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(str(out))
    load_tokenizer(model_src).save_pretrained(str(out))
    return out


def save_checkpoint(models, weights: dict, trainer_state: dict, model_src: str,
                    hf_model: bool = True) -> None:
    """Every rank: `weights` is the policy's full state dict (filled on rank 0 only)."""
    rank = dist.get_rank() if _distributed() else 0
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        save_sharded(models, d / "state")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()},
                   d / f"rng_rank{rank}.pt")
        if rank == 0:
            if hf_model:
                save_hf(weights, model_src, d / "model")
            torch.save(models.sched.state_dict(), d / "scheduler.pt")
            (d / STATE_FILE).write_text(json.dumps(trainer_state))
        ray.train.report({"version": trainer_state["version"]},
                         checkpoint=ray.train.Checkpoint.from_directory(str(d)))


REQUIRED = (STATE_FILE, "state/.metadata", "scheduler.pt")


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


def trainer_state(version: int, next_ticket: int, batch_groups: int,
                  consumed: list[int]) -> dict:
    """trainer_state.json of a checkpoint taken once `version` is trained.

    The rejected count is not kept by the trainer: the staleness gate in the driver
    owns it while the run goes on. At a step boundary it follows from the tickets,
    since every ticket below `next_ticket` was trained (`version` x B of them) or
    rejected. It is still written, so that a run resumed with another batch_groups is
    refused by the gate (data/staleness.py) and every checkpoint reads the same."""
    rejected = next_ticket - version * batch_groups
    if rejected < 0:
        raise ValueError(f"next ticket {next_ticket} is below the {version} x {batch_groups} "
                         "groups trained so far")
    return {"version": version, "next_ticket": next_ticket, "rejected": rejected,
            "consumed": list(consumed)}


def read_trainer_state(ckpt_dir: str | Path) -> dict:
    return json.loads((Path(ckpt_dir) / STATE_FILE).read_text())


def load_checkpoint(models, ckpt_dir: str | Path) -> None:
    """Every rank, after building the models."""
    d = Path(ckpt_dir)
    rank = dist.get_rank() if _distributed() else 0
    load_sharded(models, d / "state")
    models.sched.load_state_dict(_load(d / "scheduler.pt"))
    rng = d / f"rng_rank{rank}.pt"
    if rng.exists():  # a restart with more workers than the checkpoint had: fresh RNG
        state = _load(rng)
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
