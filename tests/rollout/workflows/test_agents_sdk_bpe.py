"""The OpenAI Agents SDK agent (examples/agents_sdk_agent.py) on the production tokenizer
(Mistral's SentencePiece, ChatML, the template that renders tools' schemas and hermes
calls: artifacts/tiny-bpe-agents'), against the endpoint's service with a scripted
engine that answers with the warm start's own token ids: the SDK sends the calculator
as tiny_model.SDK_CALC_TOOL, vLLM's hermes parser reads the call the model writes
(`<tool_call>` five tokens), the SDK's replayed `tool_calls` and its `tool` message
extend the recorded ids, and the session's one trajectory is token for token, mask
for mask, the warm start's training example (tiny_model.ChatHermesCalls). The text
after the model's end of turn (`\\n<|im_start|>user\\n<tool_response>...`) is encoded as
the whole conversation encodes it: SentencePiece writes no word-start `▁` there
(service.encode_rest). Learning through a real Serve app: tests/jobs/test_tools.py."""

import asyncio

import pytest

from areal_ray.rollout.openai.tool_calls import ToolCallParser
from areal_ray.task import tiny_model, tool_arith
from areal_ray.task.bpe_tokenizer import build_bpe_tokenizer
from tests.rollout.openai.test_tool_calls import ScriptedApp
from tests.rollout.workflows.test_agents_sdk import sdk_client

agents = pytest.importorskip("agents")


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer()


class IdsApp(ScriptedApp):
    """Answers each generate call with the next scripted list of token ids."""

    async def _generate_batch(self, requests):
        out = self.outputs.pop(0)
        return [{"output_ids": out, "logprobs": [-0.5] * len(out), "versions": [7] * len(out),
                 "stop_reason": "stop"} for _ in requests]


def ids_service(tok, outputs):
    from areal_ray.rollout.engine_client import EngineClient
    from areal_ray.rollout.openai.protocol import Defaults
    from areal_ray.rollout.openai.service import OpenAIService
    from areal_ray.rollout.openai.sessions import SessionStore
    return OpenAIService(tok, EngineClient(IdsApp(tok, outputs)), Defaults(200, 1.0),
                         SessionStore(16, 600), model_name="tiny", tool_parser=ToolCallParser("hermes", tok))


def model_turns(ids: list[int], labels: list[int], n_prompt: int) -> list[list[int]]:
    """The runs of trained ids after the prompt: what the model wrote, turn by turn."""
    turns, cur = [], []
    for i, lab in zip(ids[n_prompt:], labels[n_prompt:]):
        if lab != -100:
            cur.append(i)
        elif cur:
            turns, cur = turns + [cur], []
    return turns + [cur] if cur else turns


@pytest.mark.parametrize("use_tool", [True, False])
def test_the_sdk_episode_on_the_production_tokenizer_is_the_warm_starts_example(bpe, use_tool):
    from areal_ray.reward.math import math_reward
    from examples.agents_sdk_agent import agents_sdk_agent
    p = tool_arith.ToolProblem(4821, "+", 3907)
    fmt = tiny_model.ChatHermesCalls(bpe)
    example = tool_arith.Example(fmt.prompt(p.prompt), fmt.segments(p, use_tool))
    ids, _, labels = tiny_model.encode_sft(bpe, [example])
    want, labels = ids[0].tolist(), labels[0].tolist()
    n_prompt = len(bpe(example.prompt, add_special_tokens=False)["input_ids"])
    turns = model_turns(want, labels, n_prompt)
    assert len(turns) == 1 + use_tool and all(t[-1] == bpe.eos_token_id for t in turns)
    if use_tool:  # the tag is several tokens, as the model writes it
        assert bpe.convert_ids_to_tokens(turns[0][:5]) == ["<", "tool", "_", "call", ">"]

    svc = ids_service(bpe, turns)
    bodies = []
    answer = asyncio.run(agents_sdk_agent(sdk_client(svc, bodies), {"prompt": p.prompt}))
    assert answer == "\\boxed{8728}" and math_reward(answer, p.answer) == 1.0
    assert bodies[0]["tools"] == [tiny_model.SDK_CALC_TOOL]  # what the warm start's prompt shows
    assert len(bodies) == 1 + use_tool
    if use_tool:  # the parsed call ran: the SDK sent the calculator's result back
        assert bodies[1]["messages"][-1] == {"role": "tool", "content": "8728",
                                             "tool_call_id": bodies[1]["messages"][1]["tool_calls"][0]["id"]}
    (sample,) = svc.session("s")["samples"]
    assert sample["prompt_ids"] + sample["output_ids"] == want
    assert sample["loss_mask"] == [int(lab != -100) for lab in labels[n_prompt:]]
    assert sample["tool_calls"] == int(use_tool)


def test_a_tool_result_continues_the_ids_as_the_whole_text_encodes_it(bpe):
    from areal_ray.rollout.engine_client import EngineClient
    from areal_ray.rollout.openai.protocol import Defaults
    from areal_ray.rollout.openai.service import OpenAIService
    from areal_ray.rollout.openai.sessions import SessionStore
    svc = OpenAIService(bpe, EngineClient(IdsApp(bpe, [])), Defaults(200, 1.0), SessionStore(16, 600),
                        model_name="tiny")
    rest = "\n<|im_start|>user\n<tool_response>\n8728\n</tool_response><|im_end|>\n"
    whole = bpe("x<|im_end|>" + rest, add_special_tokens=False)["input_ids"]
    assert bpe.convert_ids_to_tokens(svc.encode(rest)[:2]) == ["\u2581", "<0x0A>"]  # alone: a word start
    assert svc.encode_rest(rest) == whole[whole.index(bpe.eos_token_id) + 1:]
    assert svc.encode_rest("") == []


def test_the_warm_starts_head_on_labels_loss_is_the_causal_lm_loss(bpe):
    import torch
    from transformers import LlamaForCausalLM
    spec = tiny_model.BpeAgentModelSpec(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_model.llama_config(spec, bpe))
    fmt = tiny_model.ChatHermesCalls(bpe)
    batch = [tool_arith.Example(fmt.prompt(p.prompt), fmt.segments(p, use_tool=i % 2 == 0))
             for i, p in enumerate(tool_arith.make_split(0, 3))]
    ids, att, labels = tiny_model.encode_sft(bpe, batch)  # right-padded
    assert att.sum(1).unique().numel() > 1  # padding
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=att, labels=labels).loss
        assert torch.allclose(tiny_model.label_loss(model, ids, att, labels), want, atol=1e-5)
