"""Backpressure against a real `chatserve serve` process on the tiny model: a websocket client that
never reads, max_connections + 1, a burst of 1,000 HTTP requests on a bounded queue, a disconnect
during a long prefill, and a 100 MB body / deeply nested JSON refused before they are parsed.

The server runs one sequence at a time with one queued (2 generations in flight at most), 3
connections, 16-token steps (a long prompt's prefill spans many steps) and a 16 KiB output cap.
Each test leaves it idle: no connection, no generation, every KV block free.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from .real_server import RealServer, wait_health, wait_pool_free, ws_connect

LONG_PROMPT = "Summarize this. " + "The quick brown fox jumps over the lazy dog. " * 40  # ~1.8k tokens
ABORTS = 'chatserve:request_success_total{finished_reason="abort",model_name="tiny"}'  # RealServer serves "tiny"
FIRST_TOKENS = 'chatserve:time_to_first_token_seconds_count{model_name="tiny"}'


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = RealServer(tiny_llama_dir, "--no-spec", "--max-num-seqs", "1", "--max-queued-requests", "1",
                     "--max-connections", "3", "--max-num-batched-tokens", "16", "--max-pending-output-bytes", "16K")
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def idle_after(server):
    yield
    wait_health(server.base, lambda h: h["num_connections"] == 0 and h["num_generations"] == 0, timeout=30)
    wait_pool_free(server.base)


def chat(ws, content: str, **params) -> None:
    ws.send(json.dumps({"type": "chat", "content": content, "params": {"temperature": 0, **params}}))


def test_a_client_that_never_reads_is_dropped_with_4008_and_its_turn_aborted(server):
    """The tiny model's replies decode to little text (1,900 tokens -> a few KB of deltas, less than
    the socket buffers hold), so while its turn runs the client also asks for 60 KB settings echoes,
    as a chatty client would, and reads nothing: the server must stop queueing, drop it, free the
    turn's blocks, and end the stream with close code 4008 for when the client does read."""
    aborts = server.metric(ABORTS)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the buffers fill fast
    sock.connect(("127.0.0.1", server.port))
    with connect(server.ws_url, sock=sock, max_queue=2) as ws:  # its reader thread stops after 2 frames
        assert json.loads(ws.recv(timeout=10))["type"] == "ready"
        chat(ws, "hi", max_tokens=1900, ignore_eos=True)
        wait_health(server.base, lambda h: h["num_running"] == 1)
        big_settings = json.dumps({"type": "settings", "params": {"stop": ["x" * 60_000]}})

        def flood() -> None:  # in a thread: once the server stops reading, send() blocks
            try:
                for _ in range(40):  # 2.4 MB of echoes asked for
                    ws.send(big_settings)
            except ConnectionClosed:
                pass

        threading.Thread(target=flood, daemon=True).start()
        # dropped, and its turn stopped: the connection is released just before the turn's abort is awaited
        # (websocket.py), so a /health between the two read 0 connections and 1 running (one CI run)
        health = wait_health(server.base, lambda h: h["num_connections"] == 0 and h["num_running"] == 0)
        assert health["num_generations"] == 0
        assert health["num_free_blocks"] == health["num_blocks"]  # the turn was aborted, its blocks freed
        assert server.metric(ABORTS) == aborts + 1
        with pytest.raises(ConnectionClosed) as closed:  # now read: what was sent, then the close frame
            while True:
                ws.recv(timeout=30)
        assert closed.value.rcvd is not None, "no close frame"
        assert closed.value.rcvd.code == 4008 and "slow reader" in closed.value.rcvd.reason
    with ws_connect(server.base) as ws:  # everyone else is still served
        chat(ws, "still there?", max_tokens=4)
        while json.loads(ws.recv(timeout=30))["type"] == "delta":
            pass


def test_max_connections_plus_one_is_refused_on_ws_and_http(server):
    with ws_connect(server.base) as a, ws_connect(server.base), ws_connect(server.base):
        with connect(server.ws_url) as extra:
            error = json.loads(extra.recv(timeout=10))
            assert error["type"] == "error" and error["code"] == "too_many_connections"
            with pytest.raises(ConnectionClosed) as closed:
                extra.recv(timeout=10)
            assert closed.value.rcvd.code == 1013
        response = httpx.post(server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503 and response.json()["error"]["code"] == "too_many_connections"
        assert response.headers["retry-after"] == "1"
        a.close()
        wait_health(server.base, lambda h: h["num_connections"] == 2)
        response = httpx.post(server.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 200, response.text  # a freed slot is usable at once


def test_a_burst_of_1000_http_requests_gets_429s_not_an_unbounded_queue(server):
    """1,000 concurrent completions against 2 generation slots (1 running + 1 queued): the rest are
    refused at once with 429 and Retry-After; every admitted one completes; the queue the engine
    sees never grows past the bound."""
    peaks = {"num_generations": 0, "num_waiting": 0}
    is_done = threading.Event()

    def watch() -> None:
        with httpx.Client() as http:
            while not is_done.is_set():
                health = http.get(server.base + "/health").json()
                for key in peaks:
                    peaks[key] = max(peaks[key], health[key])

    body = json.dumps({"prompt": "Count with me:", "max_tokens": 200, "ignore_eos": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    async def post() -> tuple[int, dict, dict]:  # raw sockets: an HTTP client costs more than the server
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request)
        head, _, payload = (await asyncio.wait_for(reader.read(), 120)).partition(b"\r\n\r\n")
        writer.close()
        lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        return int(lines[0].split()[1]), headers, json.loads(payload)

    async def burst() -> list[tuple[int, dict, dict]]:
        return await asyncio.gather(*(post() for _ in range(1000)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        responses = asyncio.run(burst())
    finally:
        is_done.set()
        watcher.join()
    refused = [(headers, body) for status, headers, body in responses if status == 429]
    admitted = [body for status, _, body in responses if status == 200]
    assert len(refused) + len(admitted) == 1000, {status for status, _, _ in responses}
    assert len(refused) >= 900  # ~2 + (burst seconds / generation seconds) get in
    for headers, body in refused:
        assert body["error"]["code"] == "queue_full" and headers["retry-after"] == "1"
    for body in admitted:
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 200
    assert peaks["num_generations"] <= 2 and peaks["num_waiting"] <= 1, peaks


def test_disconnect_during_a_long_prefill_frees_its_blocks(server):
    """Websocket and HTTP: the client leaves while its ~1.8k-token prompt is being prefilled
    (~115 steps of 16 tokens); the request is aborted before its first token."""
    first_tokens, aborts = server.metric(FIRST_TOKENS), server.metric(ABORTS)
    with ws_connect(server.base) as ws:
        chat(ws, LONG_PROMPT, max_tokens=50)
        wait_health(server.base, lambda h: h["num_running"] == 1 and h["num_free_blocks"] < h["num_blocks"])
    wait_pool_free(server.base)

    # another prompt: the first one's prefilled blocks are in the prefix cache, and a prefill starting from
    # them could end, with its 50 tokens, before /health was read (one clean-clone CI run, session 47)
    other = "Shorten this. " + LONG_PROMPT
    body = json.dumps({"messages": [{"role": "user", "content": other}], "max_tokens": 50}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_health(server.base, lambda h: h["num_running"] == 1 and h["num_free_blocks"] < h["num_blocks"])
    wait_pool_free(server.base)
    assert server.metric(ABORTS) == aborts + 2
    assert server.metric(FIRST_TOKENS) == first_tokens  # neither produced a token: aborted mid-prefill


def test_a_100mb_body_and_deep_json_are_refused_before_parsing(server):
    rss_before = server.rss_bytes()
    # Declared: answered from the headers, with 1 KB of the 100 MB sent.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n" + b"[" * 1024)
        sock.settimeout(10)
        answer = _read_response(sock)
    assert answer.startswith("HTTP/1.1 413") and "too_large" in answer
    # Chunked (no length): refused once the bytes read pass the 1 MiB limit, long before 100 MB.
    num_sent, answer = _send_chunked_until_answered(server.port, total=100 << 20)
    assert answer.startswith("HTTP/1.1 413") and "too_large" in answer
    assert num_sent < 20 << 20, num_sent
    assert server.rss_bytes() - rss_before < 50 << 20  # never held the body
    # Nested deeper than 32: refused before json.loads, on both routes; the connection stays usable.
    deep = "[" * 100_000 + "]" * 100_000
    response = httpx.post(server.base + "/v1/chat/completions", content=deep,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "too_deep"
    with ws_connect(server.base) as ws:
        ws.send('{"type": "chat", "messages": ' + "[" * 40 + "]" * 40 + "}")
        assert json.loads(ws.recv(timeout=10))["code"] == "too_deep"
        chat(ws, "ok?", max_tokens=2)
        while json.loads(ws.recv(timeout=30))["type"] == "delta":
            pass


def _send_chunked_until_answered(port: int, total: int) -> tuple[int, str]:
    """POST up to `total` bytes chunked (64 KiB chunks) until the server answers or stops reading."""
    chunk = b"[" * (64 << 10)
    frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    num_sent, pending = 0, b""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        sock.setblocking(False)
        while num_sent < total:
            readable, writable, _ = select.select([sock], [sock], [], 10)
            if readable or not writable:
                break  # an answer (or a close), or the server stopped reading
            pending = pending or frame
            try:
                n = sock.send(pending)
            except (BrokenPipeError, ConnectionResetError):
                break
            pending, num_sent = pending[n:], num_sent + n
        sock.setblocking(True)
        sock.settimeout(10)
        return num_sent, _read_response(sock)


def _read_response(sock: socket.socket) -> str:
    """One HTTP response with a Content-Length: its head and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return (head + b"\r\n\r\n" + body).decode(errors="replace")
