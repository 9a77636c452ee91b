"""The app under real uvicorn (uvloop, websockets-sansio) with the official openai client and websockets."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from websockets.sync.client import connect

from .conftest import LiveServer, wait_for
from .fake_engine import FakeEngine


@pytest.fixture
def live():
    engine = FakeEngine("The quick brown fox jumps over the lazy dog.", tokens_per_delta=2)
    with LiveServer(engine, api_key="sekret") as server:
        server.engine = engine
        yield server


def test_openai_client_whole_and_stream(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="sekret", max_retries=0)
    assert [m.id for m in client.models.list()] == ["fake-model"]
    whole = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    assert whole.choices[0].message.content == live.engine.reply and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == len(live.engine.reply)
    stream = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == live.engine.reply
    assert chunks[-1].usage.completion_tokens == len(live.engine.reply)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same prompt twice: prefix-cache hit
    completion = client.completions.create(model="fake-model", prompt="Say", max_tokens=9)
    assert completion.choices[0].text == live.engine.reply[:9] and completion.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in client.completions.create(model="fake-model", prompt="Say",
                                                                          max_tokens=9, stream=True))
    assert text == live.engine.reply[:9]


def test_openai_client_errors(live):
    bad_key = openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="sekret", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=[], stream=True)
    assert e.value.body["code"] == "empty_messages"


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("kwargs,param", [
    ({"extra_body": {"best_of": 2}}, "best_of"), ({"extra_body": {"echo": True}}, "echo"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"extra_body": {"chat_template_kwargs": {"x": 1}}}, "chat_template_kwargs"),
])
def test_openai_client_unimplemented_fields_are_refused_by_name(live, kwargs, param):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="sekret", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                           stream=stream, **kwargs)
        assert e.value.body["code"] == "unsupported_parameter" and e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake-model", prompt="Say", suffix="the end")
    assert e.value.body["param"] == "suffix"
    ok = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}], n=1,
                                        user="u-1", metadata={"app": "x"}, store=False, max_completion_tokens=10**3)
    assert ok.choices[0].message.content == live.engine.reply


def test_health_is_fast_while_a_slow_generation_streams(live):
    """/health answers while a stream is still going, not after it: the stream takes ~3 s, each
    check must take well under that (1 s: a 0.1 s bound failed once on a CI run sharing 2 cores)."""
    live.engine.reply, live.engine.token_delay, live.engine.tokens_per_delta = "s" * 300, 0.01, 1
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="sekret", max_retries=0)
    received = []

    def consume():
        stream = client.chat.completions.create(model="fake-model", stream=True,
                                                messages=[{"role": "user", "content": "go slowly"}])
        received.extend(c.choices[0].delta.content or "" for c in stream)

    thread = threading.Thread(target=consume)
    thread.start()
    wait_for(lambda: live.engine.num_running == 1)
    with httpx.Client() as http:
        for _ in range(5):
            start = time.perf_counter()
            response = http.get(f"{live.url}/health")
            assert time.perf_counter() - start < 1.0 and response.json()["num_running"] == 1
            time.sleep(0.05)
    thread.join(timeout=10)
    assert "".join(received) == live.engine.reply


def test_sse_disconnect_aborts(live):
    live.engine.reply, live.engine.token_delay = "d" * 1000, 0.01
    with httpx.Client() as http:
        with http.stream("POST", f"{live.url}/v1/chat/completions", headers={"authorization": "Bearer sekret"},
                         json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as response:
            next(response.iter_lines())
    wait_for(lambda: live.engine.num_free_blocks == live.engine.num_blocks and live.engine.num_running == 0)
    assert len(live.engine.abort_calls) == 1


@pytest.mark.parametrize("stream,token_delay", [(False, 0.01), (False, 5.0), (True, 5.0)],
                         ids=["whole-mid-stream", "whole-in-prefill", "sse-in-prefill"])
def test_http_disconnect_aborts(live, stream, token_delay):
    live.engine.reply, live.engine.token_delay = "d" * 1000, token_delay
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/chat/completions", headers={"authorization": "Bearer sekret"},
                   json={"messages": [{"role": "user", "content": "hi"}], "stream": stream}, timeout=0.2)
    wait_for(lambda: live.engine.num_free_blocks == live.engine.num_blocks and live.engine.num_running == 0)
    assert len(live.engine.abort_calls) == 1


def test_websocket_over_uvicorn(live):
    url = f"ws://127.0.0.1:{live.port}/ws"
    with connect(url, additional_headers={"authorization": "Bearer sekret"}) as ws:
        assert json.loads(ws.recv())["type"] == "ready"
        ws.send(json.dumps({"type": "chat", "content": "hi"}))
        messages = [json.loads(ws.recv())]
        while messages[-1]["type"] != "done":
            messages.append(json.loads(ws.recv()))
        assert "".join(m.get("text", "") for m in messages) == live.engine.reply
        ws.send(b"binary")
        assert json.loads(ws.recv())["code"] == "binary_frame"
        live.engine.reply, live.engine.token_delay = "e" * 1000, 0.01
        ws.send(json.dumps({"type": "chat", "content": "long"}))
        assert json.loads(ws.recv())["type"] == "delta"
    wait_for(lambda: live.engine.num_free_blocks == live.engine.num_blocks and live.engine.num_running == 0)
    assert len(live.engine.abort_calls) == 1


def test_websocket_cross_origin_refused_over_uvicorn(live):
    url = f"ws://127.0.0.1:{live.port}/ws?api_key=sekret"
    with connect(url, origin="http://evil.example") as ws:
        assert json.loads(ws.recv())["code"] == "forbidden_origin"
    with connect(url, origin=f"http://127.0.0.1:{live.port}") as ws:
        assert json.loads(ws.recv())["type"] == "ready"


def test_run_server_prints_the_url_and_uses_uvloop(monkeypatch, capsys):
    import chatserve.server.app as server_module
    from chatserve.config import ServerConfig

    made = []
    real = server_module.make_uvicorn_server

    class NotRun:
        def __init__(self, inner):
            self.config = inner.config

        def run(self):
            made.append(self.config)

    monkeypatch.setattr(server_module, "make_uvicorn_server", lambda e, c: NotRun(real(e, c)))
    server_module.run_server(FakeEngine(), ServerConfig(port=8123, api_key="k"))
    out = capsys.readouterr().out
    assert "http://127.0.0.1:8123/" in out and "api_key" in out and "k\n" not in out
    config = made[0]
    assert (config.host, config.port, config.loop, config.ws) == ("127.0.0.1", 8123, "uvloop", "websockets-sansio")


def test_frame_far_over_the_limit_is_closed_and_the_server_still_serves(live):
    """Frames over 4x max_message_bytes never reach the app: the websocket layer closes with 1009."""
    from websockets.exceptions import ConnectionClosed

    url = f"ws://127.0.0.1:{live.port}/ws?api_key=sekret"
    with connect(url, max_size=None) as ws:
        assert json.loads(ws.recv())["type"] == "ready"
        ws.send("x" * (5 << 20))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd.code == 1009
    with connect(url) as ws:
        assert json.loads(ws.recv())["type"] == "ready"
        ws.send(json.dumps({"type": "chat", "content": "hi"}))
        while json.loads(ws.recv(timeout=10))["type"] != "done":
            pass
