"""Interruptible rollout on the production tokenizer, hf and vLLM: weight pushes that
cut a generation inside a multi-byte character (its byte-fallback tokens) and inside a
word written in other pieces than SentencePiece would choose, and the sample's trained
ids equal to the uninterrupted generation's at the same seed, because the resubmission
is prompt + the ids generated so far, never a re-encoding of their text.

The model writes a script (tests/rollout/scripted_bpe.py): " interrupting" as four
non-canonical pieces, then 𝔸 and ꙮ as 4 + 3 byte tokens, over and over, with a margin
so large that neither a seed nor a recomputed KV cache can change a token, so the
uninterrupted ids are known and exactly comparable. Pushes carry unchanged weights
(a new version each: every cut shows in the versions). Each cut is classified, both
kinds must occur, and at each one a re-tokenizing resume is shown to differ: the test
fails if the client or an engine ever re-encodes the text."""

import asyncio
import functools
import time

import pytest

from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.rollout.interruptible import PartialSample, generate_rounds
from areal_ray.rollout.seeds import request_seed
from tests.rollout import scripted_bpe

SEED = 1234
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    return scripted_bpe.build(tmp_path_factory.mktemp("scripted_bpe"))


def cut_kind(tok, out: list[int], k: int) -> str:
    """What the cut before out[k] splits: "char" (the bytes of one character), "word"
    (two pieces of one word), or "boundary"."""
    if tok.decode(out[:k]).endswith(REPLACEMENT):
        return "char"
    left, right = tok.convert_ids_to_tokens([out[k - 1], out[k]])
    if left in scripted_bpe.WORD and right in scripted_bpe.WORD and not right.startswith("\u2581"):
        return "word"
    return "boundary"


def retokenized(tok, ids: list[int]) -> list[int]:
    """What a client that resumes from text would send: the decoded context, encoded."""
    return tok(tok.decode(ids, skip_special_tokens=False), add_special_tokens=False)["input_ids"]


def generate_batch(engine):
    async def call(ids_list, budgets, temperature, stop_ids=None, seeds=None):
        seeds = seeds or [None] * len(ids_list)
        reqs = [GenerationRequest(ids, b, temperature, ignore_eos=True, seed=s)
                for ids, b, s in zip(ids_list, budgets, seeds)]
        return [r.to_dict() for r in await asyncio.gather(*(engine.generate(r) for r in reqs))]
    return call


async def sample(engine, prompt, budget, pushes=None):
    """One sample of `prompt` through the client's rounds, seeded as a run seeds it;
    `pushes(task)` interrupts it meanwhile."""
    part = PartialSample(prompt, budget, functools.partial(request_seed, SEED, 0, 0))
    task = asyncio.ensure_future(generate_rounds(generate_batch(engine), [part], 1.0))
    if pushes:
        await pushes(task)
    await task
    return part.sample()


def timed_pushes(engine, state, gap_s: float):
    """Push `state` (unchanged weights, the next version) every `gap_s` while `task`
    runs, with gaps that vary so the cuts fall at every offset of the script."""
    async def pushes(task):
        i = 0
        while not task.done():
            await asyncio.sleep(gap_s * (0.6 + 0.15 * (i % 7)))
            if not task.done():
                await engine.update_weights(state, engine.get_version() + 1)
            i += 1
    return pushes


def check_interrupted(tok, prompt, ref, got, kinds: dict):
    """`got` (interrupted) has exactly the ids and logprobs of `ref`; its cuts, by kind,
    go into `kinds`; each cut is one a re-tokenizing resume would have corrupted."""
    assert got.output_ids == ref.output_ids
    assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert got.n_resubmits >= 1
    cuts = [k for k in range(1, len(got.versions)) if got.versions[k] != got.versions[k - 1]]
    assert 1 <= len(cuts) <= got.n_resubmits  # a call aborted before its first token cuts nothing
    for k in cuts:
        kinds.setdefault(cut_kind(tok, got.output_ids, k), []).append(k)
        context = prompt + got.output_ids[:k]
        assert retokenized(tok, context) != context, (k, tok.convert_ids_to_tokens(context[-4:]))


def run_interruptions(tok, prompt, ref, attempt):
    """Interrupted samples until both a mid-character and a mid-word cut were seen (each
    attempt checked on its own); returns the cuts by kind."""
    kinds: dict[str, list[int]] = {}
    for _ in range(4):
        check_interrupted(tok, prompt, ref, attempt(), kinds)
        if "char" in kinds and "word" in kinds:
            break
    assert "char" in kinds and "word" in kinds, kinds
    return kinds


def check_reference(tok, prompt, ref, script, budget):
    assert ref.output_ids == (script * budget)[:budget] and ref.stop_reason == "length"
    assert REPLACEMENT not in tok.decode(ref.output_ids)


async def retokenizing_resume(engine, tok, prompt, ref, k):
    """The failure this file guards against, done on purpose: the cut's context decoded,
    re-encoded, and generated on from there."""
    context = retokenized(tok, prompt + ref.output_ids[:k])
    rest = await engine.generate(GenerationRequest(context, len(ref.output_ids) - k, 1.0,
                                                   ignore_eos=True, seed=SEED))
    return context[len(prompt):] + rest.output_ids


# ----------------------------------------------------------------- hf
BUDGET_HF = 11 * 30


def test_hf_interrupted_ids_equal_uninterrupted_ids_mid_character_and_mid_word(scripted):
    path, prompt, script = scripted
    engine = HFEngine(path, batching="invariant")
    tok = engine.tokenizer
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    t0 = time.perf_counter()
    ref = asyncio.run(sample(engine, prompt, BUDGET_HF))
    per_token = (time.perf_counter() - t0) / BUDGET_HF
    check_reference(tok, prompt, ref, script, BUDGET_HF)
    assert ref.n_resubmits == 0 and set(ref.versions) == {0}

    kinds = run_interruptions(tok, prompt, ref, lambda: asyncio.run(
        sample(engine, prompt, BUDGET_HF, timed_pushes(engine, state, 7 * per_token))))
    k = kinds["char"][0]
    wrong = asyncio.run(retokenizing_resume(engine, tok, prompt, ref, k))
    assert wrong != ref.output_ids and REPLACEMENT in tok.decode(wrong)  # the character is lost
    engine.shutdown()


# ----------------------------------------------------------------- vLLM
BUDGET_VLLM = 11 * 80
_LOOP = asyncio.new_event_loop()  # AsyncLLM binds to the loop of its first generate


@pytest.fixture(scope="module")
def vllm_engine(scripted):
    pytest.importorskip("vllm")
    from areal_ray.rollout.engines.vllm import VLLMEngine
    eng = VLLMEngine(scripted[0], max_batch_size=4, kv_cache_mb=64)
    yield eng
    eng.shutdown()


def test_vllm_interrupted_ids_equal_uninterrupted_ids_mid_character_and_mid_word(scripted, vllm_engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path, prompt, script = scripted
    tok = AutoTokenizer.from_pretrained(path)
    state = AutoModelForCausalLM.from_pretrained(path).state_dict()
    engine, run = vllm_engine, _LOOP.run_until_complete
    t0 = time.perf_counter()
    ref = run(sample(engine, prompt, BUDGET_VLLM))
    per_token = (time.perf_counter() - t0) / BUDGET_VLLM
    check_reference(tok, prompt, ref, script, BUDGET_VLLM)

    kinds = run_interruptions(tok, prompt, ref, lambda: run(
        sample(engine, prompt, BUDGET_VLLM, timed_pushes(engine, state, 40 * per_token))))
    wrong = run(retokenizing_resume(engine, tok, prompt, ref, kinds["word"][0]))
    assert wrong != ref.output_ids
