"""End to end: reproducible runs. An asynchronous run (eta 2) records what every step
trained; replaying it retrains bit-identically, and a changed objective on replay
differs only in training. (Two deterministic runs at eta 0 are bit-identical: the first
job of tests/jobs/test_resume.py, run twice.)
The recorded run is also the suite's dynamic-filter run and its run of a user's workflow
that rejects rows (one job, all three sets of checks)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_ray.config import ConfigError, load_config
from areal_ray.run.job import run_training
from areal_ray.train.batch_record import read_step

STEPS, B, N = 3, 4, 8


def config(model, run_dir: Path, *extra: str):
    return load_config("conf/quickstart.yaml", [
        f"model.path={model}", f"algo.batch_groups={B}", f"train.steps={STEPS}",
        # one-step problems at T=0.6, and only groups with a learning signal trained
        # (the dynamic filter): every step trains (at T=1 on the longer chains the
        # warm-started model rarely answers right, and a 3-step run may learn nothing)
        f"rollout.group_size={N}", "rollout.temperature=0.6", "task.max_steps_per_problem=1",
        "algo.dynamic_filter.enabled=true", "algo.dynamic_filter.prompt_factor=8",
        "reward.max_actors=1",  # as tests/jobs/test_resume.py's runs
        "run.eval_before=false",
        "run.eval_after=false", f"run.run_dir={run_dir}", "run.log_model=false",
        f"run.mlflow_tracking_uri=sqlite:///{run_dir.parent / 'mlflow.db'}", *extra])


def steps_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def weights_of(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def batches_of(run_dir: Path) -> list[list[dict]]:
    """Per step, per group: what generation produced (ids, logprobs, versions, rewards)."""
    out = []
    for step in range(len(steps_of(run_dir))):
        _, groups = read_step(run_dir / "batches", step)
        out.append([{"pos": g.pos, "samples": [(s.output_ids, s.logprobs, s.versions, s.reward)
                                               for s in g.samples]} for g in groups])
    return out


# The recorded run: asynchronous, through a workflow named by dotted path (with its
# kwargs) that rejects every odd prompt position (tests/data/user_plugins.py): half the
# prompts it reads are dropped before the filter's, so it reads twice as many.
RECORDED = ("algo.eta=2", "rollout.workflow=tests.data.user_plugins.EvenRowsOnly",
            "rollout.workflow_kwargs={tag: e2e}", "algo.dynamic_filter.prompt_factor=16")
TRAINING = ("loss", "grad_norm", "clip_frac", "n_tokens", "reward_mean", "tickets", "positions")


@pytest.fixture(scope="module")
def recorded(ray_cluster, embedded_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("recorded") / "run"
    run_training(config(embedded_model, run_dir, *RECORDED))
    return run_dir


def test_every_step_is_recorded(recorded):
    # the comparisons below mean something only if the run trained
    assert all(s["grad_norm"] > 0 and s["reward_mean"] > 0 for s in steps_of(recorded))
    for step, record in enumerate(steps_of(recorded)):
        header, groups = read_step(recorded / "batches", step)
        assert header["step"] == step and header["seeded"] is False
        assert [g.ticket for g in groups] == record["tickets"]
        assert [g.pos for g in groups] == record["positions"]
        for g in groups:
            assert len(g.samples) == N
            for s in g.samples:
                assert len(s.output_ids) == len(s.logprobs) == len(s.versions) > 0
                assert s.reward is not None


def test_the_dynamic_filter_trains_only_informative_groups(recorded):
    """DAPO dynamic sampling through the gate, on the recorded run (its filter is on):
    groups whose rewards all agree are dropped and their slots refilled, every step
    still trains B groups with signal, within the bound, each prompt consumed once."""
    steps = steps_of(recorded)
    for s in steps:
        assert s["informative_groups"] == len(s["tickets"]) == B
        assert s["n_samples"] == B * N
        assert s["staleness_max"] <= 2
    used = [p for s in steps for p in s["positions"] + s["filtered_positions"]]
    assert len(used) == len(set(used))  # each prompt consumed once, trained or dropped
    # one-step problems at T=0.6: many groups are all right (or all wrong)
    assert sum(len(s["filtered_positions"]) for s in steps) > 0
    tickets = [t for s in steps for t in s["tickets"]]
    assert tickets == sorted(tickets)


def test_a_users_workflow_that_rejects_rows_trains_every_step(recorded):
    """The recorded run's workflow rejects every odd prompt position: rejected rows hold
    their tickets and are dropped by the trainer (beside the groups the filter drops), so
    every step still trains B groups, none from an odd position, each prompt used once."""
    steps = steps_of(recorded)
    assert len(steps) == STEPS and all(len(s["tickets"]) == B for s in steps)
    trained = [p for s in steps for p in s["positions"]]
    dropped = [p for s in steps for p in s["filtered_positions"]]
    assert all(p % 2 == 0 for p in trained) and any(p % 2 for p in dropped)
    assert len(trained + dropped) == len(set(trained + dropped))


def test_a_replay_retrains_bit_identically(recorded, embedded_model, tmp_path):
    replay = tmp_path / "replay"
    run_training(config(embedded_model, replay, *RECORDED, f"run.replay={recorded}"))
    got, want = steps_of(replay), steps_of(recorded)
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want):
        assert {k: g.get(k) for k in TRAINING} == {k: w.get(k) for k in TRAINING}
    assert same_weights(weights_of(replay), weights_of(recorded))


def test_a_changed_objective_on_replay_differs_only_in_training(recorded, embedded_model, tmp_path):
    replay = tmp_path / "replay-clip"
    run_training(config(embedded_model, replay, *RECORDED, f"run.replay={recorded}",
                        "algo.loss.eps_clip=0.02", "algo.optim.lr=3e-4"))
    got, want = steps_of(replay), steps_of(recorded)
    for g, w in zip(got, want):  # the same data ...
        assert (g["reward_mean"], g["tickets"], g["positions"], g["n_tokens"]) == \
            (w["reward_mean"], w["tickets"], w["positions"], w["n_tokens"])
    assert any(g["loss"] != w["loss"] for g, w in zip(got[1:], want[1:]))  # ... trained otherwise
    assert not same_weights(weights_of(replay), weights_of(recorded))


def test_a_replay_longer_than_the_record_is_refused_before_it_starts(recorded, embedded_model,
                                                                     tmp_path):
    with pytest.raises(ConfigError, match=f"holds {STEPS} steps"):
        run_training(config(embedded_model, tmp_path / "r", f"run.replay={recorded}",
                            f"train.steps={STEPS + 1}"))
