"""Websocket bad input and security: each error is clear, and the next request still works."""

from __future__ import annotations

import contextlib
import json

import pytest
from starlette.websockets import WebSocketDisconnect

from .conftest import chat
from .fake_engine import FakeEngine

BAD_FRAMES = [
    ("not json", "bad_json"),
    ('{"type": "chat", "content": "unterminated', "bad_json"),
    ("[1, 2, 3]", "bad_message"),
    ('{"content": "no type"}', "bad_message"),
    ('{"type": 7}', "bad_message"),
    ('{"type": "shout", "content": "hi"}', "unknown_type"),
    ('{"type": "chat", "content": ""}', "empty_messages"),
    ('{"type": "chat", "content": "   "}', "empty_messages"),
    ('{"type": "chat", "messages": []}', "empty_messages"),
    ('{"type": "chat", "content": 42}', "bad_message"),
    ('{"type": "chat", "messages": "hi"}', "bad_message"),
    ('{"type": "chat", "messages": [{"role": "wizard", "content": "hi"}]}', "bad_message"),
    ('{"type": "chat", "messages": [{"role": "user", "content": {"x": 1}}]}', "bad_message"),
    ('{"type": "chat", "messages": [{"role": "user", "content": "a"}], "content": "b"}', "bad_message"),
    ('{"type": "chat"}', "bad_message"),
    ('{"type": "chat", "content": "hi", "colour": "red"}', "bad_message"),
    ('{"type": "chat", "content": "hi", "id": [1]}', "bad_message"),
    ('{"type": "chat", "content": "hi", "params": {"temprature": 1}}', "invalid_params"),
    ('{"type": "chat", "content": "hi", "params": {"max_tokens": 100000}}', "invalid_params"),
    ('{"type": "chat", "content": "hi", "params": {"top_p": 0}}', "invalid_params"),
    ('{"type": "chat", "content": "hi", "params": {"speculation": "yes"}}', "invalid_params"),
    ('{"type": "settings", "params": {"temperature": "hot"}}', "invalid_params"),
    ('{"type": "settings", "params": []}', "bad_message"),
    ('{"type": "settings"}', "bad_message"),
    ('{"type": "auth", "api_key": 5}', "bad_message"),
    ('{"type": "chat", "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}',
     "bad_message"),  # the chat template (tokenize_chat) refuses it
    ('{"type": "chat", "messages": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]}',
     "bad_message"),  # ... with an exception that is not a ValueError
]


@pytest.mark.parametrize("frame,code", BAD_FRAMES, ids=[f"{c}:{f[:30]}" for f, c in BAD_FRAMES])
def test_bad_frame_gets_error_and_connection_survives(client, engine, frame, code):
    with client.websocket_connect("/ws") as ws:
        ws.receive_json()
        ws.send_text(frame)
        error = ws.receive_json()
        assert error["type"] == "error" and error["code"] == code and error["message"]
        assert chat(ws, content="still there?")[-1]["type"] == "done"
        assert chat(ws, content="and a second turn")[-1]["type"] == "done"


def test_binary_frame_and_oversized_message(make_client):
    engine = FakeEngine()
    with make_client(engine, max_message_bytes=1000).websocket_connect("/ws") as ws:
        ws.receive_json()
        ws.send_bytes(b'{"type": "chat", "content": "hi"}')
        assert ws.receive_json()["code"] == "binary_frame"
        ws.send_text(json.dumps({"type": "chat", "content": "a" * 2000}))
        error = ws.receive_json()
        assert error["code"] == "too_large" and "1000" in error["message"]
        ws.send_text(json.dumps({"type": "chat", "content": "é" * 600}))  # 600 chars, 1200 bytes
        assert ws.receive_json()["code"] == "too_large"
        assert chat(ws, content="small")[-1]["type"] == "done"


def test_prompt_too_long_for_the_server_limit(make_client):
    engine = FakeEngine()
    with make_client(engine, max_prompt_tokens=60).websocket_connect("/ws") as ws:
        ws.receive_json()
        error = chat(ws, content="q" * 100, id="big")[-1]
        assert error["code"] == "prompt_too_long" and error["id"] == "big" and "60" in error["message"]
        done = chat(ws, content="short")[-1]  # the refused turn did not join the conversation
        assert done["type"] == "done" and engine.detokenize(engine.prompts[-1]) == "<user>short</user><assistant>"


def test_prompt_too_long_for_the_engine(make_client):
    engine = FakeEngine(max_model_len=100)
    with make_client(engine, max_prompt_tokens=10_000).websocket_connect("/ws") as ws:
        ws.receive_json()
        error = chat(ws, content="q" * 200)[-1]
        assert error["code"] == "invalid_prompt" and "context" in error["message"]
        assert chat(ws, content="short")[-1]["type"] == "done"
    assert engine.num_free_blocks == engine.num_blocks and engine.abort_calls == []


@pytest.mark.parametrize("origin,allowed,ok", [
    (None, (), True),
    ("http://testserver", (), True),
    ("http://evil.example", (), False),
    ("null", (), False),
    ("http://testserver.evil.example", (), False),
    ("http://app.example", ("http://app.example",), True),
    ("http://other.example", ("*",), True),
])
def test_origin_must_match_host_or_be_allowed(make_client, origin, allowed, ok):
    client = make_client(FakeEngine(), allowed_origins=allowed)
    headers = {"origin": origin} if origin else {}
    with client.websocket_connect("/ws", headers=headers) as ws:
        first = ws.receive_json()
        if ok:
            assert first["type"] == "ready"
            assert chat(ws, content="hi")[-1]["type"] == "done"
            return
        assert first["type"] == "error" and first["code"] == "forbidden_origin"
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1008
    with client.websocket_connect("/ws") as ws:  # the server still serves everyone else
        assert ws.receive_json()["type"] == "ready" and chat(ws, content="hi")[-1]["type"] == "done"


@contextlib.contextmanager
def connect_with_key(client, how: str, key: str):
    """Open /ws presenting `key` by header, query string or a first `auth` message ("none": not at all)."""
    url = f"/ws?api_key={key}" if how == "query" else "/ws"
    headers = {"authorization": f"Bearer {key}"} if how == "header" else {}
    with client.websocket_connect(url, headers=headers) as ws:
        if how == "message":
            ws.send_json({"type": "auth", "api_key": key})
        yield ws


@pytest.mark.parametrize("how", ["header", "query", "message"])
def test_api_key_accepted_three_ways(make_client, how):
    with connect_with_key(make_client(FakeEngine(), api_key="sekret"), how, "sekret") as ws:
        assert ws.receive_json()["type"] == "ready"
        assert chat(ws, content="hi")[-1]["type"] == "done"


@pytest.mark.parametrize("how", ["header", "query", "message", "none"])
def test_api_key_refused(make_client, how):
    engine = FakeEngine()
    client = make_client(engine, api_key="sekret")
    with connect_with_key(client, how, "wrong") as ws:
        if how == "none":
            ws.send_json({"type": "chat", "content": "let me in"})
        error = ws.receive_json()
        assert error["type"] == "error" and error["code"] == "unauthorized"
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1008
    assert engine.prompts == []
    with client.websocket_connect("/ws", headers={"authorization": "Bearer sekret"}) as ws:
        assert ws.receive_json()["type"] == "ready" and chat(ws, content="hi")[-1]["type"] == "done"


def test_max_connections(make_client):
    client = make_client(FakeEngine(), max_connections=1)
    with client.websocket_connect("/ws") as first:
        first.receive_json()
        with client.websocket_connect("/ws") as second:
            error = second.receive_json()
            assert error["code"] == "too_many_connections"
            with pytest.raises(WebSocketDisconnect) as closed:
                second.receive_json()
            assert closed.value.code == 1013
        assert chat(first, content="hi")[-1]["type"] == "done"
    with client.websocket_connect("/ws") as third:
        assert third.receive_json()["type"] == "ready"


def test_http_request_over_the_connection_limit(make_client):
    client = make_client(FakeEngine(), max_connections=1)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    with client.websocket_connect("/ws") as ws:
        ws.receive_json()
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "too_many_connections"
        assert chat(ws, content="hi")[-1]["type"] == "done"
    assert client.post("/v1/chat/completions", json=body).status_code == 200
