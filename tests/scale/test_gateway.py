"""The /v1 gateway in-process (no Ray): routing keys from the body, the relay to a replica's app
and back, limits, a client that leaves, a replica that fails. Two chatserve apps on FakeEngines
stand in for the replicas; tests/scale/test_ray_replicas.py runs the real thing under Ray."""

from __future__ import annotations

import asyncio
import json

from starlette.testclient import TestClient

from chatserve.config import ServerConfig
from chatserve.scale.affinity import PROMPT_KEY_SLACK, AffinityPolicy, body_key, prompt_key
from chatserve.scale.gateway import Gateway, call_asgi, forwarded_scope
from chatserve.server import create_app
from tests.server.fake_engine import FakeEngine

CHAT = {"model": "fake-model", "max_tokens": 8}


def _chat(content: str, system: str | None = None, **fields) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {**CHAT, "messages": messages, **fields}


class Replicas:
    """Two replicas' apps and the gateway's forward(): AffinityPolicy picks one per key."""

    def __init__(self, **engine_args):
        self.engines = {name: FakeEngine(**engine_args) for name in ("a", "b")}
        self.apps = {name: create_app(engine, ServerConfig()) for name, engine in self.engines.items()}
        self.policy = AffinityPolicy()
        self.routed: list[tuple[str | None, str]] = []  # (key, replica)

    async def forward(self, key, scope, body):
        replica = self.policy.choose(key, {name: 0 for name in self.apps})
        self.routed.append((key, replica))
        async for message in call_asgi(self.apps[replica], scope, body):
            yield message


def _client(replicas: Replicas, max_body_bytes: int = 1 << 20) -> TestClient:
    return TestClient(Gateway(replicas.forward, max_body_bytes))


def test_body_key_user_then_prompt():
    assert body_key(json.dumps(_chat("hi", user="alice")).encode()) == "u:alice"
    one = body_key(json.dumps(_chat("Explain this file: " + "x" * 300)).encode())
    assert one.startswith("p:")
    # a later turn of the same conversation resends its start: same key
    later = _chat("Explain this file: " + "x" * 300)
    later["messages"] += [{"role": "assistant", "content": "It is x."}, {"role": "user", "content": "Why?"}]
    assert body_key(json.dumps(later).encode()) == one
    # so does a conversation whose first message is short
    short = _chat("Why is the sky blue?")
    short_key = body_key(json.dumps(short).encode())
    short["messages"] += [{"role": "assistant", "content": "Rayleigh scattering. " * 30}, {"role": "user", "content": "And sunsets?"}]
    assert body_key(json.dumps(short).encode()) == short_key
    assert body_key(json.dumps(_chat("Why is the sea blue?")).encode()) != short_key
    # the system prompt alone does not decide; the conversation after it does
    shared = "You are a helpful assistant. " * 20
    assert body_key(json.dumps(_chat("first", system=shared)).encode()) != body_key(
        json.dumps(_chat("second", system=shared)).encode())
    assert body_key(json.dumps(_chat("first", system="a")).encode()) != body_key(json.dumps(_chat("first", system="b")).encode())
    # content parts count as their text
    parts = _chat("")
    parts["messages"][0]["content"] = [{"type": "text", "text": "Explain this file: " + "x" * 300}]
    assert body_key(json.dumps(parts).encode()) == one
    assert body_key(json.dumps({"model": "m", "prompt": list(range(100))}).encode()) == prompt_key(list(range(100)))
    assert body_key(json.dumps({"model": "m", "prompt": "def f():"}).encode()).startswith("p:")
    for nothing in (b"not json", b"[1, 2]", json.dumps({"messages": [{"role": "system", "content": "s"}]}).encode()):
        assert body_key(nothing) is None


def test_a_busy_prompt_key_spills_over_but_keeps_its_home():
    policy = AffinityPolicy()
    key = "p:shared-start"
    assert policy.choose(key, {"a": 0, "b": 0}) in ("a", "b")
    home = policy.homes[key]
    other = "b" if home == "a" else "a"
    assert policy.choose(key, {home: PROMPT_KEY_SLACK - 1, other: 0}) == home
    assert policy.choose(key, {home: PROMPT_KEY_SLACK, other: 0}) == other
    assert policy.homes[key] == home
    # a session key sticks however busy its home is
    assert policy.choose("conv", {"a": 0, "b": 0}) == (session_home := policy.homes["conv"])
    assert policy.choose("conv", {session_home: 50, other if session_home == home else home: 0}) == session_home


def test_forwarded_scope_puts_the_path_back_together_and_pickles():
    import pickle
    scope = {"type": "http", "method": "POST", "root_path": "/v1", "path": "/chat/completions",
             "headers": [(b"content-type", b"application/json")], "query_string": b"", "client": ["1.2.3.4", 5],
             "app": object(), "state": {}}
    out = pickle.loads(pickle.dumps(forwarded_scope(scope)))
    assert out["path"] == "/v1/chat/completions" and out["raw_path"] == b"/v1/chat/completions"
    assert out["root_path"] == "" and out["client"] == ("1.2.3.4", 5) and "app" not in out
    # a path that already holds its root path (Starlette >= 0.33 mounts) is left whole
    assert forwarded_scope({**scope, "path": "/v1/models"})["path"] == "/v1/models"


def test_relayed_completion_whole_and_streamed():
    replicas = Replicas()
    with _client(replicas) as client:
        whole = client.post("/v1/chat/completions", json=_chat("hi", user="u1", temperature=0, max_tokens=50))
        assert whole.status_code == 200
        assert whole.json()["choices"][0]["message"]["content"] == FakeEngine().reply
        streamed = client.post("/v1/chat/completions", json=_chat("hi", user="u1", stream=True, max_tokens=50))
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.endswith("data: [DONE]\n\n")
        text = "".join(json.loads(block[6:])["choices"][0]["delta"].get("content") or ""
                       for block in streamed.text.split("\n\n")[:-2])
        assert text == FakeEngine().reply
        assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"
        # the replica's own errors come back as they are
        bad = client.post("/v1/chat/completions", json={**_chat("hi"), "model": "nope"})
        assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"


def test_users_stick_and_spread_and_conversations_stick_without_a_key():
    replicas = Replicas()
    with _client(replicas) as client:
        for user in [f"user-{i}" for i in range(12)] * 2:
            assert client.post("/v1/chat/completions", json=_chat("hi", user=user)).status_code == 200
        homes: dict[str, set] = {}
        for key, replica in replicas.routed:
            homes.setdefault(key, set()).add(replica)
        assert all(len(r) == 1 for r in homes.values())  # each user on one replica
        assert {r for rs in homes.values() for r in rs} == {"a", "b"}  # 12 users on one: p = 2^-11
        replicas.routed.clear()
        for turn in range(2):
            for i in range(8):
                body = _chat(f"Conversation {i}: please review this code.")
                if turn:
                    body["messages"] += [{"role": "assistant", "content": "Looks fine."},
                                         {"role": "user", "content": "Any bugs?"}]
                client.post("/v1/chat/completions", json=body)
        first, second = replicas.routed[:8], replicas.routed[8:]
        assert all(k is not None and k.startswith("p:") for k, _ in first)
        assert [r for _, r in first] == [r for _, r in second]  # each conversation's 2nd turn at its 1st's replica
        assert {r for _, r in first} == {"a", "b"}


def test_header_key_wins_over_user():
    replicas = Replicas()
    with _client(replicas) as client:
        client.post("/v1/chat/completions", json=_chat("hi", user="alice"), headers={"x-session-id": "tab-1"})
    assert replicas.routed[0][0] == "tab-1"


def test_body_over_the_limit_is_refused_before_any_replica():
    replicas = Replicas()
    with _client(replicas, max_body_bytes=1000) as client:
        response = client.post("/v1/chat/completions", json=_chat("x" * 2000))
        assert response.status_code == 413 and response.json()["error"]["code"] == "too_large"
        assert client.post("/v1/chat/completions", json=_chat("small")).status_code == 200
    assert len(replicas.routed) == 1


def test_no_replica_answers_503():
    async def failing(key, scope, body):
        raise ConnectionError("replica died")
        yield  # an async generator

    with TestClient(Gateway(failing, 1 << 20)) as client:
        response = client.post("/v1/chat/completions", json=_chat("hi"))
    error = response.json()["error"]
    assert response.status_code == 503 and "replica died" in error["message"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "engine_error"  # the server's own shape


def test_a_client_that_leaves_mid_stream_aborts_the_replicas_request():
    replicas = Replicas(reply="word " * 200, token_delay=0.01)
    engine_a, engine_b = replicas.engines.values()
    body = json.dumps(_chat("hi", user="leaver", stream=True, max_tokens=400)).encode()
    sent: list[dict] = []

    async def run():
        left, asked = asyncio.Event(), []

        async def receive():
            if not asked:
                asked.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if sum(m["type"] == "http.response.body" for m in sent) == 3:
                left.set()  # three chunks in, the client goes away

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "query_string": b""}
        await asyncio.wait_for(Gateway(replicas.forward, 1 << 20)(scope, receive, send), 10)
        for _ in range(100):  # the replica's app sees the disconnect and aborts its request
            if engine_a.abort_calls or engine_b.abort_calls:
                break
            await asyncio.sleep(0.02)

    asyncio.run(run())
    assert sent[0]["status"] == 200
    assert len(engine_a.abort_calls) + len(engine_b.abort_calls) == 1
    chunks = sum(m["type"] == "http.response.body" for m in sent)
    assert 3 <= chunks < 100  # cut short, not run to the end
