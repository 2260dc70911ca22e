"""The served rewards' pure parts: prompts, the judge's text to a score, the per-call
deadline, the config section, the reason kinds the step record counts."""

import random

import pytest

from areal_ray.config import ConfigError, load_config
from areal_ray.config.judge import JudgeConfig, served_route, served_verifiers
from areal_ray.judge.deadline import CallDeadline, answered, failed, late
from areal_ray.judge.models import pair
from areal_ray.judge.parse import parse, parse_score, parse_verdict
from areal_ray.judge.prompt import Item, final_answer, render
from areal_ray.reward.pool import reason_kind


@pytest.mark.parametrize("text, answer", [
    ("12+7=19.\\boxed{19}", "19"), ("\\boxed{1}\\boxed{ 21 }", "21"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"), ("no box", ""), ("\\boxed{12", ""), ("", "")])
def test_final_answer_is_the_last_balanced_box(text, answer):
    assert final_answer(text) == answer


def test_render_fills_every_field_and_keeps_braces_in_values_as_text():
    item = Item("12+7=", "12+7=19.\\boxed{19}", "19")
    assert render("{reference}:{answer}?", item) == "19:19?"
    assert render("Q {question} A {response} R {reference}", item) == \
        "Q 12+7= A 12+7=19.\\boxed{19} R 19"
    assert render("{answer}", Item("q", "{x}", "r")) == ""
    # the embedded judge's default: both numbers right-aligned in three columns
    assert render(JudgeConfig().template, Item("q", "\\boxed{21}", "7")) == "  7: 21?"
    assert render(JudgeConfig().template, Item("q", "no answer", "42")) == " 42:   ?"


def test_embedded_pairs_are_balanced_and_labelled_by_the_rule():
    rng = random.Random(0)
    pairs = [pair(rng) for _ in range(2000)]
    assert all(ok == (a == r) for r, a, ok in pairs)
    assert 0.45 < sum(ok for *_, ok in pairs) / len(pairs) < 0.6
    assert any(a == "" for _, a, _ in pairs)  # no answer at all is a case
    assert pairs[:5] == [pair(r) for r in [random.Random(0)] for _ in range(5)]  # seeded


@pytest.mark.parametrize("text, top, reward, kind", [
    ("1", 1, 1.0, "judge scored"), ("0", 1, 0.0, "judge scored"),
    ("Score: 7", 10, 0.7, "judge scored"), ("3 of 10, \\boxed{8}", 10, 0.8, "judge scored"),
    ("15", 10, 1.0, "judge scored"), ("-2", 10, 0.0, "judge scored"),
    ("no idea", 1, 0.0, "judge unparsed")])
def test_parse_score(text, top, reward, kind):
    r, reason = parse_score(text, top)
    assert r == pytest.approx(reward) and reason_kind(reason) == kind


@pytest.mark.parametrize("text, reward, kind", [
    ("Yes, it is.", 1.0, "judge scored"), ("Correct", 1.0, "judge scored"),
    ("Incorrect.", 0.0, "judge scored"), ("no", 0.0, "judge scored"),
    ("maybe", 0.0, "judge unparsed")])
def test_parse_verdict(text, reward, kind):
    r, reason = parse_verdict(text)
    assert r == reward and reason_kind(reason) == kind


def test_parse_refuses_an_unknown_parser():
    with pytest.raises(ValueError, match="'score', 'verdict'"):
        parse("1", "regex")


def test_deadline_runs_from_the_send_and_retries_only_while_time_is_left():
    dl = CallDeadline(timeout_s=2.0, retries=1, start=100.0)
    assert dl.left(100.5) == pytest.approx(1.5) and dl.left(103.0) == 0.0
    assert dl.retry(101.0) and dl.attempts == 2
    assert not dl.retry(101.1)  # retries spent
    assert not CallDeadline(2.0, 3, start=100.0).retry(102.5)  # deadline passed
    assert not CallDeadline(2.0, 0, start=100.0).retry(100.1)  # no retries


def test_every_ending_of_a_call_is_a_reward_and_a_counted_reason():
    assert late("judge", 2.0) == (0.0, "judge timeout after 2s")
    assert reason_kind(late("judge", 2.0)[1]) == "judge timeout"
    r, reason = failed("reward_model", RuntimeError("replica died"), 2)
    assert r == 0.0 and reason_kind(reason) == "reward_model failed" and "replica died" in reason
    assert answered("judge", (1.0, "judge scored 1")) == (1.0, "judge scored 1")
    assert answered("reward_model", (0.25, "")) == (0.25, "reward_model scored 0.25")
    for bad in ((float("nan"), "x"), (float("inf"), "x"), ("one", "x")):
        r, reason = answered("judge", bad)
        assert r == 0.0 and reason_kind(reason) == "judge non-finite"
    # a checker's own timeout keeps its kind
    assert reason_kind("timeout after 5.0s") == "timeout"


def test_config_section_routes_and_names_verifiers():
    cfg = load_config("conf/judge.yaml", [])
    assert served_verifiers(cfg.reward.judge, cfg.reward.reward_model) == ("judge",)
    assert served_route(cfg.reward.judge, cfg.reward.reward_model) == {"judge": "judge", "math": "judge"}
    off = load_config("conf/quickstart.yaml", [])
    assert served_route(off.reward.judge, off.reward.reward_model) == {}
    both = load_config("conf/judge.yaml", ["reward.reward_model.enabled=true",
                                           "reward.reward_model.instead_of=[code]"])
    assert served_route(both.reward.judge, both.reward.reward_model) == \
        {"judge": "judge", "math": "judge", "reward_model": "reward_model", "code": "reward_model"}


@pytest.mark.parametrize("override, message", [
    ("reward.judge.bogus=1", "reward.judge.bogus"),
    ("reward.judge.min_replicas=3", "reward.judge.min_replicas <= reward.judge.max_replicas"),
    ("reward.judge.timeout_s=0", "reward.judge.timeout_s must be > 0"),
    ("reward.judge.template='Q {question} X {oops}'", "unknown field(s) ['oops']"),
    ("reward.judge.template='no fields'", "names no field"),
    ("reward.judge.parser=regex", "reward.judge.parser"),
    ("reward.judge.instead_of=[judge]", "is a served reward itself"),
    ("reward.reward_model.squash=tanh", "reward.reward_model.squash"),
    ("reward.reward_model.max_batch_size=0", "reward.reward_model.max_batch_size must be >= 1"),
])
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("conf/judge.yaml", [override])
    assert message in str(e.value)


def test_one_served_reward_per_verifier():
    with pytest.raises(ConfigError, match="both reward.judge.instead_of and reward.reward_model"):
        load_config("conf/judge.yaml", ["reward.reward_model.enabled=true",
                                        "reward.reward_model.instead_of=[math]"])


def test_the_planner_counts_the_served_rewards_replicas_in_the_jobs_start_order():
    from areal_ray.cluster.plan import JUDGE, REPLICA, REWARD, REWARD_MODEL, TRAINER, Node, demands, place
    cfg = load_config("conf/judge.yaml", ["reward.judge.min_replicas=2", "reward.judge.max_replicas=2",
                                          "reward.judge.num_cpus=1", "reward.reward_model.enabled=true",
                                          "reward.reward_model.instead_of=[]"])
    needs = demands(cfg)
    assert [d.role for d in needs] == [REPLICA, JUDGE, REWARD_MODEL, TRAINER, REWARD]
    assert (needs[1].count, needs[1].cpus) == (2, 1.0)
    total = sum(d.count * d.cpus for d in needs)
    assert place(needs, [Node("n0", cpus=total, gpus=0)]).fits
    assert not place(needs, [Node("n0", cpus=total - 0.5, gpus=0)]).fits  # a judge replica short
    assert not {JUDGE, REWARD_MODEL} & {d.role for d in demands(load_config("conf/quickstart.yaml", []))}
