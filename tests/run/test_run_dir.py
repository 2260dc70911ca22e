"""A new run refuses a run dir that holds another run's outputs (its step log, its
recorded batches), as it refuses one with checkpoints: a replay of that dir would
otherwise train two runs as one. Refused before Ray is touched."""

import pytest

from areal_ray.config import ConfigError, load_config
from areal_ray.run.job import run_training
from areal_ray.run.resume import check_fresh_run_dir, other_run_outputs
from areal_ray.train.batch_record import RECORD_DIR


def leave(run_dir, steps: str = "", batches: int = 0):
    run_dir.mkdir(parents=True, exist_ok=True)
    if steps is not None:
        (run_dir / "steps.jsonl").write_text(steps)
    for n in range(batches):
        (run_dir / RECORD_DIR).mkdir(exist_ok=True)
        (run_dir / RECORD_DIR / f"step-{n:06d}.jsonl").write_text("{}\n")
    return run_dir


@pytest.mark.parametrize("steps, batches, found", [
    ("", 0, []),  # a job that ended before its first step
    (None, 0, []),  # nothing at all
    ('{"step": 0}\n', 0, ["steps.jsonl"]),
    ("", 3, ["batches/ (3 recorded steps: step-000000.jsonl ... step-000002.jsonl)"]),
    ('{"step": 0}\n', 1, ["steps.jsonl", "batches/ (1 recorded steps: step-000000.jsonl)"]),
])
def test_what_counts_as_another_runs_outputs(tmp_path, steps, batches, found):
    run_dir = leave(tmp_path / "run", steps, batches)
    assert other_run_outputs(run_dir, RECORD_DIR) == found
    if found:
        with pytest.raises(ConfigError, match=r"already holds another run's outputs .*run.resume=true"):
            check_fresh_run_dir(run_dir, RECORD_DIR)
    else:
        check_fresh_run_dir(run_dir, RECORD_DIR)


def test_a_new_run_in_a_used_run_dir_is_refused_before_ray(tmp_path, random_model_dir):
    run_dir = leave(tmp_path / "run", '{"step": 0}\n', 2)
    # a replay of nothing: without the refusal, the next check stops the job, still before Ray
    cfg = load_config(None, [f"model.path={random_model_dir}", f"run.run_dir={run_dir}",
                             "run.eval_before=false", "run.eval_after=false",
                             f"run.replay={tmp_path / 'nothing'}"])
    with pytest.raises(ConfigError, match=rf"{run_dir} already holds another run's outputs "
                                          r"\(steps.jsonl; batches/ \(2 recorded steps"):
        run_training(cfg)
