"""Two SmolLM2 replicas behind Ray Serve (`chatserve serve --replicas 2`): affinity and failover.

Outside the default suite (marker `scale`; needs pip install -e .[scale] and the SmolLM2 weights):

    CHATSERVE_NO_CPU_KERNELS=1 .venv/bin/python -m pytest -q -m scale tests/scale/test_ray_replicas.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")
websockets = pytest.importorskip("websockets")

pytestmark = pytest.mark.scale
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 600  # two engines loading on a busy 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("scale") / "serve.log"
    cmd = [sys.executable, "-m", "chatserve.cli", "serve", "--replicas", "2", "--model", "smollm2-135m-instruct",
           "--kv-cache-memory", "256M", "--threads", "1", "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while "chatserve: serving" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "replicas did not start in time"
            time.sleep(2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)  # serve.shutdown + ray.shutdown
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _chat(url: str, session: str, messages: list[dict]) -> dict:
    body = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": session}, timeout=120)
    reply.raise_for_status()
    return reply.json()


def _replica(url: str, session: str) -> dict:
    return httpx.get(f"{url}/replica", params={"session": session}, timeout=30).json()


async def _ws_turn(url: str, session: str, messages: list[dict]) -> dict:
    async with websockets.connect(f"{url.replace('http', 'ws', 1)}/ws?session={session}", open_timeout=60) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        await ws.send(json.dumps({"type": "chat", "id": 1, "messages": messages,
                                  "params": {"max_tokens": 8, "temperature": 0}}))
        while True:
            message = json.loads(await ws.recv())
            if message["type"] in ("done", "error"):
                return message


def _messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Tell me one fact about {topic}, for a field guide for complete "
                                        f"beginners who have never heard of {topic} before today."}]


def test_sessions_stick_to_their_replica_and_spread(server):
    homes = {s: _replica(server, s)["replica"] for s in (f"key-{i}" for i in range(16))}
    # new keys go to the least loaded; idle replicas tie, and the tie-break hash spreads the keys
    # (all 16 on one replica: probability 2^-15)
    assert len(set(homes.values())) == 2
    assert all(_replica(server, s)["replica"] == home for s, home in homes.items())


def test_http_session_header_second_turn_hits_the_prefix(server):
    first = _chat(server, "http-conv", _messages("moss"))
    prompt_tokens = first["usage"]["prompt_tokens"]
    messages = [*_messages("moss"), first["choices"][0]["message"], {"role": "user", "content": "Why?"}]
    for _ in range(3):  # whichever replica is asked first, the key keeps coming back to it
        second = _chat(server, "http-conv", messages)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens // 16 * 16


def _gateway_chat(url: str, body: dict) -> httpx.Response:
    reply = httpx.post(f"{url}/v1/chat/completions", json={"model": "smollm2-135m-instruct", "max_tokens": 8,
                                                          "temperature": 0, **body}, timeout=120)
    reply.raise_for_status()
    return reply


def test_gateway_routes_by_user_and_by_prompt(server):
    """/v1 goes through the gateway, which reads the body: the same `user` always lands on one
    replica (the reply names it), users spread over both, and a conversation sent with no key at
    all finds its prefix on its second turn."""
    homes: dict[str, set] = {}
    for user in [f"user-{i}" for i in range(8)] * 2:
        reply = _gateway_chat(server, {"user": user, "messages": _messages("ferns")})
        homes.setdefault(user, set()).add(reply.headers["x-chatserve-replica"])
    assert all(len(replicas) == 1 for replicas in homes.values()), homes
    assert len({r for replicas in homes.values() for r in replicas}) == 2, homes  # 8 users on one: p = 2^-7
    for topic in ("lichens", "tides", "comets"):
        first = _gateway_chat(server, {"messages": _messages(topic)})
        messages = [*_messages(topic), first.json()["choices"][0]["message"], {"role": "user", "content": "Why?"}]
        second = _gateway_chat(server, {"messages": messages})
        assert second.headers["x-chatserve-replica"] == first.headers["x-chatserve-replica"]
        prompt_tokens = first.json()["usage"]["prompt_tokens"]
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens // 16 * 16


def test_metrics_from_both_replicas(server):
    time.sleep(6)  # each replica pushes its page every 5 s
    text = httpx.get(f"{server}/metrics", timeout=30).text
    replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("chatserve:prefix_cache_hits_total{")}
    assert len(replicas) == 2


def test_killed_replica_conversation_continues_after_one_reconnect(server):
    messages = _messages("glaciers")
    first = asyncio.run(_ws_turn(server, "ws-conv", messages))
    assert first["type"] == "done"
    victim = _replica(server, "ws-conv")
    os.kill(victim["pid"], signal.SIGKILL)
    # the web UI reconnects and resends the transcript; the first tries may still meet the dead replica
    deadline, reply = time.monotonic() + 120, None
    while reply is None or reply["type"] != "done":
        assert time.monotonic() < deadline, reply
        try:
            reply = asyncio.run(_ws_turn(server, "ws-conv", [*messages, {"role": "assistant", "content": "ok"},
                                                              {"role": "user", "content": "More?"}]))
        except (websockets.ConnectionClosed, OSError, websockets.InvalidStatus) as e:
            reply = {"type": "closed", "error": repr(e)}
            time.sleep(1)
    assert _replica(server, "ws-conv")["pid"] != victim["pid"]  # re-homed, and it sticks there
    # Ray starts a replacement: two live replicas again, the dead one not among them
    deadline = time.monotonic() + START_TIMEOUT
    for attempt in range(10**6):  # new keys each time: old ones stick to the survivor
        pids = {_replica(server, f"probe-{attempt}-{i}")["pid"] for i in range(8)}
        if len(pids) == 2 and victim["pid"] not in pids:
            break
        assert time.monotonic() < deadline, pids
        time.sleep(5)


def test_web_ui_through_the_proxy(server):
    page = httpx.get(f"{server}/", timeout=30)
    assert page.status_code == 200 and "<html" in page.text.lower()
    script = httpx.get(f"{server}/connection.js", timeout=30)
    assert "?session=" in script.text  # the UI's per-tab key, which the router reads
