"""`algo.distill`: its checks, with messages naming the key."""

import pytest

from areal_ray.config import ConfigError, load_config


def distill(*extra):
    return load_config("conf/quickstart.yaml", ["algo.distill.enabled=true",
                                                "algo.distill.teacher_path=artifacts/tiny", *extra])


def test_conf_distill_loads_with_its_teacher():
    cfg = load_config("conf/distill.yaml", [])
    assert cfg.algo.distill.enabled and cfg.algo.distill.teacher_path == "artifacts/tiny-teacher"
    assert cfg.algo.distill.reward_weight == 0.0


@pytest.mark.parametrize("extra, message", [
    (["algo.distill.teacher_path=''"], "needs algo.distill.teacher_path"),
    (["algo.distill.min_replicas=2", "algo.distill.max_replicas=1"], "algo.distill.min_replicas"),
    (["algo.distill.deadline_s=0"], "algo.distill.deadline_s must be > 0"),
    (["algo.distill.coef=0"], "algo.distill.coef must be > 0"),
    (["algo.distill.reward_weight=-1"], "algo.distill.reward_weight must be >= 0"),
    (["algo.adv.estimator=gae"], "algo.adv.estimator=gae"),
    (["rollout.temperature=0.6"], r"needs rollout.temperature=1 \(it is 0.6\)"),
])
def test_bad_settings_are_refused_naming_the_key(extra, message):
    with pytest.raises(ConfigError, match=message):
        distill(*extra)


def test_unknown_keys_and_choices_are_errors():
    with pytest.raises(ConfigError, match="teacher_pth"):
        distill("algo.distill.teacher_pth=x")
    with pytest.raises(ConfigError, match="late"):
        distill("algo.distill.late=never")


def test_off_by_default_and_off_needs_nothing():
    cfg = load_config("conf/quickstart.yaml", [])
    assert not cfg.algo.distill.enabled and cfg.algo.distill.teacher_path == ""


def test_the_planner_places_the_teacher_replicas_after_the_rollout_replicas():
    from areal_ray.cluster.plan import REPLICA, TEACHER, Node, demands, place
    cfg = distill("algo.distill.min_replicas=2", "algo.distill.max_replicas=3",
                  "algo.distill.num_cpus=2")
    needs = demands(cfg)
    assert [d.role for d in needs][:2] == [REPLICA, TEACHER]
    assert (needs[1].count, needs[1].cpus) == (2, 2.0)
    assert TEACHER not in [d.role for d in demands(load_config("conf/quickstart.yaml", []))]
    # 1 replica + 2 teachers x 2 + trainer + reward actor: 7 CPUs
    assert place(needs, [Node("n0", cpus=7, gpus=0)]).fits
    assert not place(needs, [Node("n0", cpus=6, gpus=0)]).fits
