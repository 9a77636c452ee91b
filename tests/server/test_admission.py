"""Admission on the FakeEngine: the generation bound (429 / queue_full), counts that always come back
to zero, and refusals while draining. test_backpressure.py runs the same against a real server."""

from __future__ import annotations

import asyncio

import pytest

from chatserve import protocol as P
from chatserve.config import ServerConfig
from chatserve.server.admission import Admission

from .conftest import chat, wait_for
from .fake_engine import FakeEngine

BODY = {"messages": [{"role": "user", "content": "hi"}]}


def test_the_bound_is_running_plus_queued_and_every_release_reopens_it():
    admission = Admission(ServerConfig(max_queued_requests=2), max_running=1)
    for _ in range(3):
        admission.acquire_generation()
    with pytest.raises(P.ProtocolError) as e:
        admission.acquire_generation()
    assert (e.value.code, e.value.status, e.value.retry_after) == (P.QUEUE_FULL, 429, 1)
    assert "1 running + 2 queued" in e.value.message
    admission.release_generation()
    admission.acquire_generation()
    admission.start_draining()
    with pytest.raises(P.ProtocolError) as e:
        admission.acquire_connection()
    assert (e.value.code, e.value.status, e.value.retry_after) == (P.SHUTTING_DOWN, 503, 5)


def test_http_generation_that_fails_the_connection_check_gives_its_generation_back():
    admission = Admission(ServerConfig(max_connections=1), max_running=4)
    admission.acquire_connection()
    with pytest.raises(P.ProtocolError) as e:
        admission.acquire_http()
    assert e.value.code == P.TOO_MANY_CONNECTIONS and e.value.retry_after == 1
    assert admission.num_generations == 0 and admission.num_connections == 1


def test_wait_no_generations():
    async def run() -> tuple[bool, bool]:
        admission = Admission(ServerConfig(), max_running=1)
        admission.acquire_generation()
        timed_out = await admission.wait_no_generations(0.01)
        asyncio.get_running_loop().call_later(0.01, admission.release_generation)
        return timed_out, await admission.wait_no_generations(5)

    assert asyncio.run(run()) == (False, True)


def test_full_queue_refuses_http_with_429_and_ws_with_queue_full(make_client):
    """Two slow turns fill 1 running + 1 queued; HTTP gets 429 + Retry-After before its body is
    read, a third websocket's chat gets queue_full and its connection stays usable."""
    engine = FakeEngine("slow " * 200, token_delay=0.01, max_num_seqs=1)
    client = make_client(engine, max_queued_requests=1)
    with client.websocket_connect("/ws") as a, client.websocket_connect("/ws") as b, \
            client.websocket_connect("/ws") as c:
        for ws in (a, b, c):
            ws.receive_json()
        a.send_json({"type": "chat", "id": "a", "content": "one"})
        b.send_json({"type": "chat", "id": "b", "content": "two"})
        wait_for(lambda: client.app.state.server.admission.num_generations == 2)
        for _ in range(20):
            response = client.post("/v1/chat/completions", content=b"not even json")  # body never read
            assert response.status_code == 429 and response.headers["retry-after"] == "1"
            assert response.json()["error"] == {"message": response.json()["error"]["message"],
                                                "type": "rate_limit_error", "param": None, "code": "queue_full"}
        error = chat(c, id="c", content="three")[-1]
        assert error == {"type": "error", "id": "c", "code": "queue_full", "message": error["message"]}
        a.send_json({"type": "cancel", "id": "a"})
        wait_for(lambda: client.app.state.server.admission.num_generations == 1)
        b.send_json({"type": "cancel"})
        engine.token_delay = 0
        assert chat(c, id="c2", content="three again")[-1]["type"] == "done"
    assert client.post("/v1/chat/completions", json=BODY).status_code == 200
    state = client.app.state.server
    wait_for(lambda: state.admission.num_generations == 0 and state.admission.num_connections == 0)


@pytest.mark.parametrize("case", ["bad_json", "too_large", "model_not_found", "stream", "whole", "prompt_too_long"])
def test_every_http_outcome_releases_its_admission(make_client, case):
    engine = FakeEngine()
    client = make_client(engine, max_message_bytes=1000, max_prompt_tokens=100)
    request = {
        "bad_json": dict(content=b"{oops"),
        "too_large": dict(content=b"x" * 2000),
        "model_not_found": dict(json={**BODY, "model": "nope"}),
        "stream": dict(json={**BODY, "stream": True}),
        "whole": dict(json=BODY),
        "prompt_too_long": dict(json={"messages": [{"role": "user", "content": "x" * 500}]}),
    }[case]
    client.post("/v1/chat/completions", **request)
    admission = client.app.state.server.admission
    wait_for(lambda: admission.num_generations == 0 and admission.num_connections == 0)


def test_draining_refuses_new_http_and_ws_work(make_client):
    client = make_client(FakeEngine())
    with client.websocket_connect("/ws") as ws:
        ws.receive_json()
        client.app.state.server.admission.start_draining()
        response = client.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
        assert response.headers["retry-after"] == "5"
        assert chat(ws, id="t", content="hi")[-1]["code"] == "shutting_down"
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"


def test_each_choice_of_n_is_a_generation(make_client):
    """1 running + 2 queued: n = 4 can never be admitted (400 naming n); n = 3 fits an idle server
    and is a 429 beside one generation in flight; all counts come back to zero."""
    engine = FakeEngine("slow " * 200, token_delay=0.01, max_num_seqs=1)
    client = make_client(engine, max_queued_requests=2)
    admission = client.app.state.server.admission
    error = client.post("/v1/chat/completions", json={**BODY, "n": 4}).json()["error"]
    assert error["param"] == "n" and error["code"] == "invalid_params" and "(3)" in error["message"]
    with client.websocket_connect("/ws") as ws:
        ws.receive_json()
        ws.send_json({"type": "chat", "id": "a", "content": "one"})
        wait_for(lambda: admission.num_generations == 1)
        response = client.post("/v1/chat/completions", json={**BODY, "n": 3})
        assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full"
        assert admission.num_generations == 1 and admission.num_connections == 1
        ws.send_json({"type": "cancel"})
        wait_for(lambda: admission.num_generations == 0)
    engine.token_delay = 0
    body = client.post("/v1/chat/completions", json={**BODY, "n": 3, "max_tokens": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    wait_for(lambda: admission.num_generations == 0 and admission.num_connections == 0)
