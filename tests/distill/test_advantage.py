"""Per-token distillation advantages, the teacher's verdict on a group and the step
record's teacher numbers, against hand-computed cases."""

import math

import pytest

from areal_ray.config import Config
from areal_ray.distill.advantage import (
    FAILED,
    LATE,
    OK,
    TEACHER,
    apply,
    check_scores,
    dropped,
    mark,
    metrics,
    token_advantages,
)
from areal_ray.train.loop import flatten_groups
from areal_ray.types import Group, Sample


def sample(logprobs, reward=1.0, loss_mask=None):
    n = len(logprobs)
    return Sample(prompt_ids=[1, 2], output_ids=list(range(3, 3 + n)), logprobs=list(logprobs),
                  versions=[0] * n, stop_reason="stop", reward=reward, loss_mask=loss_mask)


def group(*samples, ticket=0):
    return Group(ticket=ticket, uid="u", prompt="p", answer="a", verifier="math",
                 admitted_version=0, samples=list(samples), pos=ticket)


def test_pure_distillation_is_teacher_minus_student_per_token():
    # teacher -0.5, -2.0; student -1.0, -1.0: +0.5 (teacher likes it more), -1.0
    assert token_advantages([-0.5, -2.0], [-1.0, -1.0], task_adv=3.0) == [0.5, -1.0]


def test_coef_and_reward_weight_mix_the_task_advantage_into_every_policy_token():
    # 2 * (t - b) + 0.5 * 3.0 = 2 * diff + 1.5; the tool token (mask 0) gets 0
    got = token_advantages([-0.5, -9.0, -2.0], [-1.0, 0.0, -1.0], task_adv=3.0, coef=2.0,
                           reward_weight=0.5, loss_mask=[1, 0, 1])
    assert got == [2 * 0.5 + 1.5, 0.0, 2 * -1.0 + 1.5]


def test_lengths_that_disagree_are_refused():
    with pytest.raises(ValueError, match="teacher scored 1 tokens, the sample has 2"):
        token_advantages([-1.0], [-1.0, -1.0], 0.0)
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        token_advantages([-1.0, -1.0], [-1.0, -1.0], 0.0, loss_mask=[1])


def test_check_scores_names_what_does_not_fit():
    g = group(sample([-1.0, -1.0]), sample([-1.0]))
    assert check_scores(g, [[-1.0, -2.0], [-3.0]]) is None
    assert "returned 1 scored samples for a group of 2" in check_scores(g, [[-1.0, -2.0]])
    assert "sample 1: 2 teacher logprobs for 1 output tokens" in check_scores(g, [[-1.0, -2.0], [-1.0, -1.0]])
    assert "not finite" in check_scores(g, [[-1.0, float("nan")], [-3.0]])
    assert "returned dict" in check_scores(g, {"x": 1})


def test_a_late_group_is_dropped_only_under_late_drop():
    kept = mark(group(sample([-1.0])), LATE, 2.0, "slow")
    assert kept.samples and kept.meta[TEACHER]["status"] == LATE and not dropped(kept)
    gone = mark(group(sample([-1.0])), FAILED, 0.1, "dead", drop=True)
    assert gone.samples == [] and dropped(gone)
    scored = mark(group(sample([-1.0])), OK, 0.1, logprobs=[[-0.5]], drop=True)
    assert scored.samples and not dropped(scored)  # drop applies to late groups only


def test_the_trainer_gets_token_advantages_for_scored_groups_and_the_task_advantage_for_late_ones():
    cfg = Config()
    cfg.algo.distill.enabled, cfg.algo.distill.teacher_path = True, "t"
    cfg.algo.distill.coef, cfg.algo.distill.reward_weight = 1.0, 0.5
    cfg.algo.adv.estimator = "dr_grpo"  # A = r - mean: rewards 1, 0 -> +0.5, -0.5
    ok = mark(group(sample([-1.0, -1.0], 1.0), sample([-2.0], 0.0), ticket=0), OK, 0.3,
              logprobs=[[-0.5, -1.5], [-1.0]])
    late = mark(group(sample([-1.0], 1.0), sample([-1.0], 0.0), ticket=1), LATE, 30.0, "slow")
    seqs = flatten_groups([ok, late], cfg.algo, max_new_tokens=8, trained_version=0)
    by = {(s["ticket"], s["sample"]): s for s in seqs}
    # 1.0 * (teacher - student) + 0.5 * task advantage
    assert by[0, 0]["token_advantages"] == [0.5 + 0.25, -0.5 + 0.25]
    assert by[0, 1]["token_advantages"] == [1.0 - 0.25]
    assert "token_advantages" not in by[1, 0] and by[1, 0]["advantage"] == pytest.approx(0.5)


def test_apply_leaves_groups_the_teacher_never_saw():
    seqs = [{"ticket": 0, "sample": 0, "logprobs": [-1.0], "advantage": 1.0}]
    apply([group(sample([-1.0]))], seqs, 1.0, 0.0)
    assert "token_advantages" not in seqs[0]


def test_metrics_count_the_groups_and_average_the_reverse_kl_over_policy_tokens():
    ok = mark(group(sample([-1.0, -3.0, -1.0], loss_mask=[1, 0, 1])), OK, 0.2,
              logprobs=[[-0.5, -7.0, -2.0]])
    late = mark(group(sample([-1.0]), ticket=1), LATE, 1.0, "slow")
    m = metrics([ok, late], teacher_dropped=2)
    assert (m["teacher_scored"], m["teacher_late"], m["teacher_dropped"]) == (1, 1, 2)
    # policy tokens: (b - t) = -1 - -0.5 = -0.5 and -1 - -2 = 1.0 -> mean 0.25
    assert m["distill_reverse_kl"] == pytest.approx(0.25)
    assert m["teacher_logprob_mean"] == pytest.approx(-1.25)
    assert m["teacher_s_mean"] == pytest.approx(0.6) and m["teacher_s_max"] == 1.0
    empty = metrics([])
    assert empty["teacher_scored"] == 0 and empty["distill_reverse_kl"] is None
    assert not any(isinstance(v, float) and math.isnan(v) for v in m.values())
