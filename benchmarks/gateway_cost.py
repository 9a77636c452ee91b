"""The /v1 gateway of `chatserve serve --replicas N`: what its hop costs, and whether `user` and
prompt-hash routing put a conversation's later turns where its prefix is.

Starts `chatserve serve --replicas N` (SmolLM2, one thread per replica), then
1. cost: GET /replica (proxy -> replica) against GET /v1/models (proxy -> gateway -> replica),
   both answered without the engine, alternated, --requests each; medians and p90.
2. affinity: --conversations OpenAI chat conversations of --turns turns, all at once, each turn
   a new HTTP request with the transcript so far; keyed by `user`, then with no key at all
   (prompt hash). A later turn is a prefix hit when its cached_tokens cover the previous
   turn's prompt in full blocks; the reply header x-chatserve-replica says where it ran.

    CHATSERVE_NO_CPU_KERNELS=1 .venv/bin/python benchmarks/gateway_cost.py \\
        --out benchmarks/results/gateway_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
BLOCK_SIZE = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "chatserve.cli", "serve", "--replicas", str(args.replicas), "--model", MODEL,
           "--kv-cache-memory", "256M", "--threads", "1", "--port", str(port)]
    out = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900
    while "chatserve: serving" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(2)
    return proc


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def hop_cost(url: str, n: int) -> dict:
    times: dict[str, list[float]] = {"direct /replica": [], "gateway /v1/models": []}
    with httpx.Client(timeout=60) as client:
        for i in range(n + 5):
            for name, path, params in (("direct /replica", "/replica", {"session": f"k{i % 8}"}),
                                       ("gateway /v1/models", "/v1/models", None)):
                start = time.perf_counter()
                client.get(url + path, params=params).raise_for_status()
                if i >= 5:  # warm-up
                    times[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"median_ms": round(statistics.median(ts), 2), "p90_ms": round(percentile(ts, 0.9), 2), "n": len(ts)}
            for name, ts in times.items()}


def first_message(k: int) -> str:
    return (f"Conversation {k}. I am writing a short field guide about plant number {k}. Tell me one fact about "
            f"where it grows, in one sentence, for readers who have never seen it before.")


async def conversation(client: httpx.AsyncClient, url: str, k: int, turns: int, user: str | None) -> list[dict]:
    messages = [{"role": "user", "content": first_message(k)}]
    rows = []
    for turn in range(turns):
        body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0}
        if user:
            body["user"] = user
        reply = await client.post(url + "/v1/chat/completions", json=body)
        reply.raise_for_status()
        data = reply.json()
        rows.append({"turn": turn, "replica": reply.headers.get("x-chatserve-replica"),
                     "prompt_tokens": data["usage"]["prompt_tokens"],
                     "cached_tokens": data["usage"]["prompt_tokens_details"]["cached_tokens"]})
        messages = [*messages, data["choices"][0]["message"], {"role": "user", "content": f"And turn {turn + 2}?"}]
    return rows


async def affinity(url: str, conversations: int, turns: int, keyed: bool) -> dict:
    async with httpx.AsyncClient(timeout=300) as client:
        runs = await asyncio.gather(*(conversation(client, url, k, turns, f"user-{k}" if keyed else None)
                                      for k in range(conversations)))
    later = [(rows[t - 1], rows[t]) for rows in runs for t in range(1, turns)]
    hits = sum(now["cached_tokens"] >= before["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE for before, now in later)
    same = sum(now["replica"] == before["replica"] for before, now in later)
    replicas = sorted({rows[0]["replica"] for rows in runs})
    return {"later_turns": len(later), "prefix_hits": hits, "same_replica": same,
            "hit_rate": round(hits / len(later), 3), "first_turn_replicas": {r: sum(rows[0]["replica"] == r for rows in runs)
                                                                           for r in replicas},
            "conversations": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    port = free_port()
    log = Path(f"/tmp/gateway_cost_{port}.log")
    proc = start(args, port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        cost = hop_cost(url, args.requests)
        for name, row in cost.items():
            print(f"{name:20s} median {row['median_ms']:6.2f} ms  p90 {row['p90_ms']:6.2f} ms  (n={row['n']})", flush=True)
        results = {"cost": cost}
        for name, keyed in (("user", True), ("prompt_hash", False)):
            row = asyncio.run(affinity(url, args.conversations, args.turns, keyed))
            results[name] = row
            print(f"{name:12s}: later turns {row['later_turns']}, prefix hits {row['prefix_hits']} ({row['hit_rate']:.0%}), "
                  f"same replica {row['same_replica']}, first turns per replica {row['first_turn_replicas']}", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"kind": "gateway-cost", "argv": sys.argv, "replicas": args.replicas,
                                        "loadavg": os.getloadavg(), **results}, indent=1))


if __name__ == "__main__":
    main()
