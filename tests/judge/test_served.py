"""The served rewards' apps on a real local cluster: the reward model's and the judge's
Serve apps (deployments/judge.py) graded through the reward stage's client, batched by
serve.batch; a call past its deadline, and one to an app that is gone, are reward 0 with
their reasons."""

import pytest
from ray import serve

from areal_ray.cluster.ownership import Owned
from areal_ray.cluster.placement import delete_extra_apps
from areal_ray.config import load_config
from areal_ray.judge.client import DEPLOYMENTS, from_config
from areal_ray.judge.models import resolve_all
from areal_ray.reward.pool import reason_kind
from deployments.judge import start_served_rewards

TEXTS = ["12+7=19.\\boxed{19}", "\\boxed{18}", "\\boxed{91}", "no answer", "\\boxed{19}", "\\boxed{9}"]
RIGHT = [True, False, False, False, True, False]


def hurried_cfg(kind: str, timeout_s: float):
    return load_config("conf/judge.yaml", [
        f"reward.{kind}.enabled=true", "reward.judge.enabled=" + str(kind == "judge").lower(),
        f"reward.{kind}.timeout_s={timeout_s}"]).reward


@pytest.mark.parametrize("kind", ["reward_model", "judge"])
def test_served_reward_grades_a_group_batched_and_under_deadlines(ray_cluster, kind):
    cfg = load_config("conf/judge.yaml", [f"reward.{kind}.enabled=true",
                                          f"reward.{kind}.instead_of=[chain]",
                                          "reward.judge.enabled=" + str(kind == "judge").lower(),
                                          f"reward.{kind}.timeout_s=60"])
    owned = Owned("0badcafe")
    models = resolve_all(cfg.reward)  # the embedded one, built on first use
    assert set(models) == {kind}
    try:
        start_served_rewards(cfg.reward, models, owned, 300)
        client = from_config(cfg.reward, owned.tag)
        graded = client.grade("chain", "12+7=", "19", TEXTS)
        assert [reason_kind(why) for _, why in graded] == [f"{kind} scored"] * len(TEXTS)
        said = [r > 0.5 for r, _ in graded]
        assert sum(s == ok for s, ok in zip(said, RIGHT)) >= 5, graded  # the rule, learned
        stats = serve.get_deployment_handle(DEPLOYMENTS[kind], owned.served_app_name(kind)) \
            .stats.remote().result(timeout_s=60)
        assert max(stats["batches"]) > 1  # one forward answered several calls

        hurried = from_config(hurried_cfg(kind, 0.001), owned.tag)
        late = hurried.grade(kind, "12+7=", "19", TEXTS[:2])
        assert all(r == 0.0 and reason_kind(why) == f"{kind} timeout" for r, why in late), late
        assert hurried.calls["late"] == 2
    finally:
        delete_extra_apps(owned)
    assert owned.served_app_name(kind) not in serve.status().applications
    gone = from_config(hurried_cfg(kind, 2.0), owned.tag)  # the app is gone: reasons, not a hang
    failed = gone.grade(kind, "12+7=", "19", TEXTS[:1])
    assert failed[0][0] == 0.0 and reason_kind(failed[0][1]) in (f"{kind} failed", f"{kind} timeout")
