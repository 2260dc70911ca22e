"""The worker loop's pure parts: groups -> sequences with advantages and staleness."""

from areal_ray.config import load_config
from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.train.loop import flatten_groups, informative
from areal_ray.types import Group, Sample


def make_groups(engine, rewards_per_group, version=0):
    groups = []
    for gi, rewards in enumerate(rewards_per_group):
        reqs = [GenerationRequest([5, 6, 7 + gi], 8, 1.0, ignore_eos=True) for _ in rewards]
        engine.version = version
        res = engine.generate_batch(reqs)
        samples = [Sample(q.input_ids, r.output_ids, r.logprobs, r.versions, r.stop_reason, reward=rw)
                   for q, r, rw in zip(reqs, res, rewards)]
        groups.append(Group(gi, f"u{gi}", "p", "1", "math", version, samples))
    return groups


def test_flatten_groups_advantages_and_staleness(random_model_dir):
    engine = HFEngine(random_model_dir)
    groups = make_groups(engine, [[1.0, 0.0], [1.0, 1.0]], version=2)
    algo = load_config(None, ["algo.adv.estimator=dr_grpo"]).algo
    seqs = flatten_groups(groups, algo, max_new_tokens=8, trained_version=5)
    assert [s["advantage"] for s in seqs] == [0.5, -0.5, 0.0, 0.0]
    assert {s["staleness"] for s in seqs} == {3}


def test_informative_is_the_dynamic_filter(random_model_dir):
    engine = HFEngine(random_model_dir)
    mixed, flat = make_groups(engine, [[1.0, 0.0], [1.0, 1.0]])
    assert informative(mixed) and not informative(flat)


def test_gae_passes_shaped_outcome_rewards_to_the_critic(random_model_dir):
    engine = HFEngine(random_model_dir)
    algo = load_config(None, ["algo.adv.estimator=gae", "algo.reward_shaping.bias=-0.5"]).algo
    seqs = flatten_groups(make_groups(engine, [[1.0, 0.0]]), algo, 8, 0)
    assert [s["advantage"] for s in seqs] == [0.5, -0.5]


def test_a_nonfinite_reward_leaves_the_step_record_and_its_line_printable(random_model_dir):
    import io

    from areal_ray.observe.progress import StepProgress
    from areal_ray.train.feeder import StepBatch
    from areal_ray.train.loop import step_record

    engine = HFEngine(random_model_dir)
    algo = load_config(None, []).algo
    for rewards, mean in (([float("nan"), 1.0], 1.0), ([float("nan"), float("inf")], None)):
        groups = make_groups(engine, [rewards])
        seqs = flatten_groups(groups, algo, 8, 0)
        rec = step_record(0, groups, seqs, StepBatch(groups, [], 0.5), {"step_s": 1.0})
        assert rec["reward_mean"] == mean  # the rewards that were trained on
        out = io.StringIO()
        StepProgress(1, stream=out).step(rec)
        assert f"reward {'n/a' if mean is None else '1.000'}" in out.getvalue()
