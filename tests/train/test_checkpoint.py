"""A resume trusts nothing it finds: the real save/load code on a one-rank gloo group,
with Ray Train's part of a save (copying the reported directory into storage) played
by `Storage`. Damaged checkpoints are skipped for the previous good one, nothing
loadable or a changed config is refused before Ray starts, old checkpoints are pruned,
and no file in a checkpoint can run code when it is loaded."""

import io
import json
import logging
import os
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.train
import torch

from areal_ray.config import ConfigError, load_config, to_dict
from areal_ray.config.run import RESUME_GUARDED
from areal_ray.train.checkpoint import (
    MARKER,
    PRUNED,
    SafePlanner,
    checkpoint_dirs,
    latest_checkpoint,
    load_checkpoint,
    manifest,
    metadata_global_allowed,
    save_checkpoint,
    trainer_state,
    write_marker,
)
from areal_ray.train.fsdp import full_state_dict, load_sharded_model
from areal_ray.train.schedule import make_scheduler

B = 2


class Storage:
    """Ray Train's side of `ray.train.report`: the reported directory is copied into
    `root/checkpoint_<n>`, which `ray.train.get_checkpoint()` then returns.
    `damage(dst)` runs on the copy, as a storage that lost part of it would."""

    def __init__(self, root: Path, damage=None):
        self.root, self.damage, self.n, self.last = root, damage, 0, None

    def report(self, metrics, checkpoint=None):
        self.n += 1
        dst = self.root / f"checkpoint_{self.n:04d}"
        shutil.copytree(checkpoint.path, dst)
        if self.damage:
            self.damage(dst)
        self.last = SimpleNamespace(path=str(dst))

    def get_checkpoint(self):
        return self.last


@pytest.fixture
def storage(tmp_path, monkeypatch):
    s = Storage(tmp_path / "run" / "train")
    monkeypatch.setattr(ray.train, "report", s.report)
    monkeypatch.setattr(ray.train, "get_checkpoint", s.get_checkpoint)
    return s


def build(model_dir: str) -> SimpleNamespace:
    policy = load_sharded_model(model_dir)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    return SimpleNamespace(policy=policy, opt=opt, sched=make_scheduler(opt, 10, 0, "constant"),
                           critic=None, critic_opt=None)


def trained(model_dir: str) -> SimpleNamespace:
    m = build(model_dir)
    m.policy(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    m.opt.step()
    m.sched.step()
    return m


def save(m, version: int, keep: int = 0) -> None:
    state = trainer_state(version, version * B, B, list(range(version * B)))
    save_checkpoint(m, {}, state, "unused", hf_model=False, keep=keep)


def version_of(d: Path) -> int:
    return json.loads((d / "trainer_state.json").read_text())["version"]


def truncate(rel: str):
    def damage(d: Path) -> None:
        p = d / rel
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return damage


def unlink(rel: str):
    return lambda d: (d / rel).unlink(missing_ok=True)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "areal_ray.train.checkpoint" and r.levelno >= logging.WARNING]


def half_marker(d: Path) -> None:
    (d / MARKER).write_text((d / MARKER).read_text()[:40])


def test_a_sealed_checkpoint_round_trips(random_model_dir, one_rank_group, storage):
    a = trained(random_model_dir)
    save(a, 1)
    d = latest_checkpoint(storage.root)
    marker = json.loads((d / MARKER).read_text())
    assert marker["version"] == 1
    assert marker["files"] == manifest(d)  # every file, as it was written
    assert {"trainer_state.json", "state/.metadata", "state/__0_0.distcp", "scheduler.pt",
            "rng_rank0.pt"} <= set(marker["files"])
    assert "sha256" in marker["files"]["trainer_state.json"]
    assert not list(d.glob(f".{MARKER}*"))  # the temp file was renamed into place

    b = build(random_model_dir)
    load_checkpoint(b, d)  # weights_only everywhere: the real files still load
    assert all(torch.equal(x, y) for x, y in zip(full_state_dict(a.policy).values(),
                                                 full_state_dict(b.policy).values()))
    assert b.sched.state_dict() == a.sched.state_dict()


DAMAGE = [  # (what, damage to the newest checkpoint, the reason named in the warning)
    ("truncated shard", truncate("state/__0_0.distcp"), "state/__0_0.distcp has"),
    ("truncated trainer_state.json", truncate("trainer_state.json"), "trainer_state.json has"),
    ("missing marker", unlink(MARKER), f"no {MARKER}"),
    ("half-written marker", half_marker, f"unreadable {MARKER}"),
    ("missing metadata", unlink("state/.metadata"), "state/.metadata is missing"),
    ("rewritten state, same size",
     lambda d: (d / "trainer_state.json").write_text(
         (d / "trainer_state.json").read_text().replace('"version": 2', '"version": 9')),
     "trainer_state.json is not what was written"),
]


@pytest.mark.parametrize("what,damage,reason", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_good_one(
        random_model_dir, one_rank_group, storage, caplog, what, damage, reason):
    m = trained(random_model_dir)
    save(m, 1)
    save(m, 2)
    newest = Path(storage.last.path)
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="areal_ray.train.checkpoint"):
        # also when Ray Train hands the damaged one back after a restart
        found = latest_checkpoint(storage.root, reported=storage.last)
    assert found is not None and version_of(found) == 1
    warned = warnings(caplog)
    assert len(warned) == 1 and newest.name in warned[0] and reason in warned[0], warned
    load_checkpoint(build(random_model_dir), found)


def test_a_copy_that_differs_from_what_was_written_is_not_sealed(random_model_dir, one_rank_group,
                                                                 storage):
    storage.damage = truncate("state/__0_0.distcp")
    with pytest.raises(RuntimeError, match="not stored whole: state/__0_0.distcp has"):
        save(trained(random_model_dir), 1)
    assert not (Path(storage.last.path) / MARKER).exists()


def test_a_report_ray_train_skipped_seals_nothing(random_model_dir, one_rank_group, storage,
                                                 monkeypatch):
    m = trained(random_model_dir)
    save(m, 1)
    first = Path(storage.last.path)
    sealed = (first / MARKER).read_text()
    monkeypatch.setattr(ray.train, "report", lambda metrics, checkpoint=None: None)  # a barrier reset
    save(m, 2)
    assert (first / MARKER).read_text() == sealed and latest_checkpoint(storage.root) == first


RETENTION = [  # (keep, versions saved, versions left complete)
    (0, 4, [1, 2, 3, 4]),
    (1, 3, [3]),
    (3, 5, [3, 4, 5]),
]


@pytest.mark.parametrize("keep,saves,left", RETENTION)
def test_retention_keeps_the_newest_complete_checkpoints(random_model_dir, one_rank_group, storage,
                                                         caplog, keep, saves, left):
    m = trained(random_model_dir)
    for v in range(1, saves + 1):
        save(m, v, keep=keep)
    dirs = checkpoint_dirs(storage.root)
    assert len(dirs) == saves  # a pruned one stays, empty, for Ray Train's run snapshot
    complete = [version_of(d) for d in dirs if (d / MARKER).exists()]
    assert complete == left
    assert all([p.name for p in d.iterdir()] == [PRUNED] for d in dirs if not (d / MARKER).exists())
    with caplog.at_level(logging.WARNING, logger="areal_ray.train.checkpoint"):
        assert version_of(latest_checkpoint(storage.root)) == saves
    assert not warnings(caplog)  # pruned is not damaged


def test_retention_leaves_incomplete_checkpoints_alone(random_model_dir, one_rank_group, storage):
    m = trained(random_model_dir)
    save(m, 1)
    save(m, 2)
    unfinished = Path(storage.last.path)
    (unfinished / MARKER).unlink()  # a save that never finished (or is being written)
    save(m, 3, keep=1)
    assert (unfinished / "trainer_state.json").exists() and (unfinished / "state").is_dir()
    assert [version_of(d) for d in checkpoint_dirs(storage.root)
            if (d / MARKER).exists()] == [3]


class Planted:
    """An object whose unpickling runs code (here: creates a directory)."""

    def __init__(self, flag: Path):
        self.flag = str(flag)

    def __reduce__(self):
        return os.makedirs, (self.flag,)


def plant_torch(rel: str):
    def plant(d: Path, flag: Path) -> None:
        torch.save({"state": Planted(flag)}, d / rel)
    return plant


def plant_metadata(d: Path, flag: Path) -> None:
    (d / "state" / ".metadata").write_bytes(pickle.dumps(Planted(flag)))


PLANTED = [("scheduler.pt", plant_torch("scheduler.pt")),
           ("rng_rank0.pt", plant_torch("rng_rank0.pt")),
           ("state/.metadata", plant_metadata)]


@pytest.mark.parametrize("where,plant", PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_pickle_is_refused_and_never_runs(random_model_dir, one_rank_group, storage,
                                                    tmp_path, where, plant):
    save(trained(random_model_dir), 1)
    d = Path(storage.last.path)
    flag = tmp_path / "code-ran"
    plant(d, flag)
    write_marker(d, 1, manifest(d))  # whoever planted it could rewrite the marker too
    assert latest_checkpoint(storage.root) == d
    with pytest.raises(BaseException) as e:  # DCP's CheckpointException is a BaseException
        load_checkpoint(build(random_model_dir), d)
    # torch's weights_only refusal, or ours of DCP's metadata (which DCP wraps per rank)
    assert not flag.exists(), "the planted code ran"
    said = str(e.value)
    assert "Weights only load failed" in said or "os.makedirs, which DCP does not write" in said, said


def test_dcp_values_and_metadata_globals_are_plain(tmp_path):
    flag = tmp_path / "code-ran"
    buf = io.BytesIO()
    torch.save(Planted(flag), buf)
    with pytest.raises(pickle.UnpicklingError):
        SafePlanner().load_bytes(None, buf)
    assert not flag.exists()
    allowed = [("torch", "Size"), ("torch", "bfloat16"),
               ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata")]
    refused = [("os", "system"), ("builtins", "eval"), ("torch", "load"),
               ("torch.distributed.checkpoint.metadata", "cast")]
    assert all(metadata_global_allowed(*g) for g in allowed)
    assert not any(metadata_global_allowed(*g) for g in refused)


# --- the job's resume checks (areal_ray/run/job.py), before Ray starts -----------------

class RayStarted(Exception):
    pass


@pytest.fixture
def no_ray(monkeypatch):
    """A job that gets past its checks would start Ray: here it stops there instead."""
    import areal_ray.run.job as run

    def refuse(cfg):
        raise RayStarted
    monkeypatch.setattr(run, "init_ray", refuse)
    return run


def job_config(embedded_model, run_dir, *extra):
    return load_config("conf/quickstart.yaml", [
        f"model.path={embedded_model}", f"algo.batch_groups={B}", "train.checkpoint_every=1",
        "task.n_eval=2", f"run.run_dir={run_dir}", *extra])


def first_job(embedded_model, random_model_dir, storage, run_dir, *extra) -> str:
    """What a first job leaves: its config.json and one checkpoint."""
    cfg = job_config(embedded_model, run_dir, *extra)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    save(trained(random_model_dir), 1)
    return (run_dir / "config.json").read_text()


@pytest.mark.parametrize("damage", [truncate("state/__0_0.distcp"), unlink(MARKER)])
def test_resume_with_nothing_loadable_fails_before_ray_naming_each_candidate(
        embedded_model, random_model_dir, one_rank_group, storage, no_ray, tmp_path, damage):
    run_dir = tmp_path / "run"
    first_job(embedded_model, random_model_dir, storage, run_dir)
    save(trained(random_model_dir), 2)
    for d in checkpoint_dirs(storage.root):
        damage(d)
    with pytest.raises(ConfigError) as e:
        no_ray.run_training(job_config(embedded_model, run_dir, "run.resume=true"))
    msg = str(e.value)
    assert str(storage.root) in msg and "checkpoint_0001: " in msg and "checkpoint_0002: " in msg


CHANGES = [  # (override of the resumed job, the guarded key it changes)
    ("train.seed=7", "train.seed"),
    ("task.seed=3", "task.seed"),
    ("task.shuffle_window=5", "task.shuffle_window"),
    ("algo.batch_groups=4", "algo.batch_groups"),
    ("rollout.group_size=2", "rollout.group_size"),
    ("algo.optim.lr=0.5", "algo.optim.lr"),
]


@pytest.mark.parametrize("override,key", CHANGES)
def test_a_resume_that_changes_what_the_checkpoint_refers_to_is_refused(
        embedded_model, random_model_dir, one_rank_group, storage, no_ray, tmp_path, override, key):
    run_dir = tmp_path / "run"
    written = first_job(embedded_model, random_model_dir, storage, run_dir)
    with pytest.raises(ConfigError, match=rf"{key}: .* -> .*run.resume_allow_changes=\[{key}\]"):
        no_ray.run_training(job_config(embedded_model, run_dir, "run.resume=true", override))
    assert (run_dir / "config.json").read_text() == written  # not overwritten
    assert [p.name for p in run_dir.glob("config*.json")] == ["config.json"]

    with pytest.raises(RayStarted):  # allowed: the job goes on
        no_ray.run_training(job_config(embedded_model, run_dir, "run.resume=true", override,
                                       f"run.resume_allow_changes=[{key}]"))


def test_a_resume_may_change_what_does_not_decide_the_checkpoint(
        embedded_model, random_model_dir, one_rank_group, storage, no_ray, tmp_path):
    run_dir = tmp_path / "run"
    first_job(embedded_model, random_model_dir, storage, run_dir)
    with pytest.raises(RayStarted):
        no_ray.run_training(job_config(embedded_model, run_dir, "run.resume=true", "train.steps=50",
                                       "algo.eta=0", "train.num_workers=2"))


def test_each_job_keeps_its_config_and_a_resume_is_checked_against_the_newest(tmp_path):
    from areal_ray.run.resume import check_resume_config, config_records, write_config_record
    first = to_dict(load_config(None, []))
    changed = to_dict(load_config(None, ["train.seed=7"]))
    assert write_config_record(tmp_path, first, resume=False).name == "config.json"
    assert check_resume_config(tmp_path, changed, ["train.seed"]) == {"train.seed": (0, 7)}
    assert write_config_record(tmp_path, changed, resume=True).name == "config.resume-1.json"
    assert write_config_record(tmp_path, changed, resume=True).name == "config.resume-2.json"
    assert [p.name for p in config_records(tmp_path)] == [
        "config.json", "config.resume-1.json", "config.resume-2.json"]
    assert json.loads((tmp_path / "config.json").read_text()) == first
    assert check_resume_config(tmp_path, changed, []) == {}  # the allowed change is the baseline
    with pytest.raises(ConfigError, match="train.seed: 7 -> 0"):
        check_resume_config(tmp_path, first, [])
    (tmp_path / "config.resume-2.json").write_text('{"train": {"se')
    with pytest.raises(ConfigError, match="config.resume-2.json .* not valid JSON"):
        check_resume_config(tmp_path, first, [])


def test_guarded_keys_are_config_keys_and_only_they_may_be_allowed():
    flat = set()

    def walk(d, prefix=""):
        for k, v in d.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) and v else flat.add(f"{prefix}{k}")
    walk(to_dict(load_config(None, [])))
    assert set(RESUME_GUARDED) <= flat
    assert "algo.eta" not in RESUME_GUARDED and "train.steps" not in RESUME_GUARDED
    with pytest.raises(ConfigError, match=r"run.resume_allow_changes: \['algo.eta'\]"):
        load_config(None, ["run.resume_allow_changes=[algo.eta]"])
    with pytest.raises(ConfigError, match="run.keep_checkpoints must be >= 0"):
        load_config(None, ["run.keep_checkpoints=-1"])
