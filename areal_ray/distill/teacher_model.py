"""The embedded teacher of conf/distill.yaml: the quickstart's model after 20 RL steps.

`artifacts/tiny-teacher` is the final model of a deterministic quickstart run
(`run.deterministic=true` at `algo.eta=0`: bit-identical on a given machine and
build, docs/reproducibility.md), so the student (artifacts/tiny, the quickstart's
warm start) and its teacher share the tokenizer and the task, and the teacher is
what RL from the task reward reaches. Built by `make tiny-teacher`, or on first use
by a run that names it (`resolve_teacher`), in a child process: the run it trains is
a whole job with its own local Ray cluster.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TEACHER_DIR = "artifacts/tiny-teacher"
# The run whose final model the teacher is (jobs.train overrides on conf/quickstart.yaml).
TEACHER_RUN = ("run.deterministic=true", "algo.eta=0", "train.steps=20", "run.name=tiny-teacher",
               "run.eval_before=false", "run.eval_after=false", "run.log_model=false",
               "run.record_batches=false")


def build_teacher(out: Path, overrides: tuple[str, ...] = TEACHER_RUN) -> Path:
    """Train the teacher and write its final model to `out` (whole or not at all)."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".tiny-teacher-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "jobs.train", "--config", "conf/quickstart.yaml",
               *overrides, f"run.run_dir={run_dir}"]
        done = subprocess.run(cmd, cwd=REPO_ROOT, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"building the teacher failed (exit {done.returncode}): {' '.join(cmd)}")
        model = run_dir / "final_model"
        summary = json.loads((run_dir / "summary.json").read_text())
        (model / "TEACHER.json").write_text(json.dumps(
            {"config": "conf/quickstart.yaml", "overrides": list(overrides),
             "reward_first": summary.get("reward_first"), "reward_last": summary.get("reward_last")},
            indent=1))
        for junk in ("adapter",):  # a LoRA run's extra; the quickstart has none
            shutil.rmtree(model / junk, ignore_errors=True)
        if out.exists():
            shutil.rmtree(out)
        model.rename(out)
    return out


def resolve_teacher(path: str) -> str:
    """`algo.distill.teacher_path` as an absolute model dir; the embedded teacher is
    built on first use."""
    p = Path(path)
    if Path(path) == Path(TEACHER_DIR):
        p = REPO_ROOT / TEACHER_DIR
        if not (p / "config.json").exists():
            print(f"[areal-ray] building the embedded teacher in {p} (once: a deterministic "
                  "20-step quickstart run)", flush=True)
            build_teacher(p)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"algo.distill.teacher_path {path!r} has no config.json: not an "
                                "HF model directory")
    return str(p.resolve())


def check_same_tokenizer(model_path: str, teacher_path: str) -> None:
    """The teacher scores the student's token ids: both must read them alike."""
    from areal_ray.task.tokenizer import load_tokenizer
    a, b = load_tokenizer(model_path), load_tokenizer(teacher_path)
    if a.get_vocab() != b.get_vocab():
        raise ValueError(f"algo.distill.teacher_path {teacher_path} has another tokenizer than "
                         f"model.path {model_path}: the teacher must score the student's token ids")
