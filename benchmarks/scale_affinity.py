"""Conversation affinity and failover across chatserve replicas on Ray Serve, counted (no timing).

Deploys `--replicas` SmolLM2 replicas on a local Ray, three times over, fresh replicas each time:

1. affinity, 2. round robin: K conversations x T turns over /ws, each turn on a new connection
   carrying the whole transcript (a reloaded page, a reconnect, a stateless client: the case a
   router decides; within one open socket every turn stays on its replica anyway), keyed
   `?session=conv-k`. A later turn is a *prefix hit* when the replica's own `cached_tokens` (the
   `done` stats) cover the previous turn's prompt in full blocks, i.e. it landed where the
   conversation's prefix lives; the shared system prompt alone is not a hit.
2. failover: each conversation keeps one socket across its turns, like the web UI. While turn 2
   runs, the replica holding conversation 0 is SIGKILLed. A conversation whose socket closes
   reconnects with the same key and resends the turn with its transcript (what web/chat.js
   does). Counted: conversations that finished every turn, reconnects, turns resent, turns lost.
   Then /metrics: one page with a `replica` label per replica.

    CHATSERVE_NO_CPU_KERNELS=1 nice -n 19 .venv/bin/python benchmarks/scale_affinity.py \
        --conversations 16 --out benchmarks/results/scale_affinity.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import websockets

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BLOCK_SIZE = 16
METRICS_PUSH_PERIOD = 5.0  # chatserve.scale.ray_app's (not imported here: that imports ray)
TOPICS = ["paged memory", "sourdough", "tide pools", "compilers", "jazz chords", "glaciers", "chess openings",
          "bees", "lighthouses", "origami", "volcanoes", "typography", "rainforests", "orbits", "violins", "moss"]


@dataclass
class Conversation:
    key: str
    messages: list[dict] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # per turn: the replica's cached_tokens
    prompts: list[int] = field(default_factory=list)  # per turn: prompt_tokens
    num_reconnects: int = 0
    num_resent: int = 0  # turns interrupted by a lost socket and sent again
    num_lost: int = 0  # turns that never got their `done`


def first_message(k: int) -> str:
    topic = TOPICS[k % len(TOPICS)]
    return (f"Conversation {k}. I am writing a short field guide about {topic} for curious readers who "
            f"know nothing about it yet. Give me one surprising fact about {topic}, in one sentence.")


FOLLOW_UPS = ["Now explain why that is true, briefly.", "Summarize everything so far in five words."]


def user_message(k: int, turn: int) -> str:
    return first_message(k) if turn == 0 else FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]


def is_prefix_hit(conv: Conversation, turn: int) -> bool:
    """Turn `turn` found the previous turn's prompt (in full blocks) in its replica's cache."""
    return conv.cached[turn] >= conv.prompts[turn - 1] // BLOCK_SIZE * BLOCK_SIZE


async def chat_turn(ws, conv: Conversation, turn: int, max_tokens: int) -> None:
    """Send the transcript plus this turn's user message; wait for `done` (raises when the socket
    closes first). The reply joins the transcript."""
    messages = [*conv.messages, {"role": "user", "content": user_message(int(conv.key.split("-")[1]), turn)}]
    await ws.send(json.dumps({"type": "chat", "id": turn, "messages": messages,
                              "params": {"max_tokens": max_tokens, "temperature": 0}}))
    parts = []
    while True:
        message = json.loads(await ws.recv())
        if message["type"] == "delta":
            parts.append(message["text"])
        elif message["type"] == "error":
            raise RuntimeError(f"{conv.key} turn {turn}: {message}")
        elif message["type"] == "done":
            conv.cached.append(message["stats"].get("cached_tokens") or 0)
            conv.prompts.append(message["stats"]["prompt_tokens"])
            conv.messages = [*messages, {"role": "assistant", "content": "".join(parts)}]
            return


async def connect(url: str, conv: Conversation):
    ws_url = url.replace("http://", "ws://", 1)
    ws = await websockets.connect(f"{ws_url}/ws?session={conv.key}", open_timeout=60, max_size=None)
    ready = json.loads(await ws.recv())
    assert ready["type"] == "ready", ready
    return ws


async def run_reconnecting(url: str, conversations: list[Conversation], num_turns: int, max_tokens: int,
                           concurrency: int) -> None:
    """Each turn on a new connection (see the module docstring), `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(conv: Conversation, turn: int) -> None:
        async with gate:
            ws = await connect(url, conv)
            try:
                await chat_turn(ws, conv, turn, max_tokens)
            finally:
                await ws.close()

    for turn in range(num_turns):
        arrivals = random.Random(turn).sample(conversations, len(conversations))  # not in lockstep with RR
        await asyncio.gather(*(one(conv, turn) for conv in arrivals))


async def run_persistent(url: str, conversations: list[Conversation], num_turns: int, max_tokens: int,
                         on_turn_started=None, max_retries: int = 8) -> None:
    """One socket per conversation across its turns; a closed socket is reopened (same key) and the
    interrupted turn resent. `on_turn_started(turn)` is awaited once every conversation has sent
    that turn (the failover run kills a replica there)."""
    sockets = {conv.key: await connect(url, conv) for conv in conversations}

    async def turn_with_retries(conv: Conversation, turn: int, started: asyncio.Event) -> None:
        for attempt in range(max_retries + 1):
            try:
                task = asyncio.ensure_future(chat_turn(sockets[conv.key], conv, turn, max_tokens))
                await asyncio.sleep(0.05)
                started.set()
                await task
                return
            except (websockets.ConnectionClosed, OSError, asyncio.TimeoutError, RuntimeError):
                started.set()
                conv.num_resent += 1
                await asyncio.sleep(min(8.0, 0.5 * 2 ** attempt))
                try:
                    sockets[conv.key] = await connect(url, conv)
                    conv.num_reconnects += 1
                except Exception:
                    continue
        conv.num_lost += 1

    for turn in range(num_turns):
        events = [asyncio.Event() for _ in conversations]
        tasks = [asyncio.ensure_future(turn_with_retries(c, turn, e)) for c, e in zip(conversations, events)]
        await asyncio.gather(*(e.wait() for e in events))
        if on_turn_started is not None:
            await on_turn_started(turn)
        await asyncio.gather(*tasks)
    for ws in sockets.values():
        await ws.close()


def hit_counts(conversations: list[Conversation], num_turns: int) -> dict:
    second = [is_prefix_hit(c, 1) for c in conversations if len(c.cached) > 1]
    later = [is_prefix_hit(c, t) for c in conversations for t in range(1, min(num_turns, len(c.cached)))]
    prompt = sum(sum(c.prompts[1:]) for c in conversations)
    cached = sum(sum(c.cached[1:]) for c in conversations)
    return {"second_turn_hits": sum(second), "second_turns": len(second),
            "second_turn_hit_share": sum(second) / max(1, len(second)),
            "later_turn_hits": sum(later), "later_turns": len(later),
            "later_turn_cached_tokens": cached, "later_turn_prompt_tokens": prompt}


def deploy(args, policy: str, app_name: str) -> str:
    """Fresh replicas, configured as `chatserve serve` with these flags would configure them. Each
    phase needs its own `app_name`: Ray's proxy keeps one request router per deployment id, so a
    redeployed app of the same name would keep the previous phase's router (and its policy)."""
    from ray import serve

    from chatserve.cli import build_parser, engine_config, server_config
    from chatserve.scale.launch import build_app

    flags = build_parser().parse_args(["serve", "--model", args.model, "--kv-cache-memory", args.kv_cache_memory,
                                       "--threads", "1", "--port", str(args.port), *args.serve_flags])
    config = engine_config(flags)
    draft = None if not config.spec else (config.spec.draft_model or config.spec.method)
    serve.run(build_app(config, server_config(flags), args.replicas, draft, policy=policy), name=app_name,
              route_prefix="/")
    return f"http://127.0.0.1:{args.port}"


def replica_of(url: str, key: str) -> dict:
    return httpx.get(f"{url}/replica", params={"session": key}, timeout=30).json()


def metrics_replicas(url: str, family_name: str = "chatserve:prefix_cache_hits") -> dict[str, float]:
    """replica label -> the counter's value summed over its other labels, from the merged /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples if family.name == family_name else ():
            if sample.name.endswith("_total"):
                values[sample.labels["replica"]] = values.get(sample.labels["replica"], 0.0) + sample.value
    return values


def wait_for_replacement(url: str, killed: str, num_replicas: int, timeout: float = 600.0) -> dict[str, float]:
    """The merged /metrics once Ray has replaced the killed replica (`num_replicas` live labels) and
    the dead one's last page has aged out of the board."""
    deadline = time.monotonic() + timeout
    while True:
        hits = metrics_replicas(url)
        if len(hits) == num_replicas and killed not in hits or time.monotonic() > deadline:
            return hits
        time.sleep(5)


def conversations_for(args, tag: str) -> list[Conversation]:
    return [Conversation(f"{tag}-{k}") for k in range(args.conversations)]


async def failover_run(args, url: str) -> dict:
    conversations = conversations_for(args, "conv")
    victim = replica_of(url, conversations[0].key)  # conv-0's home, before any turn (it sticks)
    killed = {}

    async def kill_during_turn_2(turn: int) -> None:
        if turn == 1 and not killed:
            os.kill(victim["pid"], signal.SIGKILL)
            killed.update(victim)

    await run_persistent(url, conversations, args.turns, args.max_tokens, kill_during_turn_2)
    moved = [c for c in conversations if c.num_reconnects and len(c.cached) == args.turns]
    stayed = [c for c in conversations if not c.num_reconnects and len(c.cached) == args.turns]
    return {
        "killed_replica": killed.get("replica"),
        "conversations": len(conversations),
        "conversations_finished": sum(len(c.cached) == args.turns for c in conversations),
        "conversations_reconnected": sum(c.num_reconnects > 0 for c in conversations),
        "conversations_reconnected_once": sum(c.num_reconnects == 1 for c in conversations),
        "turns_resent": sum(c.num_resent for c in conversations),
        "turns_lost": sum(c.num_lost for c in conversations),
        "turns_done": sum(len(c.cached) for c in conversations),
        # the turn resent after the reconnect prefills again on the new home; the one after it should hit
        "moved_last_turn_hits": sum(is_prefix_hit(c, args.turns - 1) for c in moved),
        "moved_conversations": len(moved),
        "stayed_later_turn_hits": sum(is_prefix_hit(c, t) for c in stayed for t in range(1, args.turns)),
        "stayed_later_turns": len(stayed) * (args.turns - 1),
        "per_conversation": [{"key": c.key, "cached": c.cached, "prompt": c.prompts, "reconnects": c.num_reconnects}
                             for c in conversations],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight in the affinity and RR runs")
    p.add_argument("--kv-cache-memory", default="256M")
    p.add_argument("--serve-flags", nargs=argparse.REMAINDER, default=[], help="more `chatserve serve` flags")
    p.add_argument("--port", type=int, default=8019)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import ray

    ray.init(include_dashboard=False, logging_level="WARNING")
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    result = {"config": vars(args)}
    try:
        for policy in ("affinity", "round_robin"):
            url = deploy(args, policy, f"chatserve-{policy}")
            conversations = conversations_for(args, "conv")
            asyncio.run(run_reconnecting(url, conversations, args.turns, args.max_tokens, args.concurrency))
            result[policy] = hit_counts(conversations, args.turns)
            time.sleep(2 * METRICS_PUSH_PERIOD)  # every replica's page on the board
            result[policy]["requests_by_replica"] = metrics_replicas(url, "chatserve:request_success")
            print(f"{policy}: {json.dumps(result[policy])}", flush=True)
            serve.delete(f"chatserve-{policy}")
        url = deploy(args, "affinity", "chatserve-failover")
        result["failover"] = asyncio.run(failover_run(args, url))
        summary = {k: v for k, v in result["failover"].items() if k != "per_conversation"}
        print(f"failover: {json.dumps(summary)}", flush=True)
        result["metrics_prefix_hits_by_replica"] = wait_for_replacement(url, result["failover"]["killed_replica"],
                                                                        args.replicas)
        print(f"metrics: prefix-cache hits by replica label {result['metrics_prefix_hits_by_replica']}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
