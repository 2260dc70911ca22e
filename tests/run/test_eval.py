"""The unbiased pass@k estimator, checked against hand-computed values."""

import pytest

from areal_ray.run.eval import pass_at_k


@pytest.mark.parametrize("n,c,k,expected", [
    (4, 0, 2, 0.0), (4, 4, 2, 1.0), (4, 1, 1, 0.25), (4, 2, 2, 1 - 1 / 6), (5, 3, 3, 1.0),
    (8, 1, 8, 1.0), (8, 1, 4, 0.5),
])
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_needs_k_samples():
    with pytest.raises(ValueError, match="at least 4 samples"):
        pass_at_k(3, 1, 4)


# --- evaluation grades as the training reward stage does (issue 31) -----------------

import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

from areal_ray.config import Config, RewardConfig  # noqa: E402
from areal_ray.reward.pool import RewardStage  # noqa: E402
from areal_ray.run.eval import evaluate  # noqa: E402
from areal_ray.types import Group, Sample  # noqa: E402

HERE = __name__
CODE_OPTS = {"time_limit_s": 1.5, "memory_limit_mb": 256, "sandbox": "rlimits"}


class SlowChecker:
    """Sleeps the seconds the text says, then calls it right."""

    def check(self, text, answer, opts):
        time.sleep(float(text))
        return 1.0, "slept"


class CodeSettingsChecker:
    """Stands in for `code`: takes a second (past reward.timeout_s, within
    reward.code_timeout_s) and is right only when given the reward.code_* settings."""

    def check(self, text, answer, opts):
        time.sleep(float(text))
        return float(opts == json.loads(answer)), f"opts {sorted(opts.items())}"


# (verifier, output text, answer): graded right, right, right, wrong (a timeout), in
# that order (the timed-out checker process restarts, paying its imports, last).
# Graded with evaluation's old settings: right, wrong, wrong, right.
CASES = [("slow", "0", ""), ("code", "1", json.dumps(CODE_OPTS)),
         ("code", "0", json.dumps(CODE_OPTS)), ("slow", "5", "")]


def shared_config() -> Config:
    reward = RewardConfig(timeout_s=0.75, code_timeout_s=10.0, code_time_limit_s=1.5,
                          code_memory_limit_mb=256, sandbox="rlimits",
                          checkers={"slow": f"{HERE}.SlowChecker",
                                    "code": f"{HERE}.CodeSettingsChecker"})
    return dataclasses.replace(Config(), reward=reward)


class _Pending:
    def __init__(self, out):
        self.out = out

    def result(self, timeout_s=None):
        return self.out


class ScriptedHandle:
    """The rollout app's handle for single-turn evaluation: each prompt (`p<i>`)
    generates case i's text, one character a token."""

    class _Generate:
        def remote(self, req):
            text = CASES[int("".join(map(chr, req.input_ids))[1:])][1]
            return _Pending({"output_ids": [ord(c) for c in text], "logprobs": [0.0] * len(text),
                             "versions": [0] * len(text), "stop_reason": "stop"})

    generate = _Generate()


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_evaluation_and_the_reward_stage_grade_with_the_same_reward_settings():
    """reward.timeout_s bounds a check in both (evaluation used its own 30 s), a code
    check gets reward.code_timeout_s and the reward.code_* settings in both (evaluation
    gave it neither), and reward.checkers are reached by both."""
    cfg = shared_config()
    rows = [{"prompt": f"p{i}", "answer": a, "verifier": v} for i, (v, _, a) in enumerate(CASES)]
    got = evaluate(ScriptedHandle(), CharTokenizer(), rows, cfg)
    assert got["accuracy"] == 3 / 4 and got["n"] == 4

    stage = RewardStage(cfg.reward)
    try:
        graded = []
        for i, (verifier, text, answer) in enumerate(CASES):
            row = Group(ticket=i, uid=str(i), prompt=f"p{i}", answer=answer, verifier=verifier,
                        admitted_version=0,
                        samples=[Sample([1], [2], [-0.1], [0], "stop", text=text)]).to_row()
            out = stage({"ticket": [row["ticket"]], "group": [row["group"]]})
            (s,) = Group.from_row({"ticket": out["ticket"][0], "group": out["group"][0]}).samples
            graded.append((s.reward, s.reward_reason))
    finally:
        stage.grader.close()
    assert [r for r, _ in graded] == [1.0, 1.0, 1.0, 0.0]
    assert graded[3][1] == "timeout after 0.75s"
