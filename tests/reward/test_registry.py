"""The reward registry: the built-in verifiers, an extra checker by dotted path (in the
checker process of the reward stage too), and errors that name the config key."""

import json

import pytest

from areal_ray.config import RewardConfig, load_config
from areal_ray.plugins import PluginError, check_plugins
from areal_ray.reward.pool import RewardStage, TimedChecker, check
from areal_ray.reward.registry import BUILTIN, CheckerRegistry, RewardChecker, check_checkers, verifier_names
from areal_ray.types import Group, Sample

HERE = __name__


class LengthChecker:
    """Reward 1 when the text is exactly `answer` characters long."""

    def check(self, text, answer, opts):
        return float(len(text) == int(answer)), f"length {len(text)}"


class BareReward:
    def check(self, text, answer, opts):
        return 0.5


class Uncallable:
    check = 3


@pytest.mark.usefixtures("available_sandbox")
def test_builtins_grade_math_and_code():
    reg = CheckerRegistry()
    assert reg.names == ("chain", "code", "math") and set(BUILTIN) == {"math", "code", "chain"}
    assert reg.check("math", "so \\boxed{4}", "4") == (1.0, "checked")
    assert reg.check("math", "\\boxed{5}", "4") == (0.0, "checked")
    tests = json.dumps([{"input": "", "output": "7"}])
    reward, reason = reg.check("code", "```python\nprint(7)\n```", tests, {"time_limit_s": 5})
    assert reward == 1.0 and reason.startswith("1/1 tests: all passed")
    assert isinstance(reg.get("math"), RewardChecker)


def test_an_extra_checker_by_dotted_path_is_built_once():
    reg = CheckerRegistry({"length": f"{HERE}.LengthChecker"})
    assert reg.names == ("chain", "code", "length", "math")
    assert reg.check("length", "abc", "3") == (1.0, "length 3")
    assert reg.get("length") is reg.get("length")
    assert check("length", "ab", "3", None, {"length": f"{HERE}.LengthChecker"}) == (0.0, "length 2")


def test_an_extra_checker_may_replace_a_builtin():
    assert CheckerRegistry({"math": f"{HERE}.BareReward"}).check("math", "x", "1") == 0.5


def test_an_unknown_verifier_fails_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown verifier 'llm': the checkers are chain, code, math "
                                         r"\(add one under reward.checkers\)"):
        check("llm", "x", "1")


@pytest.mark.parametrize("served", ["judge", "reward_model"])
def test_a_served_models_verifier_says_its_app_grades_it(served):
    with pytest.raises(ValueError, match=rf"verifier '{served}' is a served model's \(reward.{served}\).*"
                                         rf"reward.{served}.enabled=true"):
        check(served, "x", "1")


def test_the_reward_stage_reaches_an_extra_checker_in_its_checker_process():
    g = Group(ticket=1, uid="u", prompt="p", answer="3", verifier="length", admitted_version=0,
              samples=[Sample([1], [2], [-0.1], [0], "stop", text=t) for t in ("abc", "ab")])
    row = g.to_row()
    stage = RewardStage(RewardConfig(timeout_s=30, checkers={"length": f"{HERE}.LengthChecker"}))
    try:
        out = stage({"ticket": [row["ticket"]], "group": [row["group"]]})
    finally:
        stage.grader.close()
    got = Group.from_row({"ticket": out["ticket"][0], "group": out["group"][0]})
    assert [(s.reward, s.reward_reason) for s in got.samples] == [(1.0, "length 3"), (0.0, "length 2")]


def test_a_checker_that_fails_to_import_in_the_process_gives_zero_with_the_reason():
    c = TimedChecker(30)
    try:
        reward, reason = c("llm", "x", "1", timeout_s=60)
    finally:
        c.close()
    assert reward == 0.0 and "unknown verifier 'llm'" in reason


@pytest.mark.parametrize("checkers, message", [
    ({"mine": "nowhere.Check"}, "reward.checkers.mine 'nowhere.Check': no module named 'nowhere'"),
    ({"mine": f"{HERE}.Nothing"}, f"reward.checkers.mine '{HERE}.Nothing': module {HERE} has no attribute"),
    ({"mine": f"{HERE}.HERE"}, "HERE is a str, not a class"),
    ({"mine": f"{HERE}.Uncallable"}, "class Uncallable has no method check()"),
    ({"mine": 3}, "reward.checkers.mine: 3 is not a dotted class path"),
    ({"": f"{HERE}.LengthChecker"}, "verifier name '' must be a non-empty string"),
])
def test_a_bad_checker_fails_before_ray_naming_the_key(checkers, message):
    with pytest.raises(PluginError, match="reward.checkers") as e:
        check_checkers(checkers)
    assert message in str(e.value)


def test_the_job_check_covers_checkers_and_gives_the_verifier_names():
    cfg = load_config(None, [f"reward.checkers={{length: {HERE}.LengthChecker}}"])
    assert check_plugins(cfg) == ("chain", "code", "length", "math") == verifier_names(cfg.reward.checkers)
    cfg.reward.checkers = {"length": "nowhere.X"}
    with pytest.raises(PluginError, match="reward.checkers.length 'nowhere.X'"):
        check_plugins(cfg)
