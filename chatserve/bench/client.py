"""Benchmark clients: run one session (several chat turns on one connection) over the websocket
`/ws` or the OpenAI SSE endpoint, timestamping every chunk. One `RequestRecord` per turn, always.

Token counts per chunk: the websocket `delta` carries `num_tokens`, so ITL is exact. OpenAI SSE
chunks carry text only; the count comes from the final `usage` chunk and is spread evenly over the
chunks (`metrics.tokens_per_chunk`). TTFT, TPOT and E2E are exact on both endpoints.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Callable

import httpx

from chatserve.bench.metrics import RequestRecord
from chatserve.bench.workloads import Session, think_time

OnRecord = Callable[[RequestRecord], None]
_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
             "num_preemptions", "prefix_cache_queries", "prefix_cache_hits")


def _fail_rest(session: Session, first_turn: int, error: str, on_record: OnRecord) -> None:
    for turn in range(first_turn, session.num_turns):
        now = time.perf_counter()
        on_record(RequestRecord(session.session_idx, turn, start=now, end=now, error=error))


async def run_ws_session(url: str, session: Session, settings: dict, think_s: float, rng: random.Random,
                         on_record: OnRecord, api_key: str | None = None, timeout_s: float = 600.0) -> None:
    """One websocket connection; turn 1 (with the system prompt, if any) then `content` turns, so
    the server keeps the history and its prefix cache serves the earlier turns."""
    from websockets.asyncio.client import connect

    ws_url = url.replace("http://", "ws://").replace("https://", "wss://") + "/ws"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    turn = 0
    try:
        async with connect(ws_url, additional_headers=headers, max_size=None, ping_interval=None,
                           open_timeout=timeout_s) as ws:
            ready = json.loads(await ws.recv())
            if ready.get("type") != "ready":
                raise ConnectionError(f"{ready.get('code', 'no_ready')}: {ready.get('message', ready)}")
            conv = session.conversation
            for turn in range(session.num_turns):
                if turn:
                    await asyncio.sleep(think_time(think_s, rng))
                msg = {"type": "chat", "id": f"s{session.session_idx}-t{turn}", "params": settings}
                if turn == 0 and conv.system is not None:
                    msg["messages"] = [{"role": "system", "content": conv.system},
                                       {"role": "user", "content": conv.user_turns[0]}]
                else:
                    msg["content"] = conv.user_turns[turn]
                record = RequestRecord(session.session_idx, turn, start=time.perf_counter())
                await ws.send(json.dumps(msg))
                async with asyncio.timeout(timeout_s):
                    await _receive_ws_turn(ws, record)
                on_record(record)
        return
    except Exception as e:  # OSError, TimeoutError, websockets.ConnectionClosed, a refused handshake
        error = f"{type(e).__name__}: {e}"
    _fail_rest(session, turn, error, on_record)


async def _receive_ws_turn(ws, record: RequestRecord) -> None:
    while True:
        msg = json.loads(await ws.recv())
        now = time.perf_counter()
        kind = msg.get("type")
        if kind == "delta" and msg.get("num_tokens", 0) > 0:
            record.chunk_times.append(now)
            record.chunk_tokens.append(msg["num_tokens"])
        elif kind == "done":
            stats = msg.get("stats") or {}
            record.end, record.finish_reason, record.server_stats = now, msg.get("finish_reason"), stats
            record.num_generated = stats.get("generated_tokens") or sum(record.chunk_tokens)
            record.prompt_tokens, record.cached_tokens = stats.get("prompt_tokens"), stats.get("cached_tokens")
            return
        elif kind == "error":
            record.end, record.error = now, f"{msg.get('code')}: {msg.get('message')}"
            return


async def run_openai_session(client: httpx.AsyncClient, url: str, session: Session, settings: dict,
                             think_s: float, rng: random.Random, on_record: OnRecord,
                             api_key: str | None = None) -> None:
    """Streamed `/v1/chat/completions` turns; the client keeps the history and resends it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    conv = session.conversation
    history = [{"role": "system", "content": conv.system}] if conv.system is not None else []
    for turn in range(session.num_turns):
        if turn:
            await asyncio.sleep(think_time(think_s, rng))
        history.append({"role": "user", "content": conv.user_turns[turn]})
        body = {"messages": history, "stream": True, "stream_options": {"include_usage": True}, **settings}
        record = RequestRecord(session.session_idx, turn, start=time.perf_counter(), chunk_tokens=None)
        try:
            text = await _stream_openai_turn(client, url, body, headers, record)
        except (httpx.HTTPError, OSError, ValueError) as e:
            record.end, record.error = time.perf_counter(), f"{type(e).__name__}: {e}"
            text = None
        on_record(record)
        if text is None:
            history.pop()  # a failed turn does not join the conversation
        else:
            history.append({"role": "assistant", "content": text})


async def _stream_openai_turn(client: httpx.AsyncClient, url: str, body: dict, headers: dict,
                              record: RequestRecord) -> str | None:
    parts = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            err = json.loads(await resp.aread()).get("error", {})
            record.end, record.error = time.perf_counter(), f"{err.get('code', resp.status_code)}: {err.get('message')}"
            return None
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            now, data = time.perf_counter(), line[len("data: "):]
            if data == "[DONE]":
                record.end = now
                break
            obj = json.loads(data)
            if "error" in obj:
                record.end, record.error = now, f"{obj['error'].get('code')}: {obj['error'].get('message')}"
                return None
            for choice in obj.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    record.chunk_times.append(now)
                    parts.append(content)
                record.finish_reason = choice.get("finish_reason") or record.finish_reason
            if obj.get("usage"):
                usage = obj["usage"]
                record.num_generated, record.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if record.end is None:
        record.end, record.error = time.perf_counter(), "stream_ended: no [DONE]"
        return None
    return "".join(parts)


async def scrape_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The server's speculation / prefix-cache / preemption counters from /metrics ({} if absent)."""
    try:
        text = (await client.get(url + "/metrics", timeout=10)).text
    except httpx.HTTPError:
        return {}
    out = {}
    for name in _COUNTERS:
        m = re.search(rf"^chatserve:{name}_total(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
        if m:
            out[name] = float(m.group(1))
    return out


async def server_info(client: httpx.AsyncClient, url: str, api_key: str | None = None) -> dict:
    """Model and draft the server reports (from /v1/models and /health); {} fields if unavailable."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    info = {}
    try:
        models = (await client.get(url + "/v1/models", headers=headers, timeout=10)).json()["data"][0]
        info.update(model=models["id"], max_model_len=models.get("max_model_len"))
        health = (await client.get(url + "/health", timeout=10)).json()
        info.update(draft=health.get("draft"), num_blocks=health.get("num_blocks"))
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        pass
    return info
