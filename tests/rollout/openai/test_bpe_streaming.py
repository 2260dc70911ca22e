"""The OpenAI endpoint on the production tokenizer (SentencePiece with byte fallback), on a
real engine in this process: stop strings that span several tokens and arrive split
otherwise than `encode(stop)` splits them, one-token stops written mid-text, streamed
chunks around characters made of several byte tokens, and a weight push in the middle
of a streamed call. The model writes a known script (tests/rollout/scripted_bpe.py):
" interrupting" in four pieces SentencePiece would not choose, then 𝔸 (4 byte tokens)
and ꙮ (3), over and over."""

import asyncio
import uuid

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from areal_ray.rollout.engine_client import EngineClient
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.rollout.openai.protocol import Defaults, encode_inside, stops
from areal_ray.rollout.openai.service import OpenAIService
from areal_ray.rollout.openai.sessions import SessionStore
from areal_ray.rollout.openai.sse import cut, token_texts
from tests.rollout import scripted_bpe
from tests.rollout.openai.test_sse import assemble_chat
from tests.rollout.workflows.test_base import InProcessApp

REPLACEMENT = "\ufffd"
CYCLE = "interrupting\U0001d538\ua66e"  # the script's text at the output's start
CHAT = [{"role": "user", "content": "Say it."}]  # renders to scripted_bpe.PROMPT


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path, prompt, script = scripted_bpe.build(tmp_path_factory.mktemp("scripted_bpe"))
    return HFEngine(path, batching="invariant"), prompt, script


def service(engine):
    return OpenAIService(engine.tokenizer, EngineClient(InProcessApp(engine)),
                         Defaults(max_tokens=64, temperature=1.0), SessionStore(64, 600), "tiny",
                         limits=engine.limits)


def complete(svc, **body):
    sid = uuid.uuid4().hex
    resp = asyncio.run(svc.completions(sid, {"model": "m", "prompt": scripted_bpe.PROMPT,
                                             "return_token_ids": True, **body}))
    return resp, sid


def cycles(script, n):
    return (script * (n // len(script) + 1))[:n]


# ----------------------------------------------------------------- pure pieces
def test_token_texts_give_whole_characters_and_keep_word_spaces(scripted):
    engine, _, script = scripted
    texts = token_texts(script * 2, engine.tokenizer.decode)
    assert texts == ["in", "ter", "rup", "ting", "", "", "", "\U0001d538", "", "", "\ua66e",
                     " in", "ter", "rup", "ting", "", "", "", "\U0001d538", "", "", "\ua66e"]
    alone = [engine.tokenizer.decode([t]) for t in script]  # what each token decodes to by itself
    assert alone[:5] == ["in", "ter", "rup", "ting", REPLACEMENT]
    # a decoder whose text does not extend as ids are added: each token alone
    assert token_texts([1, 2], lambda ids: "".join(map(str, reversed(ids)))) == ["1", "2"]


def test_cut_puts_held_tokens_in_the_segment_that_completes_them():
    assert cut("\u00e9!", ["", "\u00e9", "!"]) == ([("\u00e9", 0, 2), ("!", 2, 3)], 3)
    assert cut("ab", ["a", "", "b", ""]) == ([("a", 0, 1), ("b", 1, 3)], 3)


def test_a_stop_is_encoded_as_the_model_writes_it_after_other_text(scripted):
    engine, _, script = scripted
    svc = service(engine)
    assert svc.encode("ter") != [script[1]] and encode_inside("ter", svc.encode) == [script[1]]
    assert encode_inside("\ua66e", svc.encode) == script[8:11]  # no word-start token in front


# ----------------------------------------------------------------- stops
def test_a_one_token_stop_ends_the_output_where_the_model_writes_it_mid_text(scripted):
    """"ter" alone encodes to "▁ter" (a word's start); mid-text the model writes "ter"."""
    engine, _, script = scripted
    svc = service(engine)
    ids, strings, _ = stops(["ter"], svc.encode)
    assert script[1] in ids and strings == []
    resp, sid = complete(svc, stop=["ter"])
    (choice,) = resp["choices"]
    assert (choice["text"], choice["finish_reason"], choice["token_ids"]) == ("inter", "stop", script[:2])
    assert svc.session(sid)["calls"][0]["output_ids"] == script[:2]


@pytest.mark.parametrize("stop,text", [
    ("rupting\U0001d538", "interrupting\U0001d538"),  # encode(stop): ▁ru pt ing + 4 bytes
    ("pting", "interrupting"),  # starts inside "rup"; encode(stop): ▁p ting
    ("\U0001d538\ua66e", CYCLE),  # two characters, seven byte tokens
    ("\ua66e", CYCLE),
    (" inter", CYCLE + " inter"),  # a word's start: not at the output's start (no space there)
    ("interr", "interrup"),  # ends inside "rup": the output keeps whole tokens
])
def test_a_stop_string_across_tokens_cuts_after_the_token_that_completes_it(scripted, stop, text):
    engine, _, script = scripted
    svc = service(engine)
    resp, sid = complete(svc, stop=[stop], max_tokens=60)
    (choice,) = resp["choices"]
    Completion.model_validate(resp)
    assert choice["finish_reason"] == "stop" and choice["text"] == text
    ids = choice["token_ids"]
    assert ids == cycles(script, len(ids))
    assert engine.tokenizer.decode(ids) == text and stop in text and stop not in engine.tokenizer.decode(ids[:-1])
    (call,) = svc.session(sid)["calls"]
    assert call["output_ids"] == ids and len(call["logprobs"]) == len(ids)


# ----------------------------------------------------------------- streaming
def completion_deltas(chunks):
    return [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]


@pytest.mark.parametrize("max_tokens", [22, 17])
def test_streamed_completion_chunks_never_split_a_character(scripted, max_tokens):
    """One chunk per token that completes text: the four byte tokens of 𝔸 in one chunk
    with their four logprob entries. 17 tokens end inside 𝔸: the answer ends with the
    decoder's U+FFFD for its unfinished bytes, in the last chunk and only there."""
    engine, _, script = scripted
    svc = service(engine)
    whole, _ = complete(svc, max_tokens=max_tokens, seed=5, logprobs=0)
    stream, _ = complete(svc, max_tokens=max_tokens, seed=5, logprobs=0, stream=True)
    deltas = completion_deltas(stream.chunks)
    assert "".join(deltas) == whole["choices"][0]["text"]
    assert stream.chunks[-1]["choices"][0]["token_ids"] == whole["choices"][0]["token_ids"] == cycles(script, max_tokens)
    if max_tokens == 22:
        assert deltas == ["in", "ter", "rup", "ting", "\U0001d538", "\ua66e"] + \
            [" in", "ter", "rup", "ting", "\U0001d538", "\ua66e"]
        assert all(REPLACEMENT not in d for d in deltas)
        char = next(c for c in stream.chunks if c["choices"][0]["text"] == "\U0001d538")
        assert len(char["choices"][0]["logprobs"]["token_logprobs"]) == 4
    else:
        assert deltas[:-1] == ["in", "ter", "rup", "ting", "\U0001d538", "\ua66e", " in", "ter", "rup", "ting"]
        assert all(REPLACEMENT not in d for d in deltas[:-1]) and deltas[-1].startswith(REPLACEMENT)
    entries = [t for c in stream.chunks for t in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert entries == whole["choices"][0]["logprobs"]["token_logprobs"]


def test_a_weight_push_mid_stream_keeps_the_ids_and_the_chunks_whole(scripted):
    """A chat call, streamed, cut by a push of unchanged weights while it generates: the
    same ids as the uninterrupted call at the same seed, versions that step at the cut,
    and chunks that assemble to the uninterrupted message with no half character."""
    engine, _, script = scripted
    svc = service(engine)
    body = {"model": "m", "messages": CHAT, "max_tokens": 330, "seed": 9, "return_token_ids": True}
    whole = asyncio.run(svc.chat(uuid.uuid4().hex, body))
    ChatCompletion.model_validate(whole)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}

    async def pushed():
        call = asyncio.ensure_future(svc.chat(uuid.uuid4().hex, {**body, "stream": True}))
        start = engine.load()["tokens"]
        for target in (6, 50, 129):  # inside 𝔸, inside the word, inside ꙮ (if the push lands at once)
            while engine.load()["tokens"] < start + target and not call.done():
                await asyncio.sleep(0.001)
            await engine.update_weights(state, engine.get_version() + 1)
        return await call

    stream = asyncio.run(pushed())
    message, finish, _, _ = assemble_chat(stream.chunks)
    last = stream.chunks[-1]["choices"][0]
    assert last["token_ids"] == whole["choices"][0]["token_ids"] == cycles(script, 330)
    versions = last["versions"]
    assert len({v for v in versions}) >= 2  # cut at least once
    assert message["content"] == whole["choices"][0]["message"]["content"] and finish == "length"
    deltas = [c["choices"][0]["delta"].get("content") for c in stream.chunks if c["choices"]]
    assert all(REPLACEMENT not in d for d in deltas if d)
