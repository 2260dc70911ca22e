"""Session affinity without Ray: the shard of a session id is fixed, the registry refuses
a session its restarted replica lost, and the deployment's handler (two shards in this
process, the second behind a stand-in for its Serve handle) sends every call of a
session to one shard and answers 410 after that shard restarts. With Serve and 2 real
endpoint replicas: tests/deployments/test_openai_api.py."""

import asyncio
import hashlib
import json
from types import MethodType, SimpleNamespace

import pytest

from areal_ray.rollout.openai.affinity import MemoryKV, SessionLost, SessionRegistry, shard_of
from areal_ray.rollout.openai.auth import RequestGuard
from deployments.openai_api import REPLICA_HEADER, OpenAIServer, SessionShard
from tests.rollout.openai.test_service import KEY, engine, http_request, service  # noqa: F401


def test_a_sessions_shard_is_a_fixed_function_of_its_id():
    assert shard_of("s", 1) == 0
    want = int.from_bytes(hashlib.blake2b(b"abc", digest_size=8).digest(), "big") % 3
    assert shard_of("abc", 3) == want  # not Python's hash: salted per process
    counts = [0, 0]
    for i in range(200):
        counts[shard_of(f"session-{i}", 2)] += 1
    assert min(counts) > 60
    with pytest.raises(ValueError):
        shard_of("s", 0)


def test_the_registry_refuses_a_session_another_incarnation_opened():
    kv = MemoryKV()
    first, restarted = (SessionRegistry(kv, "run", inc, f"OpenAI-1#{inc}") for inc in ("a", "b"))

    async def go():
        await first.check("s", opening=False)  # a fetch of an unknown session notes nothing
        assert kv.data == {}
        await first.check("s", opening=True)
        await first.check("s", opening=True)  # its own: fine
        with pytest.raises(SessionLost) as e:
            await restarted.check("s", opening=True)
        assert e.value.status == 410 and "'s' was lost" in e.value.message
        assert "OpenAI-1#a" in e.value.message and e.value.body()["error"]["type"] == "session_lost"
        await restarted.check("t", opening=True)  # a new session is the new incarnation's
        await first.release("s")
        await restarted.check("s", opening=True)  # deleted: the id is free again
    asyncio.run(go())
    assert kv.data == {"run/s": "b OpenAI-1#b", "run/t": "b OpenAI-1#b"}


def shard(engine, kv, k):  # noqa: F811
    """Shard `k` of the endpoint without Serve, its session registry in `kv`; each one
    made is a new incarnation."""
    inc = f"inc{k}-{len(kv.data)}-{id(object())}"
    return SessionShard.of(service(engine), SessionRegistry(kv, "run", inc, f"OpenAI-{k}#{inc}"),
                           f"OpenAI-{k}#{inc}")


def ingress(engine, kv, shards=()):  # noqa: F811
    """The ingress's handler over a local shard 0 and `shards` (stand-ins for handles)."""
    cls = OpenAIServer.func_or_class
    server = SimpleNamespace(local=shard(engine, kv, 0), guard=RequestGuard(KEY, 1 << 20),
                             shards=list(shards), n=len(shards) + 1)
    server._serve = MethodType(cls._serve, server)
    return server


def sids_of_shards(n=2):
    by_shard = {}
    for i in range(100):
        by_shard.setdefault(shard_of(f"sess-{i}", n), f"sess-{i}")
    return [by_shard[k] for k in range(n)]


def test_every_call_of_a_session_reaches_its_shard_and_a_restart_is_a_410(engine):  # noqa: F811
    cls, kv = OpenAIServer.func_or_class, MemoryKV()
    one = shard(engine, kv, 1)
    box = {"one": one}  # what shard 1's Serve handle reaches: `handle.call.remote(...)`, awaited
    front = ingress(engine, kv, shards=[SimpleNamespace(call=SimpleNamespace(
        remote=lambda *a: box["one"].call(*a)))])
    s0, s1 = sids_of_shards()

    def chat(sid, content="1+1="):
        res = asyncio.run(cls.chat_completions(front, sid, http_request(
            {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2})))
        return res.status_code, res.headers[REPLICA_HEADER], json.loads(res.body)

    def get(sid, method=cls.session):
        res = asyncio.run(method(front, sid, http_request({})))
        return res.status_code, json.loads(res.body)

    for _ in range(3):
        assert chat(s0)[:2] == (200, front.local.name)
        assert chat(s1)[:2] == (200, one.name)
    assert len(front.local.service.store) == len(one.service.store) == 1
    assert len(get(s1)[1]["calls"]) == 3

    box["one"] = shard(engine, kv, 1)  # shard 1 restarted: a new incarnation, no sessions
    status, replica, body = chat(s1)
    assert (status, replica) == (410, box["one"].name)
    assert f"session {s1!r} was lost" in body["error"]["message"] and one.name in body["error"]["message"]
    assert get(s1)[0] == 410 and len(box["one"].service.store) == 0  # nothing recorded
    assert chat(s0)[0] == 200  # shard 0's session goes on
    assert get(s1, cls.delete)[0] == 410  # told once more, and forgotten
    assert chat(s1)[0] == 200 and len(get(s1)[1]["calls"]) == 1  # a new session of that id
    assert get(s1, cls.delete) == (200, {"id": s1, "deleted": True})
    assert f"run/{s1}" not in kv.data


def test_a_first_call_refused_before_the_session_opens_leaves_no_note(engine):  # noqa: F811
    cls, kv = OpenAIServer.func_or_class, MemoryKV()
    server = ingress(engine, kv)
    res = asyncio.run(cls.completions(server, "bad", http_request({"prompt": "1"})))  # no model
    assert res.status_code == 400 and kv.data == {} and len(server.local.service.store) == 0
