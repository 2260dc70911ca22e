import random

import pytest

from areal_ray.reward.math import math_reward
from areal_ray.task import tool_arith
from areal_ray.task.tokenizer import build_char_tokenizer
from areal_ray.task.tool_arith import RESULT_FORMAT, ToolProblem, examples, make_split, render, segments


def test_problems_are_reproducible_from_the_seed_and_answers_are_right():
    split = make_split(seed=3, n=500)
    assert split == make_split(seed=3, n=500)
    assert split != make_split(seed=4, n=500)
    for p in split:
        assert 100 <= p.a <= 9999 and 100 <= p.b <= 9999 and p.op in "+-"
        assert p.prompt == f"{p.a}{p.op}{p.b}="
        assert int(p.answer) == eval(p.expr) >= 0  # noqa: S307 - digits and +/- only
    assert {p.op for p in split} == {"+", "-"}
    # mostly 4-digit operands: a direct answer has to get 4-5 digits right
    assert sum(p.a >= 1000 and p.b >= 1000 for p in split) > 0.8 * len(split)


def test_rows_are_math_rows():
    row = ToolProblem(4821, "+", 3907).to_row("u")
    assert row == {"uid": "u", "prompt": "4821+3907=", "answer": "8728", "verifier": "math",
                   "op": "+"}


def test_the_two_solutions_render_to_the_workflow_format():
    p = ToolProblem(4821, "+", 3907)
    text, mask = render(segments(p, use_tool=True))
    assert text == "calc(4821+3907)=8728\n\\boxed{8728}"
    # the tool's result `=8728\n` is the only span the model did not write
    assert "".join(c for c, m in zip(text, mask) if not m) == RESULT_FORMAT.format("8728")
    assert text[: mask.index(0)] == "calc(4821+3907)" and text[mask.index(0) - 1] == ")"
    assert len(mask) == len(text) and all(mask[len("calc(4821+3907)=8728\n"):])
    direct, dmask = render(segments(p, use_tool=False))
    assert direct == "\\boxed{8728}" and all(dmask)
    assert math_reward(text, p.answer) == math_reward(direct, p.answer) == 1.0
    q = ToolProblem(1203, "-", 998)
    assert render(segments(q, True))[0] == "calc(1203-998)=205\n\\boxed{205}"


def test_the_char_tokenizer_keeps_the_mask_token_for_token():
    """Encoding the text equals encoding its pieces: the label mask is per token, and
    `)` (the call's end, where generation stops) is one token."""
    tok = build_char_tokenizer()
    parts = segments(ToolProblem(4821, "-", 3907), use_tool=True)
    text, mask = render(parts)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [i for t, _ in parts for i in tok(t, add_special_tokens=False)["input_ids"]]
    assert len(ids) == len(mask) and tok.unk_token_id not in ids
    assert len(tok(")", add_special_tokens=False)["input_ids"]) == 1


def test_warm_start_examples_mix_the_two_kinds():
    exs = examples(random.Random(0), 400, p_direct=0.75)
    tool = sum(len(e.segments) == 3 for e in exs)
    assert 60 < tool < 140
    assert examples(random.Random(0), 5, 0.5) == examples(random.Random(0), 5, 0.5)
    assert all(len(e.segments) == 1 for e in examples(random.Random(1), 20, p_direct=1.0))


def test_encode_sft_masks_the_tool_result_in_the_labels():
    torch = pytest.importorskip("torch")
    from areal_ray.task.tiny_model import encode_sft

    tok = build_char_tokenizer()
    ex = tool_arith.Example("12+3=", segments(ToolProblem(12, "+", 3), use_tool=True))
    ids, att, labels = encode_sft(tok, [ex, tool_arith.Example("1+1=", (("\\boxed{2}", True),))])
    trained = tok.decode([int(i) for i, lab in zip(ids[0], labels[0]) if lab != -100])
    assert trained == "calc(12+3)\\boxed{15}" + tok.eos_token
    assert int(att[1].sum()) == len("1+1=\\boxed{2}") + 1
    assert torch.equal(labels[1][labels[1] != -100][:-1],
                       torch.tensor(tok("\\boxed{2}", add_special_tokens=False)["input_ids"]))


def test_the_workflows_calculator_answers_every_call_of_the_task():
    from areal_ray.rollout.workflows.tools import ToolCall, calculate, find_call

    for p in make_split(seed=5, n=200):
        text = render(segments(p, use_tool=True))[0]
        call = find_call(text[: text.index(")") + 1], (tool_arith.TOOL,))
        assert call == ToolCall("calc", p.expr) and calculate(call.arguments) == p.answer


class _ScriptedModel:
    """Stands in for an HF model: answers each turn from a script keyed by the text so far."""

    def __init__(self, tok, script):
        self.tok, self.script, self.seen = tok, script, []

    def eval(self):
        return self

    def generate(self, input_ids, attention_mask, eos_token_id, pad_token_id, **_):
        import torch
        rows = []
        for ids, att in zip(input_ids.tolist(), attention_mask.tolist()):
            text = self.tok.decode([i for i, a in zip(ids, att) if a])
            self.seen.append(text)
            rows.append(ids + self.tok(self.script[text], add_special_tokens=False)["input_ids"])
        width = max(len(r) for r in rows)
        return torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])


def test_multi_turn_greedy_loop_runs_the_tool_like_the_workflow():
    pytest.importorskip("torch")
    tok = build_char_tokenizer()
    eos = tok.eos_token
    model = _ScriptedModel(tok, {
        "4821+3907=": "calc(4821+3907)",
        "4821+3907=calc(4821+3907)=8728\n": "\\boxed{8728}" + eos,
        "12+3=": "\\boxed{14}" + eos,
    })
    outs = tool_arith.generate_with_tool(model, tok, ["4821+3907=", "12+3="])
    assert outs == ["calc(4821+3907)=8728\n\\boxed{8728}", "\\boxed{14}"]
    assert [tool_arith.uses_tool(o) for o in outs] == [True, False]


@pytest.fixture(scope="module")
def hermes_calls():
    return tool_arith.HermesCalls(build_char_tokenizer("hermes"))


def test_the_hermes_solution_is_a_call_the_endpoints_parser_reads(hermes_calls):
    """The warm start's call is what vLLM's hermes parser (the endpoint's) turns into a
    `calc` call with the sum; then EOS (the model ends its turn), the template's
    rendering of the tool's result (not the model's: mask 0), the box."""
    import json

    fmt, p = hermes_calls, ToolProblem(4821, "+", 3907)
    parts = fmt.segments(p, use_tool=True)
    text, mask = render(parts)
    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "4821+3907"}}\n</tool_call>'
    assert text == call + "</s><tool_response>\n8728\n</tool_response>\n\\boxed{8728}"
    assert [mine for _, mine in parts] == [True, False, True]
    assert fmt.prompt(p.prompt) == "<tools>calc</tools>\n4821+3907="
    (got,) = fmt.parser.parse(call, fmt.parser.request([tool_arith.TOOL_SPEC], "auto"), 0, []).tool_calls
    assert got["function"]["name"] == "calc" and json.loads(got["function"]["arguments"]) == {"expr": p.expr}
    assert render(fmt.segments(p, use_tool=False)) == ("\\boxed{8728}", [1] * 12)
    assert tool_arith.calc(p.expr) == p.answer


def test_the_hermes_turn_loop_runs_the_parsed_call_like_the_agent(hermes_calls):
    pytest.importorskip("torch")
    fmt = hermes_calls
    tok, eos = fmt.tok, fmt.tok.eos_token
    prompt = fmt.prompt("4821+3907=")
    call = fmt.call_text("4821+3907")
    after = prompt + call + eos + "<tool_response>\n8728\n</tool_response>\n"
    model = _ScriptedModel(tok, {
        prompt: call + eos,
        after: "\\boxed{8728}" + eos,
        fmt.prompt("12+3="): '<tool_call>\n{"name": "sum", "arguments": {}}\n</tool_call>' + eos,
        fmt.prompt("12+3=") + '<tool_call>\n{"name": "sum", "arguments": {}}\n</tool_call>' + eos
        + "<tool_response>\nerror: not a calc(expr) call\n</tool_response>\n": "\\boxed{15}" + eos,
        fmt.prompt("1+1="): "<tool_call>{broken" + eos,
    })
    outs = tool_arith.generate_with_tool(model, tok, [fmt.prompt(q) for q in ("4821+3907=", "12+3=", "1+1=")],
                                         fmt=fmt, max_turns=2)
    assert outs[0] == after[len(prompt):] + "\\boxed{8728}"
    assert outs[1].endswith("<tool_response>\nerror: not a calc(expr) call\n</tool_response>\n\\boxed{15}")
    assert outs[2] == "<tool_call>{broken"  # no call parsed: the answer as it is
    assert [tool_arith.uses_tool(o, fmt) for o in outs] == [True, True, True]
