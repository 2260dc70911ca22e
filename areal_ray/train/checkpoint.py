"""Resume checkpoints, written through Ray Train so its failure handling can use them.

A checkpoint taken after step t (policy version v = t + 1) is one directory:

  state/               the policy and its AdamW state (and the critic's, GAE runs), sharded:
                       torch.distributed.checkpoint, every rank writes its own shards
                       (`__<rank>_0.distcp`), rank 0 the metadata; DCP re-shards on load,
                       so a run resumes on a different number of trainer workers
  model/               the policy in HF format (config, safetensors, tokenizer), from the
                       full weights rank 0 gathers for the weight push anyway: transformers,
                       vLLM and SGLang load it as is (`train.checkpoint_hf_model`); with
                       LoRA the merged model, and the adapter in peft's format in
                       model/adapter/ (train/lora.py: `save_lora_model`)
  scheduler.pt         the LR scheduler's state
  trainer_state.json   version, next ticket, rejected count, consumed prompt
                       positions: what the staleness gate and the pipeline need to
                       continue exactly, with no prompt trained twice (`trainer_state`)
  rng_rank{r}.pt       torch and Python RNG state of every rank
  complete.json        written last, by rank 0, once every rank's files are in place:
                       the version, and every file's size (and sha256 up to 1 MiB)

The first version gathered the whole optimizer state on rank 0 (`optimizer.pt`): at
7B that is 56 GB of fp32 moments through one process. Now nothing but the HF export
is gathered. Tensors are loaded onto the parameters' devices by DCP, so a checkpoint
moves between GPU and CPU trainers.

Every rank calls `save_checkpoint` (DCP's save is collective) and reports its part
with `ray.train.report`; Ray Train puts the parts in one directory under
`<run_dir>/train/` and hands the latest back through `ray.train.get_checkpoint()`
after a worker-group restart, or to a new job that reuses the run dir (`run.resume`).

Nothing in a checkpoint directory is trusted for being there. A save killed half-way
leaves files that exist but are short, so a checkpoint counts only when its marker
says it was completed and every file still matches it (`inspect_checkpoint`); the
lookups skip any other one with a warning naming it and why, and fall back to the
newest good one. Everything is read without running pickled code: `torch.load` with
`weights_only=True`, and DCP's pickled metadata and non-tensor values are checked
against what DCP writes before torch reads them (`SafeReader`, `SafePlanner`).

A checkpoint is staged beside its storage (`<run_dir>/train/.staging/rank-<r>/`), not
in the temp dir, which may be a small tmpfs unrelated to where the run has room; the
space it needs (each rank's shards, rank 0's HF export, twice over while Ray Train
copies the staged directory in) is checked before anything is written, and a full
disk is an OSError(ENOSPC) naming the path and the bytes needed
(`require_room`). A save killed mid-way leaves its staging directory, which the
rank's next save clears.

`run.keep_checkpoints` bounds how many complete checkpoints stay: once a new one is
sealed, older complete ones are emptied down to a `pruned.json` tombstone. The
directory itself stays because Ray Train's run snapshot lists every reported
checkpoint, and a resumed job refuses to start when one of them is gone.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import random
import shutil
import tempfile
from pathlib import Path

import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from areal_ray.task.tokenizer import load_tokenizer

STATE_FILE = "trainer_state.json"
MARKER = "complete.json"
PRUNED = "pruned.json"
HASHED_MAX_BYTES = 1 << 20  # files up to this size are hashed as well as sized
PRUNED_REASON = "pruned (run.keep_checkpoints)"
REQUIRED = (STATE_FILE, "state/.metadata", "scheduler.pt")  # whatever else a checkpoint holds
STAGING = ".staging"  # under the storage's experiment dir: where checkpoints are staged
HF_BYTES_PER_PARAM = 4  # the HF export's model is built by from_config: fp32

logger = logging.getLogger(__name__)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _load(path: Path):
    """A saved state on the CPU, whichever device wrote it; tensors and plain values
    only, so a planted file cannot run code."""
    return torch.load(path, map_location="cpu", weights_only=True)


# DCP's `.metadata` is a plain pickle: the globals it names are its own dataclasses
# and enums, torch sizes, dtypes and layouts, and the checkpoint's path.
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                     ("collections", "OrderedDict"), ("pathlib", "Path"),
                     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


def metadata_global_allowed(module: str, name: str) -> bool:
    """Whether DCP metadata may name `module.name`: never a function that could run
    code (os.system, eval, ...)."""
    if (module, name) in _METADATA_GLOBALS:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module == dcp_metadata.__name__:
        return isinstance(getattr(dcp_metadata, name, None), type)
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not metadata_global_allowed(module, name):
            raise pickle.UnpicklingError(
                f"checkpoint metadata names {module}.{name}, which DCP does not write: refused")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's reader, but its metadata pickle is first read by an unpickler that only
    knows DCP's own types; torch then reads it as usual."""

    def read_metadata(self, *args, **kwargs):
        with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            _MetadataUnpickler(f).load()
        return super().read_metadata(*args, **kwargs)


class SafePlanner(DefaultLoadPlanner):
    """DCP's planner, but a non-tensor value (the optimizer's param_groups) is first
    read with `weights_only=True`, which refuses anything but plain values; torch's
    own read of it follows."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        torch.load(io.BytesIO(value.getvalue()), weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def _trained(models) -> list[tuple[str, object, object]]:
    """(name, model, optimizer) of every model with an optimizer: policy, critic (GAE)."""
    return [(name, model, opt) for name, model, opt in
            (("policy", models.policy, models.opt), ("critic", models.critic, models.critic_opt))
            if model is not None]


def _options(model) -> StateDictOptions:
    """A model with frozen parameters (the base under a LoRA adapter) saves and loads
    only what trains: the frozen ones are the model's own files, rebuilt on every start,
    and a checkpoint of a 7B base with an 8M adapter stays the adapter's size."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def sharded_state(models) -> dict:
    """The models' and optimizers' state as DCP sees it: each rank's own shards (DTensors)."""
    out = {}
    for name, model, opt in _trained(models):
        options = _options(model)
        msd, osd = get_state_dict(model, opt, options=options)
        if options.ignore_frozen_params:  # a tied alias of a frozen weight still shows up
            trains = {n for n, p in model.named_parameters() if p.requires_grad}
            msd = {k: v for k, v in msd.items() if k in trains}
        out[name] = {"model": msd, "optim": osd}
    return out


def save_sharded(models, path: Path, state: dict | None = None) -> None:
    """Every rank: its shards (and rank 0 the metadata) under `path`; `state`: the
    models' `sharded_state`, when already taken."""
    state = sharded_state(models) if state is None else state
    dcp.save(state, storage_writer=FileSystemWriter(str(path)))


def tensor_bytes(tree) -> int:
    """Bytes of the tensors in a nested state (this rank's part of a DTensor)."""
    if isinstance(tree, DTensor):
        tree = tree.to_local()
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def room_problem(path: Path, needed: int, free: int) -> str | None:
    """Why `needed` bytes cannot be written under `path` with `free` bytes free, or None."""
    if free >= needed:
        return None
    return (f"{needed} bytes ({needed / (1 << 30):.2f} GiB) are needed under {path} and its "
            f"filesystem has {free} ({free / (1 << 30):.2f} GiB) free: free space there, or "
            "point run.run_dir at a larger disk")


def require_room(path: Path, needed: int, what: str, free: int | None = None) -> None:
    """An OSError(ENOSPC) naming `path` and the bytes needed unless its filesystem has
    `needed` bytes free (`free`: as measured, else asked of the filesystem)."""
    free = shutil.disk_usage(path).free if free is None else free
    if (why := room_problem(path, needed, free)) is not None:
        raise OSError(errno.ENOSPC, f"no room for {what}: {why}", str(path))


def _is_enospc(e: BaseException | None) -> bool:
    seen = 0
    while e is not None and seen < 16:
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def staging_parent(experiment_path: str | None) -> Path | None:
    """Where checkpoints are staged: under Ray Train's experiment dir when that is a
    local directory (the run dir's filesystem, where the checkpoint is copied to), else
    None (remote storage: the temp dir)."""
    if not experiment_path or "://" in experiment_path:
        return None
    p = Path(experiment_path)
    return p / STAGING if p.is_absolute() and p.is_dir() else None


def _experiment_path() -> str | None:
    try:
        return ray.train.get_context().get_storage().experiment_fs_path
    except Exception:  # noqa: BLE001 - outside a Ray Train worker (tests, tools): the temp dir
        return None


def staging_dir(rank: int, experiment_path: str | None) -> Path:
    """This rank's staging directory, emptied of what a killed save left: under the
    storage's experiment dir (`staging_parent`), else in the temp dir."""
    parent = staging_parent(experiment_path)
    if parent is None:
        return Path(tempfile.mkdtemp(prefix=f"areal-ckpt-rank{rank}-"))
    d = parent / f"rank-{rank}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def load_sharded(models, path: Path) -> None:
    """Every rank: fill the models and optimizers from `path`, re-sharded to this world."""
    state = sharded_state(models)
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner())
    for name, model, opt in _trained(models):
        set_state_dict(model, opt, model_state_dict=state[name]["model"],
                       optim_state_dict=state[name]["optim"], options=_options(model))


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
                    hf_model: bool = True, keep: int = 0, adapter=None) -> None:
    """Every rank: `weights` is the policy's full state dict (filled on rank 0 only), or
    with LoRA (`adapter`: the pushes' `AdapterMeta`) the adapter's
    tensors as pushed; the sharded state then holds only the adapter and its optimizer
    state (`_options`).
    Once every rank's part is in storage, rank 0 seals the checkpoint and prunes the
    complete ones beyond the `keep` newest (0: none)."""
    rank = dist.get_rank() if _distributed() else 0
    experiment = _experiment_path()
    d = staging_dir(rank, experiment)
    state = sharded_state(models)
    needed = tensor_bytes(state)
    if rank == 0 and hf_model:
        needed += tensor_bytes(weights) if adapter is not None else \
            sum(t.numel() for t in weights.values()) * HF_BYTES_PER_PARAM
    # staged, then copied in beside it by Ray Train: twice on the run dir's filesystem
    needed *= 2 if staging_parent(experiment) is not None else 1
    what = f"the checkpoint of version {trainer_state['version']} (rank {rank})"
    try:
        require_room(d, needed, what)
        try:
            save_sharded(models, d / "state", state)
            torch.save({"torch": torch.get_rng_state(), "python": random.getstate()},
                       d / f"rng_rank{rank}.pt")
            if rank == 0:
                if hf_model and adapter is not None:
                    from areal_ray.train.lora import save_lora_model
                    from areal_ray.weights.adapter import Adapter
                    save_lora_model(Adapter(adapter, weights), model_src, d / "model")
                elif hf_model:
                    save_hf(weights, model_src, d / "model")
                torch.save(models.sched.state_dict(), d / "scheduler.pt")
                (d / STATE_FILE).write_text(json.dumps(trainer_state))
            written = manifest(d)
            ray.train.report({"version": trainer_state["version"]},
                             checkpoint=ray.train.Checkpoint.from_directory(str(d)))
        except Exception as e:
            if _is_enospc(e) and not (isinstance(e, OSError) and str(d) in str(e)):
                raise OSError(errno.ENOSPC, f"no space left writing {what} (staged in {d}, "
                              f"stored under {experiment or 'Ray Train storage'}; about "
                              f"{needed} bytes needed): free space there, or point "
                              f"run.run_dir at a larger disk", str(d)) from e
            raise
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if _distributed():  # also a barrier: every rank's upload has returned
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, written)
        written = {k: v for part in parts for k, v in part.items()}
    if rank == 0:
        saved = ray.train.get_checkpoint()
        if saved is None or not _unsealed(Path(saved.path), trainer_state):
            return  # Ray Train skipped this report (a worker failed): nothing to seal
        seal(Path(saved.path), trainer_state["version"], written)
        try:
            prune_checkpoints(Path(saved.path).parent, keep, protect=Path(saved.path))
        except OSError as e:  # disk space is not worth the run
            logger.warning("could not prune old checkpoints: %s", e)


def _unsealed(d: Path, state: dict) -> bool:
    """Whether `d` is the checkpoint of `state` and still lacks its marker."""
    try:
        # the text, not the parsed dict: a step record may hold a NaN, unequal to itself
        return not (d / MARKER).exists() and (d / STATE_FILE).read_text() == json.dumps(state)
    except OSError:
        return False


def file_entry(path: Path) -> dict:
    """What the marker records of a file: its size, and for a small one its sha256
    (cheap, and it catches a rewritten trainer_state.json of the same length)."""
    size = path.stat().st_size
    entry = {"size": size}
    if size <= HASHED_MAX_BYTES:
        entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return entry


def manifest(d: Path) -> dict[str, dict]:
    """Every file under `d` (relative path -> `file_entry`), the marker's own aside."""
    return {p.relative_to(d).as_posix(): file_entry(p) for p in sorted(d.rglob("*"))
            if p.is_file() and p.name not in (MARKER, PRUNED, f".{MARKER}.tmp")}


def files_problem(d: Path, files: dict[str, dict]) -> str | None:
    """How the files under `d` differ from `files` (a `manifest`), or None."""
    for rel, want in files.items():
        p = d / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{rel} has {size} bytes, {want['size']} were written (truncated?)"
        if "sha256" in want and file_entry(p).get("sha256") != want["sha256"]:
            return f"{rel} is not what was written (its sha256 differs)"
    return None


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_marker(d: Path, version: int, files: dict[str, dict]) -> None:
    """The completion marker, whole or not at all: written aside, synced, renamed."""
    tmp = d / f".{MARKER}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"version": version, "files": files}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / MARKER)
    _fsync_dir(d)


def seal(d: Path, version: int, written: dict[str, dict]) -> None:
    """Mark `d` complete, once what reached storage is what the ranks wrote."""
    missing = [f for f in REQUIRED if f not in written]
    problem = f"no {', '.join(missing)} was written" if missing else files_problem(d, written)
    if problem:
        raise RuntimeError(f"checkpoint {d} was not stored whole: {problem}")
    write_marker(d, version, written)


def checkpoint_dirs(root: str | Path) -> list[Path]:
    """Every checkpoint directory Ray Train wrote under `root`, complete or not."""
    return sorted(p for p in Path(root).glob("checkpoint_*") if p.is_dir())


def inspect_checkpoint(d: Path) -> tuple[int | None, str | None]:
    """(version, None) for a checkpoint that can be resumed from; (None, why) else."""
    if (d / PRUNED).exists():
        return None, PRUNED_REASON
    if not (d / MARKER).is_file():
        return None, f"no {MARKER}: its save did not finish (or predates completion markers)"
    try:
        marker = json.loads((d / MARKER).read_text())
        version, files = int(marker["version"]), dict(marker["files"])
    except (ValueError, KeyError, TypeError) as e:
        return None, f"unreadable {MARKER} ({type(e).__name__}: {e})"
    missing = [f for f in REQUIRED if f not in files]
    problem = f"{MARKER} lists no {', '.join(missing)}" if missing else files_problem(d, files)
    return (None, problem) if problem else (version, None)


def scan_checkpoints(root: str | Path, reported=None) -> tuple[list[tuple[int, Path]],
                                                                list[tuple[Path, str]]]:
    """The checkpoints under `root` (and Ray Train's `reported` one): the good ones as
    (version, dir), oldest first, and the others as (dir, why)."""
    candidates = checkpoint_dirs(root)
    if reported is not None and Path(reported.path).is_dir():
        candidates.append(Path(reported.path))
    good, bad, seen = [], [], set()
    for d in candidates:
        if d.resolve() in seen:
            continue
        seen.add(d.resolve())
        version, why = inspect_checkpoint(d)
        if why is None:
            good.append((version, d))
        else:
            bad.append((d, why))
    return sorted(good, key=lambda vd: (vd[0], vd[1].name)), bad


def latest_checkpoint(root: str | Path, reported=None) -> Path | None:
    """The complete checkpoint with the highest version under `root`, or Ray Train's
    `reported` one if it is as new; a damaged one is skipped with a warning. Scanning
    the storage as well matters: Ray Train registers a report only when its controller
    next polls the worker, so a worker killed shortly after saving can leave a newer
    checkpoint on disk than the one `ray.train.get_checkpoint()` returns after the
    restart."""
    good, bad = scan_checkpoints(root, reported)
    for d, why in bad:
        if why != PRUNED_REASON:
            logger.warning("skipping checkpoint %s: %s", d, why)
    return good[-1][1] if good else None


def nothing_to_resume(root: str | Path) -> str | None:
    """Why no checkpoint under `root` can be resumed from (each candidate's problem),
    or None when one can."""
    good, bad = scan_checkpoints(root)
    if good:
        return None
    if not bad:
        return f"{root} has no checkpoint to resume from"
    return (f"no checkpoint in {root} can be resumed from: "
            + "; ".join(f"{d.name}: {why}" for d, why in bad))


def prune_checkpoints(root: str | Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Empty the complete checkpoints beyond the `keep` newest (0: keep all) down to a
    tombstone; never `protect` (the one just sealed), never one that is incomplete (it
    may be being written, or be evidence). The pruned dirs."""
    if keep <= 0:
        return []
    good, _ = scan_checkpoints(root)
    doomed = [d for _, d in good[:-keep] if protect is None or d.resolve() != protect.resolve()]
    for d in doomed:
        tombstone(d)
    return doomed


def tombstone(d: Path) -> None:
    """Leave only `pruned.json` in `d`: written first, so a prune cut short leaves a
    directory every lookup already ignores."""
    (d / PRUNED).write_text(json.dumps({"pruned": True}))
    (d / MARKER).unlink(missing_ok=True)
    for p in d.iterdir():
        if p.name == PRUNED:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def trainer_state(version: int, next_ticket: int, batch_groups: int,
                  consumed: list[int], records: list[dict] = ()) -> dict:
    """trainer_state.json of a checkpoint taken once `version` is trained.

    `records` are the step records of the versions trained since the previous
    checkpoint. The driver holds them until the job reads them (every 0.5 s), so a
    driver killed in between would lose the last ones, and a resumed run would show a
    hole where the checkpoint's versions were trained; the restart replays them
    (`observe.tracking.unseen_records`).

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
            "consumed": list(consumed), "records": list(records)}


def read_trainer_state(ckpt_dir: str | Path) -> dict:
    state = json.loads((Path(ckpt_dir) / STATE_FILE).read_text())
    state.setdefault("records", [])  # written before checkpoints kept their step records
    return state


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
