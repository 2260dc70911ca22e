"""The OpenAI endpoint's guards without Ray: the bearer key (401 unless exact, OpenAI's
error body), body sizes refused by their declared length and, when that is missing or
wrong, before more than the cap is read; the store refusing new sessions rather than
evicting live ones, and one session's byte budget; the config keys' checks, the per-job
key reaching the workflow and never a config record."""

import asyncio
import json

import pytest

from areal_ray.config import ConfigError, load_config, to_dict
from areal_ray.observe.tracking import params_of
from areal_ray.rollout.openai.auth import EndpointError, RequestGuard, new_api_key
from areal_ray.rollout.openai.sessions import SessionsFull, SessionStore, SessionTooLarge
from areal_ray.rollout.workflows.agent import resolve_endpoint
from tests.rollout.openai.test_sessions import call, decode, encode

KEY = "k" * 20
GUARD = RequestGuard(KEY, max_request_bytes=100)


@pytest.mark.parametrize("header,ok", [
    (None, False), ("", False), (KEY, False), (f"Basic {KEY}", False), ("Bearer", False),
    (f"Bearer {KEY[:-1]}", False), (f"Bearer {KEY}x", False), (f"Bearer {KEY.upper()}", False),
    (f"Bearer {KEY}", True), (f"bearer {KEY}", True)])
def test_only_the_bearer_key_is_authorized(header, ok):
    if ok:
        GUARD.authorize(header)
        return
    with pytest.raises(EndpointError) as e:
        GUARD.authorize(header)
    body = e.value.body()["error"]
    assert e.value.status == 401 and body["type"] == "invalid_request_error"
    assert "rollout.openai.api_key" in body["message"] and KEY not in body["message"]


@pytest.mark.parametrize("length,status", [(None, None), ("0", None), ("100", None), ("101", 413),
                                           (str(10 ** 12), 413), ("-1", 400), ("ten", 400)])
def test_a_body_is_refused_by_its_declared_length(length, status):
    if status is None:
        GUARD.check_length(length)
        return
    with pytest.raises(EndpointError) as e:
        GUARD.check_length(length)
    assert e.value.status == status
    if status == 413:
        assert "rollout.openai.max_request_bytes" in e.value.message


@pytest.mark.parametrize("sizes,status,chunks_read", [
    ([], None, 0), ([100], None, 1), ([60, 40], None, 2), ([101, 5], 413, 1),
    ([60, 41, 1000, 1000], 413, 2)])
def test_a_body_read_stops_at_the_cap(sizes, status, chunks_read):
    read = []

    async def chunks():
        for n in sizes:
            read.append(n)
            yield b"x" * n

    if status is None:
        assert asyncio.run(GUARD.read(chunks())) == b"x" * sum(sizes)
    else:
        with pytest.raises(EndpointError) as e:
            asyncio.run(GUARD.read(chunks()))
        assert e.value.status == status
    assert len(read) == chunks_read  # nothing past the chunk that crossed the cap


def test_a_guard_needs_a_key_and_keys_are_fresh():
    with pytest.raises(ValueError, match="api_key"):
        RequestGuard("", 10)
    keys = {new_api_key() for _ in range(8)}
    assert len(keys) == 8 and all(len(k) >= 40 for k in keys)


def test_a_full_store_refuses_new_sessions_and_keeps_the_live_ones():
    now = [0.0]
    store = SessionStore(max_sessions=2, ttl_s=10.0, clock=lambda: now[0])
    a, b = store.open("a", encode, decode), store.open("b", encode, decode)
    with pytest.raises(SessionsFull, match="max_sessions"):
        store.open("c", encode, decode)
    assert store.open("a", encode, decode) is a and store.get("b") is b and store.dropped == 0
    now[0] = 8.0
    store.get("a")
    now[0] = 11.0  # b idle for 11 s: expired, so c has room; a (3 s) lives on
    assert store.open("c", encode, decode) is not None and store.get("b") is None
    assert store.get("a") is a and store.dropped == 1


def test_a_session_past_its_byte_budget_is_refused_alone():
    store = SessionStore(max_sessions=4, ttl_s=10.0, max_session_bytes=150)
    big, small = store.open("big", encode, decode), store.open("small", encode, decode)
    store.check_room(big, "abc", 2)
    call(big, "abc", [1, 2])  # "abc" is ids [9, 3]
    # the prompt text, the history text "abcab", 2 prompt ids, 2 output ids with their
    # logprobs and versions
    assert big.nbytes == 3 + 5 + 8 * (2 + 3 * 2) == 72
    with pytest.raises(SessionTooLarge, match="max_session_bytes"):
        store.check_room(big, "ab" * 10, 10)
    store.check_room(small, "ab" * 10, 10)  # 120 bytes: another session has room
    assert len(big.calls) == 1 and store.get("big") is big


@pytest.mark.parametrize("override,needle", [
    ("rollout.openai.api_key=short", "at least 16"),
    ("rollout.openai.api_key='has a space in it 123'", "without spaces"),
    ("rollout.openai.max_request_bytes=10", "max_request_bytes must be >= 1024"),
    ("rollout.openai.max_session_bytes=0", "max_session_bytes must be >= 1024"),
    ("rollout.openai.api_keys=x", "api_keys")])
def test_the_endpoint_keys_are_checked(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])


def test_the_run_makes_a_key_the_workflow_gets_and_no_record_holds():
    flow = ["rollout.workflow=areal_ray.rollout.workflows.agent.AgentWorkflow",
            "rollout.workflow_kwargs={agent: examples.calculator_agent.calculator_agent}",
            "rollout.openai.enabled=true"]
    cfg = load_config(None, flow)
    resolve_endpoint(cfg)
    key = cfg.rollout.openai.api_key
    assert len(key) >= 40 and cfg.rollout.workflow_kwargs["api_key"] == key
    other = load_config(None, flow)
    resolve_endpoint(other)
    assert other.rollout.openai.api_key != key  # per job
    record = json.dumps(to_dict(cfg)) + json.dumps(params_of(cfg))
    assert key not in record and "<redacted>" in record
    own = load_config(None, flow + [f"rollout.openai.api_key={KEY}"])  # a user's own is kept
    resolve_endpoint(own)
    assert own.rollout.openai.api_key == KEY == own.rollout.workflow_kwargs["api_key"]
    given = load_config(None, flow[:1] + [
        "rollout.workflow_kwargs={agent: examples.calculator_agent.calculator_agent, "
        f"api_key: {'m' * 16}}}", "rollout.openai.enabled=true"])
    resolve_endpoint(given)
    assert given.rollout.workflow_kwargs["api_key"] == "m" * 16
    off = load_config(None, [])
    resolve_endpoint(off)
    assert off.rollout.openai.api_key == "" and "<redacted>" not in json.dumps(to_dict(off))
