"""Session recording without Ray: prompt ids continue the recorded ids (never a
re-encoding of the history), chains merge into one Sample with the right loss mask,
logprobs and versions, and calls that do not chain start another Sample."""

import pytest

from areal_ray.rollout.openai.sessions import Session, SessionStore, chain_sample
from areal_ray.types import Sample

# A toy tokenizer whose re-encoding differs from what the model sampled: "ab" encodes
# to one token (9), but the model may sample "a" (1) then "b" (2).
VOCAB = {"ab": 9, "a": 1, "b": 2, "c": 3, "|": 4, "<eos>": 0}
TEXT = {v: k for k, v in VOCAB.items()}


def encode(text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
        if text.startswith("<eos>", i):
            ids.append(0)
            i += 5
        elif text.startswith("ab", i):
            ids.append(9)
            i += 2
        else:
            ids.append(VOCAB[text[i]])
            i += 1
    return ids


def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
    return "".join(TEXT[i] for i in ids if not (skip_special_tokens and i == 0))


def out(ids, version=0, reason="stop"):
    return Sample(prompt_ids=[], output_ids=list(ids), logprobs=[-0.5] * len(ids),
                  versions=[version] * len(ids), stop_reason=reason)


def call(session, text, ids, version=0, reason="stop"):
    prompt, extends = session.prompt_ids(text)
    session.record(text, prompt, extends, out(ids, version, reason))
    return prompt, extends


def test_a_continued_prompt_reuses_the_sampled_ids_exactly():
    s = Session("s", encode, decode)
    p0, e0 = call(s, "c", [1, 2])  # the model wrote "ab" as two tokens
    assert (p0, e0) == ([3], None)
    # the agent's next prompt: the history "cab" + a tool result "|ab"
    p1, e1 = call(s, "cab|ab", [3], version=1)
    assert e1 == 0
    assert p1 == [3, 1, 2, 4, 9]  # re-encoding "cab|ab" would give [3, 9, 4, 9]
    assert encode("cab|ab") != p1
    p2, e2 = call(s, "cab|abc|", [1, 0], version=2)
    assert (p2, e2) == (p1 + [3, 4], 1)

    (sample,) = s.samples()
    assert sample.prompt_ids == [3]
    assert sample.output_ids == [1, 2, 4, 9, 3, 4, 1, 0]
    assert sample.loss_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    assert sample.versions == [0, 0, -1, -1, 1, -1, 2, 2]
    assert sample.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, 0.0, -0.5, -0.5]
    assert (sample.n_turns, sample.tool_calls, sample.stop_reason) == (3, 2, "stop")
    assert sample.text == "ab|abc|a"
    assert sample.min_version == 0


def test_a_prompt_that_rewrites_the_history_starts_another_sample():
    s = Session("s", encode, decode)
    call(s, "c", [1, 2])
    p1, e1 = call(s, "cb|", [3], version=1)  # "cb" does not start with "cab"
    assert (p1, e1) == ([3, 2, 4], None)
    call(s, "cb|c|", [2])  # extends the second call
    first, second = s.samples()
    assert first.output_ids == [1, 2] and first.n_turns == 1 and first.loss_mask == [1, 1]
    assert second.prompt_ids == [3, 2, 4] and second.output_ids == [3, 4, 2]
    assert second.loss_mask == [1, 0, 1] and second.n_turns == 2
    assert [c["extends"] for c in s.to_dict()["calls"]] == [None, None, 1]


def test_an_output_ending_in_eos_chains_with_or_without_the_eos_text():
    s = Session("s", encode, decode)
    call(s, "c", [1, 0])  # "a" then EOS; the client got "a"
    p1, e1 = call(s, "ca|", [2])  # a template that drops the EOS text
    assert (p1, e1) == ([3, 1, 0, 4], 0)  # the sampled EOS stays in the chain
    p2, e2 = call(s, "ca|b<eos>|", [3])  # one that writes it (as Qwen's end-of-turn)
    assert (p2, e2) == (p1 + [2, 0, 4], 1)
    assert len(s.samples()) == 1


def test_a_call_that_finished_in_between_breaks_the_chain():
    s = Session("s", encode, decode)
    call(s, "c", [1])
    p_late, e_late = s.prompt_ids("ca|")  # starts while the last call is call 0 ...
    call(s, "ca|", [2])  # ... but another request finished first
    s.record("ca|", p_late, e_late, out([3]))
    assert [len(x) for x in s.chains()] == [2, 1]


def test_n_choices_fork_the_session_and_the_next_request_continues_the_one_it_carries():
    """A request with 2 choices after one call: each choice is its own Sample (its
    prompt holds the first call's ids), the next request extends the choice its text
    starts with, and the chain holding the last call is the last Sample."""
    s = Session("s", encode, decode)
    call(s, "c", [1])  # call 0: "c" -> "a"
    p, e = s.prompt_ids("ca|")
    assert (p, e) == ([3, 1, 4], 0)
    s.record_turn("ca|", p, e, [out([1]), out([2])])  # calls 1 ("a") and 2 ("b")
    assert [c.extends for c in s.calls] == [None, None, None] and s.last_turn == [1, 2]
    p3, e3 = s.prompt_ids("ca|a|")  # continues choice 1 ...
    assert (p3, e3) == ([3, 1, 4, 1, 4], 1)
    assert s.prompt_ids("ca|b|") == ([3, 1, 4, 2, 4], 2)  # ... or would continue choice 2
    s.record("ca|a|", p3, e3, out([3]))
    chains = s.chains()
    assert [[s.calls.index(c) for c in chain] for chain in chains] == [[0], [2], [1, 3]]
    samples = s.samples()
    assert samples[-1].prompt_ids == [3, 1, 4] and samples[-1].output_ids == [1, 4, 3]
    assert samples[-1].loss_mask == [1, 0, 1] and samples[1].output_ids == [2]


def test_token_prompts_chain_on_ids():
    s = Session("s", encode, decode)
    p0, _ = s.prompt_ids_of_tokens([3])
    s.record("c", p0, None, out([1, 2]))
    assert s.prompt_ids_of_tokens([3, 1, 2, 4]) == ([3, 1, 2, 4], 0)
    assert s.prompt_ids_of_tokens([3, 9, 4]) == ([3, 9, 4], None)


def test_a_single_call_is_one_sample_of_policy_tokens():
    s = Session("s", encode, decode)
    call(s, "c", [1, 2], reason="length")
    sample = chain_sample(s.calls)
    assert sample.loss_mask == [1, 1] and sample.stop_reason == "length"
    assert (sample.n_turns, sample.tool_calls) == (1, 0)


def test_the_store_drops_idle_sessions():
    """(A full store refuses new sessions instead of evicting: test_endpoint_auth.py.)"""
    now = [0.0]
    store = SessionStore(max_sessions=3, ttl_s=10.0, clock=lambda: now[0])
    a = store.open("a", encode, decode)
    store.open("b", encode, decode)
    assert store.open("a", encode, decode) is a  # touched: b is now the oldest
    store.open("c", encode, decode)
    assert store.get("b") is not None and store.get("a") is a and len(store) == 3
    now[0] = 5.0
    store.get("c")
    now[0] = 12.0  # a and b idle for 12 s, c for 7 s
    assert store.get("a") is None and store.get("b") is None and store.get("c") is not None
    assert store.pop("c") is not None and store.pop("c") is None and store.dropped == 2
    with pytest.raises(ValueError):
        SessionStore(max_sessions=0, ttl_s=1.0)
    with pytest.raises(ValueError):
        SessionStore(max_sessions=1, ttl_s=1.0, max_session_bytes=0)
