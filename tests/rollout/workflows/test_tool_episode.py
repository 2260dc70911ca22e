"""One multi-turn sample's bookkeeping without an engine: token ids, the loss mask,
logprobs and versions across turns, interrupted rounds and tool results, the budgets
and the end reasons. (The workflow on a real engine: test_tool_workflow.py.)"""

import pytest

from areal_ray.plugins import PluginError
from areal_ray.rollout.workflows.base import EpisodeConfig
from areal_ray.rollout.workflows.tool import ToolEpisode, ToolWorkflow

CLOSE = 9  # the `)` stop id in these tests


def run_round(ep: ToolEpisode, *results: dict) -> bool:
    """Feed one round's engine results (an abort is resubmitted inside the round)."""
    part = ep.start_round()
    assert part is not None
    for res in results:
        assert part.open
        ids, budget = part.next_call()
        assert ids == ep.prompt_ids + ep.out_ids + part.out_ids  # never re-encoded
        part.add(res)
    assert not part.open
    return ep.end_round([CLOSE])


def res(ids, version, reason):
    return {"output_ids": ids, "logprobs": [-0.5] * len(ids), "versions": [version] * len(ids),
            "stop_reason": reason}


def test_turns_tool_results_and_an_interrupted_turn_keep_every_token_exact():
    ep = ToolEpisode([1, 2, 3], turn_tokens=10, total_tokens=40, max_turns=3)
    # turn 1: a weight push aborts it (v0 -> v1) before it reaches the call's `)`
    assert run_round(ep, res([20, 21], 0, "abort"), res([22, CLOSE], 1, "stop"))
    ep.add_tool_result([30, 31, 32])
    assert ep.turns == 2 and ep.turn_ids() == []
    # turn 2 ends at EOS (2)
    assert not run_round(ep, res([40, 2], 1, "stop"))
    s = ep.sample()
    assert s.output_ids == [20, 21, 22, CLOSE, 30, 31, 32, 40, 2]
    assert s.loss_mask == [1, 1, 1, 1, 0, 0, 0, 1, 1]
    assert s.versions == [0, 0, 1, 1, -1, -1, -1, 1, 1]
    assert s.logprobs == [-0.5] * 4 + [0.0] * 3 + [-0.5] * 2
    assert (s.n_turns, s.tool_calls, s.stop_reason, s.n_resubmits) == (2, 1, "stop", 1)
    assert s.min_version == 0 and s.staleness(3) == 3  # the oldest policy token counts


def test_a_stop_that_closes_no_call_continues_the_same_turn():
    ep = ToolEpisode([1], turn_tokens=10, total_tokens=40, max_turns=3)
    assert run_round(ep, res([20, CLOSE], 0, "stop"))  # the caller finds no call...
    assert not run_round(ep, res([21, 2], 0, "stop"))  # ...and the turn goes on
    s = ep.sample()
    assert s.output_ids == [20, CLOSE, 21, 2] and s.loss_mask == [1] * 4 and s.n_turns == 1


def test_turn_budget_is_per_turn_and_total_budget_caps_everything():
    ep = ToolEpisode([1], turn_tokens=4, total_tokens=9, max_turns=5)
    assert ep.start_round().max_new_tokens == 4
    ep.part.add(res([20, 21, 22, CLOSE], 0, "stop"))
    assert ep.end_round([CLOSE])
    ep.add_tool_result([30, 31])
    assert ep.start_round().max_new_tokens == 3  # 9 total - 6 used
    ep.part.add(res([40, 41, 42], 0, "length"))
    assert not ep.end_round([CLOSE])
    assert ep.done and ep.sample().stop_reason == "length" and ep.start_round() is None


@pytest.mark.parametrize("turns, total, reason", [(1, 40, "max_turns"), (3, 6, "length")])
def test_no_tool_result_without_a_turn_or_room_for_it(turns, total, reason):
    ep = ToolEpisode([1], turn_tokens=4, total_tokens=total, max_turns=turns)
    assert run_round(ep, res([20, CLOSE], 0, "stop"))
    ep.add_tool_result([30, 31, 32, 33])
    s = ep.sample()
    assert ep.done and s.stop_reason == reason and s.output_ids == [20, CLOSE]
    assert s.tool_calls == 0


@pytest.mark.parametrize("kwargs, needle", [
    ({"tools": "calculator"}, "list of tool names"), ({"tools": ["abacus"]}, "abacus"),
    ({"max_turns": 0}, "max_turns"), ({"max_total_tokens": 0}, "max_total_tokens"),
    ({"result_format": "{} {}"}, "result_format"), ({"call_end": ""}, "call_end"),
    ({"tool_timeout_s": 0}, "tool_timeout_s"), ({"tool_timeout_s": "5"}, "tool_timeout_s"),
    ({"tool_timeout_s": float("nan")}, "tool_timeout_s"), ({"tool_timeout_s": True}, "tool_timeout_s"),
])
def test_bad_workflow_kwargs_name_the_key(kwargs, needle):
    with pytest.raises(PluginError, match=needle):
        ToolWorkflow(EpisodeConfig(2, 8, 1.0), **kwargs)


def test_seeds_count_every_engine_call_of_the_sample():
    """Each call (first, resubmission, next round, next turn) gets the next seed."""
    seen = []
    ep = ToolEpisode([1], turn_tokens=10, total_tokens=40, max_turns=3,
                     seed=lambda call: 1000 + call)
    for results in ([res([20], 0, "abort"), res([21, CLOSE], 1, "stop")],  # calls 0, 1
                    [res([22, 2], 1, "stop")]):  # call 2
        part = ep.start_round()
        for r in results:
            part.next_call()
            seen.append(part.call_seed())
            part.add(r)
        ep.end_round([CLOSE])
    assert seen == [1000, 1001, 1002]
