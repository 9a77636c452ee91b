"""Drive sessions against one running server: closed loop (N sessions at a time) or open loop
(Poisson session arrivals, optionally capped by max_concurrency), with a progress bar."""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field, replace

import httpx

from chatserve.bench.client import run_openai_session, run_ws_session, scrape_counters, server_info
from chatserve.bench.metrics import RequestRecord
from chatserve.bench.workloads import Conversation, Session, poisson_arrivals

ENDPOINTS = ("ws", "openai")


@dataclass(frozen=True)
class LoadSpec:
    """One load run. Exactly one of `concurrency` (closed loop) or `request_rate` (open loop)."""

    url: str
    endpoint: str
    sessions: tuple[Session, ...]
    settings: dict  # sampling settings sent with every turn (ws `params` / OpenAI body fields)
    concurrency: int | None = 1
    request_rate: float | None = None
    max_concurrency: int | None = None
    think_time_s: float = 0.0
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0
    num_warmup: int = 1

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("give exactly one of concurrency or request_rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")

    @property
    def num_requests(self) -> int:
        return sum(s.num_turns for s in self.sessions)


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float
    started_at: float  # unix time
    loadavg_before: tuple[float, float, float]
    loadavg_after: tuple[float, float, float]
    server: dict = field(default_factory=dict)  # model, draft (as the server reports them)
    server_counters: dict = field(default_factory=dict)  # /metrics counter increase during the run


def run_load(spec: LoadSpec, progress: bool = True, desc: str = "bench") -> LoadResult:
    return asyncio.run(_run_load(spec, progress, desc))


async def _run_load(spec: LoadSpec, progress: bool, desc: str) -> LoadResult:
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec.timeout_s, connect=30), limits=limits) as client:
        info = await server_info(client, spec.url, spec.api_key)
        await _warmup(spec, client)
        before = await scrape_counters(client, spec.url)
        records: list[RequestRecord] = []
        bar = tqdm(total=spec.num_requests, desc=desc, unit="req", disable=not progress, leave=False)

        def on_record(record: RequestRecord) -> None:
            records.append(record)
            bar.update(1)
            if record.error:
                bar.set_postfix(failed=sum(r.error is not None for r in records))

        loadavg_before, started_at, t0 = os.getloadavg(), time.time(), time.perf_counter()
        if spec.concurrency is not None:
            await _closed_loop(spec, client, on_record)
        else:
            await _open_loop(spec, client, on_record)
        duration = time.perf_counter() - t0
        bar.close()
        after = await scrape_counters(client, spec.url)
    counters = {k: after[k] - before.get(k, 0.0) for k in after}
    records.sort(key=lambda r: (r.session_idx, r.turn_idx))
    return LoadResult(records, duration, started_at, loadavg_before, os.getloadavg(), info, counters)


def _session_runner(spec: LoadSpec, client: httpx.AsyncClient):
    async def run(session: Session, on_record) -> None:
        rng = random.Random(spec.seed * 1_000_003 + session.session_idx)
        if spec.endpoint == "ws":
            await run_ws_session(spec.url, session, spec.settings, spec.think_time_s, rng, on_record,
                                 spec.api_key, spec.timeout_s)
        else:
            await run_openai_session(client, spec.url, session, spec.settings, spec.think_time_s, rng,
                                     on_record, spec.api_key)
    return run


async def _warmup(spec: LoadSpec, client: httpx.AsyncClient) -> None:
    """Short unrecorded turns so the first measured request does not pay for cold caches."""
    settings = {**spec.settings, "max_tokens": min(8, spec.settings.get("max_tokens", 8))}
    run = _session_runner(replace(spec, settings=settings), client)
    for i in range(spec.num_warmup):
        await run(Session(-1 - i, Conversation((f"Warm-up request {i}: say hello.",)), 1), lambda r: None)


async def _closed_loop(spec: LoadSpec, client: httpx.AsyncClient, on_record) -> None:
    """`concurrency` workers; each runs whole sessions, taking the next one when it finishes."""
    run = _session_runner(spec, client)
    queue = list(spec.sessions)[::-1]

    async def worker() -> None:
        while queue:
            await run(queue.pop(), on_record)

    await asyncio.gather(*(worker() for _ in range(min(spec.concurrency, len(spec.sessions)))))


async def _open_loop(spec: LoadSpec, client: httpx.AsyncClient, on_record) -> None:
    """Sessions start at Poisson arrival times whatever is still running (open loop); with
    max_concurrency, an arrival waits for a slot (its TTFT clock starts when it is sent)."""
    run = _session_runner(spec, client)
    arrivals = poisson_arrivals(len(spec.sessions), spec.request_rate, spec.seed)
    slots = asyncio.Semaphore(spec.max_concurrency or len(spec.sessions))
    t0 = time.perf_counter()

    async def arrive(session: Session, at: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        async with slots:
            await run(session, on_record)

    await asyncio.gather(*(arrive(s, at) for s, at in zip(spec.sessions, arrivals)))
