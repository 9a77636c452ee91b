"""The model's generation_config.json sampling values as the server's defaults: a request's own
values win, the websocket `ready` shows them, and --no-generation-config turns them off."""

from __future__ import annotations

import pytest

from .conftest import receive_until
from .fake_engine import FakeEngine

DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def engine():
    return FakeEngine(sampling_defaults=DEFAULTS)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"})])
def test_http_requests_get_the_model_s_defaults(client, engine, path, body):
    assert client.post(path, json=body).status_code == 200
    assert client.post(path, json={**body, "temperature": 0, "top_k": None, "top_p": 0.5}).status_code == 200
    first, second = engine.params
    assert (first.temperature, first.top_p, first.top_k, first.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert (second.temperature, second.top_p, second.top_k, second.repetition_penalty) == (0.0, 0.5, 20, 1.05)


def test_websocket_ready_shows_them_and_a_turn_overrides_them(client, engine):
    with client.websocket_connect("/ws") as ws:
        ready = ws.receive_json()
        assert ready["type"] == "ready" and ready["settings"] == DEFAULTS
        defaults = ready["defaults"]  # what a turn that sets nothing gets: the model's over chatserve's
        assert defaults == {**defaults, **DEFAULTS} and (defaults["max_tokens"], defaults["min_p"]) == (256, 0.0)
        ws.send_json({"type": "settings", "params": {"temperature": 0.2}})
        assert ws.receive_json()["params"] == {**DEFAULTS, "temperature": 0.2}
        ws.send_json({"type": "chat", "content": "hi", "params": {"top_k": 3}})
        receive_until(ws, "done")
    params = engine.params[0]
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.2, 0.8, 3, 1.05)


def test_no_generation_config(make_client, engine):
    client = make_client(engine, use_generation_config=False)
    client.post("/v1/chat/completions", json=CHAT)
    assert engine.params[0].temperature == 1.0 and engine.params[0].top_k == 0
    with client.websocket_connect("/ws") as ws:
        assert ws.receive_json()["settings"] == {}
