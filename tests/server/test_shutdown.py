"""SIGTERM against a real `chatserve serve` process on the tiny model: new connections are refused,
running turns finish within the grace period (or end with finish_reason "abort" after it), every
websocket is closed with 1001 "server shutting down", and the process exits."""

from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed

from .real_server import RealServer, wait_health, ws_connect

LONG = {"temperature": 0, "max_tokens": 1000, "ignore_eos": True}  # ~1-2 s of decoding each


def start_turn(ws, turn_id: str) -> None:
    ws.send(json.dumps({"type": "chat", "id": turn_id, "content": "hi", "params": LONG}))


def rest_of_turn(ws) -> tuple[dict, int]:
    """Read to the turn's `done`: (done, tokens in the deltas read here)."""
    num_tokens = 0
    while (msg := json.loads(ws.recv(timeout=60)))["type"] == "delta":
        num_tokens += msg["num_tokens"]
    return msg, num_tokens


def expect_shutdown_close(ws) -> None:
    """After its last turn a connection gets `error` shutting_down, then close 1001."""
    error = json.loads(ws.recv(timeout=30))
    assert error["type"] == "error" and error["code"] == "shutting_down", error
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    assert closed.value.rcvd.reason == "server shutting down"


def open_stream(http: httpx.Client):
    """A streamed completion as long as a turn, read up to its first chunk."""
    body = {"prompt": "Count:", "max_tokens": LONG["max_tokens"], "ignore_eos": True, "stream": True}
    response = http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
    lines = response.iter_lines()
    assert response.status_code == 200 and next(lines).startswith("data: ")
    return response, lines


def rest_of_stream(lines) -> list[dict]:
    chunks = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
        if line == "data: [DONE]":
            return chunks
    raise AssertionError("the stream ended without [DONE]")


def wait_refused(port: int) -> None:
    """The listener closes soon after the signal (uvicorn checks for it every 0.1 s)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return
        assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
        time.sleep(0.02)


def test_sigterm_refuses_new_work_and_lets_running_turns_finish(tiny_llama_dir):
    """Grace 60 s; three 1,000-token generations, one at a time (~3-6 s in all): an SSE stream and
    two websocket turns queued behind it. All finish with "length" after the signal."""
    server = RealServer(tiny_llama_dir, "--no-spec", "--max-num-seqs", "1", "--shutdown-grace", "60")
    try:
        with ws_connect(server.base) as ws1, ws_connect(server.base) as ws2, ws_connect(server.base) as idle, \
                httpx.Client(base_url=server.base, timeout=60) as http:
            stream, lines = open_stream(http)  # runs first; the two turns queue behind it
            start_turn(ws1, "a")
            start_turn(ws2, "b")
            wait_health(server.base, lambda h: h["num_generations"] == 3)
            keep_alive = httpx.Client(base_url=server.base, timeout=10)
            assert keep_alive.get("/health").status_code == 200  # a connection open before the signal
            server.proc.send_signal(signal.SIGTERM)

            wait_refused(server.port)
            refused = keep_alive.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            assert refused.headers["retry-after"] == "5"
            draining = keep_alive.get("/health")
            assert draining.status_code == 503 and draining.json()["status"] == "draining"
            assert draining.json()["num_generations"] == 3  # nothing was cut short
            expect_shutdown_close(idle)  # an idle websocket is closed at once

            chunks = rest_of_stream(lines)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            stream.close()
            for ws, turn_id in ((ws1, "a"), (ws2, "b")):
                done, _ = rest_of_turn(ws)
                assert done["type"] == "done" and done["id"] == turn_id, done
                assert done["finish_reason"] == "length" and done["stats"]["generated_tokens"] == 1000
                expect_shutdown_close(ws)
            keep_alive.close()
        assert server.proc.wait(timeout=30) is not None
        output = server.output()
        assert "shutting down: 3 generation(s) running" in output and "aborting" not in output
    finally:
        server.stop()


def test_sigterm_past_the_grace_period_aborts_with_finish_reason_abort(tiny_llama_dir):
    """Grace 0: the running turn and stream end at once with "abort" (the websocket then closes
    with 1001) and the process exits within the grace period plus a few seconds."""
    server = RealServer(tiny_llama_dir, "--no-spec", "--shutdown-grace", "0")
    try:
        with ws_connect(server.base) as ws, httpx.Client(base_url=server.base, timeout=60) as http:
            start_turn(ws, "a")
            assert json.loads(ws.recv(timeout=60))["type"] == "delta"
            stream, lines = open_stream(http)
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            done, _ = rest_of_turn(ws)
            assert done["type"] == "done" and done["finish_reason"] == "abort", done
            assert done["stats"]["generated_tokens"] < 1000
            expect_shutdown_close(ws)
            chunks = rest_of_stream(lines)
            assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
            stream.close()
        server.proc.wait(timeout=30)
        assert time.monotonic() - signalled < 10  # grace 0 + the abort wait (2 s) + uvicorn's (3 s)
        assert "aborting 2 generation(s) still running" in server.output()
    finally:
        server.stop()
