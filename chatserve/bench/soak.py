"""A soak: many clients, many turns, misbehaving at random, against one server; then the checks
that say it survived (issue #15).

N clients share M requests. Each runs conversations of a few turns over the websocket `/ws` or
streamed `/v1/chat/completions` (the client keeps the history there). Every request is one of:

- healthy: a chat turn read to its `done` (websocket) or `[DONE]` (SSE);
- cancel: websocket `cancel` after 0-3 deltas (0: sent right behind the chat, during the prefill),
  read to its `done`; a turn that ended before the cancel was due gets none;
  on `/v1` a cancel is a stream closed mid-way, as an OpenAI client does it;
- drop: the connection closed (or its transport aborted) mid-turn, no answer expected;
- bad: malformed JSON, a binary frame, a frame over the size limit or a prompt over the context,
  each of which must get its error (websocket `error`; HTTP 4xx with an error body) while the
  connection stays usable.

A request that should have been answered and was not (a timeout, a closed connection, an
unexpected error) is *unanswered*. At the end the soak checks that the KV pool is all free
(`/health`), that the server's resident memory (VmRSS of its pid) at the end is at most
`max_rss_ratio` x what it was after the first `baseline_requests`, that no request went
unanswered and that the server still answers a plain turn on both endpoints.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field

import httpx

from chatserve.bench.workloads import builtin_conversations
from chatserve.protocol import QUEUE_FULL

KINDS = ("healthy", "cancel", "drop", "bad")
BAD_KINDS = ("malformed", "binary", "oversized_frame", "oversized_prompt")
FOLLOW_UPS = ("Tell me more.", "Can you give an example?", "Shorter, please.", "Why is that?",
              "Now say it as a list.", "And the next part?")
RETRY_CODES = ("too_many_connections", "overloaded", "server_busy")  # refused for load: the client retries
MAX_TURN_RETRIES = 30  # a turn refused with queue_full is sent again at most this often


@dataclass(frozen=True)
class SoakPlan:
    url: str
    num_clients: int = 64
    num_requests: int = 10_000
    cancel_rate: float = 0.15
    drop_rate: float = 0.07
    bad_rate: float = 0.15
    openai_rate: float = 0.3  # share of conversations over /v1/chat/completions (the rest: /ws)
    max_turns: int = 4
    max_tokens: int = 32
    max_message_bytes: int = 1 << 20  # the server's limit: an oversized frame is 1.5x this
    seed: int = 0
    baseline_requests: int = 500  # resident memory is sampled after this many requests, and at the end
    max_rss_ratio: float = 1.2
    timeout_s: float = 600.0  # per request (queueing included: 64 clients on 2 cores wait minutes)
    progress_every: int = 250

    def __post_init__(self):
        if self.cancel_rate + self.drop_rate + self.bad_rate > 1:
            raise ValueError("cancel_rate + drop_rate + bad_rate must be <= 1")
        if self.num_clients < 1 or self.num_requests < 1:
            raise ValueError("num_clients and num_requests must be >= 1")


@dataclass
class Outcome:
    """One request: what was tried, whether it got the answer it should have, and when."""

    kind: str  # KINDS
    endpoint: str  # "ws" | "openai"
    detail: str = ""  # the bad kind, "abort"/"close" for drops, "prefill"/"after N" (deltas) for cancels
    answered: bool = False
    error: str | None = None
    ttft_s: float | None = None  # healthy turns: first text
    total_s: float | None = None  # healthy turns: whole turn


@dataclass
class SoakResult:
    outcomes: list[Outcome] = field(default_factory=list)
    rss_samples: list[tuple[int, int]] = field(default_factory=list)  # (requests done, VmRSS bytes)
    rss_baseline_bytes: int | None = None
    rss_end_bytes: int | None = None
    health_end: dict = field(default_factory=dict)
    final_turns_ok: bool = False
    server_alive: bool = False
    num_retries: int = 0  # connections refused for load and tried again
    connect_errors: list[str] = field(default_factory=list)  # conversations that never got a connection
    duration_s: float = 0.0

    @property
    def unanswered(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind != "drop" and not o.answered]

    @property
    def pool_free(self) -> bool:
        h = self.health_end
        return bool(h) and h.get("num_free_blocks") == h.get("num_blocks") and h.get("num_running") == 0

    def rss_ratio(self) -> float | None:
        if not self.rss_baseline_bytes or not self.rss_end_bytes:
            return None
        return self.rss_end_bytes / self.rss_baseline_bytes

    def checks(self, plan: SoakPlan) -> dict[str, bool]:
        ratio = self.rss_ratio()
        return {"pool_all_free": self.pool_free,
                "rss_bounded": ratio is not None and ratio <= plan.max_rss_ratio,
                "all_answered": not self.unanswered and not self.connect_errors,
                "server_alive": self.server_alive and self.final_turns_ok}

    def summary(self, plan: SoakPlan) -> dict:
        healthy = [o for o in self.outcomes if o.kind == "healthy" and o.answered]
        ttft = sorted(o.ttft_s for o in healthy if o.ttft_s is not None)
        total = sorted(o.total_s for o in healthy if o.total_s is not None)
        counts = {f"{k}_{e}": sum(o.kind == k and o.endpoint == e for o in self.outcomes)
                  for k in KINDS for e in ("ws", "openai")}
        ratio = self.rss_ratio()
        return {
            "num_requests": len(self.outcomes), "duration_s": round(self.duration_s, 1), "counts": counts,
            "num_unanswered": len(self.unanswered), "unanswered_examples": [asdict(o) for o in self.unanswered[:10]],
            "num_retries": self.num_retries, "connect_errors": self.connect_errors[:10],
            "ttft_ms": {"p50": _ms(_pct(ttft, 50)), "p99": _ms(_pct(ttft, 99))},
            "total_ms": {"p50": _ms(_pct(total, 50)), "p99": _ms(_pct(total, 99))},
            "rss_baseline_mib": _mib(self.rss_baseline_bytes), "rss_end_mib": _mib(self.rss_end_bytes),
            "rss_ratio": None if ratio is None else round(ratio, 3),
            "rss_samples_mib": [(n, _mib(b)) for n, b in self.rss_samples],
            "health_end": self.health_end, "checks": self.checks(plan),
        }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def _ms(s: float | None) -> float | None:
    return None if s is None else round(1000 * s, 1)


def _mib(b: int | None) -> float | None:
    return None if b is None else round(b / 2**20, 1)


def read_rss(pid: int | None) -> int | None:
    """VmRSS of `pid` in bytes (Linux), or None."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _Refused(Exception):
    """The server refused a connection for load (it said so); the client waits and tries again."""


class Soak:
    """The shared state of one run: tickets (requests left), outcomes, RSS samples."""

    def __init__(self, plan: SoakPlan, server_pid: int | None, progress=print):
        self.plan, self.pid, self.progress = plan, server_pid, progress
        self.result = SoakResult()
        self.num_issued = 0
        self.max_model_len = 8192
        self.prompts = [c.user_turns for c in builtin_conversations(("chat", "code", "edit", "multiturn"))]
        self.started = time.perf_counter()

    # -- bookkeeping -----------------------------------------------------------------------
    def take_ticket(self) -> bool:
        if self.num_issued >= self.plan.num_requests:
            return False
        self.num_issued += 1
        return True

    def record(self, outcome: Outcome) -> None:
        result, plan = self.result, self.plan
        result.outcomes.append(outcome)
        n = len(result.outcomes)
        if outcome.kind != "drop" and not outcome.answered:  # said at once: a long run may never reach its end
            self.progress(f"soak: unanswered {outcome.kind}/{outcome.endpoint} {outcome.detail}: {outcome.error}")
        if n == plan.baseline_requests:
            result.rss_baseline_bytes = read_rss(self.pid)
        if n % plan.progress_every == 0 or n == plan.baseline_requests:
            rss = read_rss(self.pid)
            if rss is not None:
                result.rss_samples.append((n, rss))
            elapsed = time.perf_counter() - self.started
            self.progress(f"soak: {n}/{plan.num_requests} requests, {elapsed:.0f} s, {n / elapsed:.1f} req/s, "
                          f"unanswered {len(result.unanswered)}, retries {result.num_retries}, "
                          f"rss {_mib(rss)} MiB")

    def pick_kind(self, rng: random.Random) -> str:
        plan, x = self.plan, rng.random()
        for kind, rate in (("cancel", plan.cancel_rate), ("drop", plan.drop_rate), ("bad", plan.bad_rate)):
            if x < rate:
                return kind
            x -= rate
        return "healthy"

    def user_text(self, rng: random.Random, turn: int) -> str:
        turns = rng.choice(self.prompts)
        return turns[turn] if turn < len(turns) else rng.choice(FOLLOW_UPS)

    def params(self, rng: random.Random) -> dict:
        return {"max_tokens": rng.randint(max(1, self.plan.max_tokens // 4), self.plan.max_tokens),
                "temperature": rng.choice((0.0, 0.7))}

    # -- clients ---------------------------------------------------------------------------
    async def client(self, idx: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(self.plan.seed * 100_003 + idx)
        while self.num_issued < self.plan.num_requests:
            num_turns = rng.randint(1, self.plan.max_turns)
            try:
                if rng.random() < self.plan.openai_rate:
                    await self.openai_conversation(rng, http, num_turns)
                else:
                    await self.ws_conversation(rng, num_turns)
            except _Refused:
                self.result.num_retries += 1
                await asyncio.sleep(0.2 + rng.random())
            except Exception as e:  # could not connect at all (outcomes inside a conversation are recorded there)
                self.result.connect_errors.append(f"{type(e).__name__}: {e}")
                await asyncio.sleep(1.0)

    async def ws_conversation(self, rng: random.Random, num_turns: int) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidStatus

        url = self.plan.url.replace("http://", "ws://").replace("https://", "wss://") + "/ws"
        try:
            ws = await connect(url, max_size=None, ping_interval=None, open_timeout=self.plan.timeout_s,
                               close_timeout=5)
        except InvalidStatus as e:  # refused before the upgrade
            if e.response.status_code in (429, 503):
                raise _Refused(str(e.response.status_code)) from None
            raise
        try:
            ready = json.loads(await ws.recv())
            if ready.get("type") != "ready":
                if ready.get("code") in RETRY_CODES:
                    raise _Refused(ready.get("code"))
                raise ConnectionError(f"no ready: {ready}")
            self.max_model_len = ready.get("max_model_len") or self.max_model_len
            for turn in range(num_turns):
                if not self.take_ticket():
                    return
                kind = self.pick_kind(rng)
                outcome = Outcome(kind, "ws")
                try:
                    async with asyncio.timeout(self.plan.timeout_s):
                        is_open = await self.ws_request(ws, rng, turn, outcome)
                except Exception as e:  # timeout, closed connection: unanswered unless it was a drop
                    outcome.error = outcome.error or f"{type(e).__name__}: {e}"
                    is_open = False
                self.record(outcome)
                if not is_open:
                    return
        finally:
            with suppress(Exception):
                await ws.close()

    async def ws_request(self, ws, rng: random.Random, turn: int, outcome: Outcome) -> bool:
        """One request on an open websocket; returns whether the connection is still usable."""
        turn_id = f"t{self.num_issued}"
        if outcome.kind == "bad":
            outcome.detail = rng.choice(BAD_KINDS)
            frame, expected = self.bad_ws_frame(outcome.detail)
            msg = await self._send(ws, frame, rng)
            outcome.answered = msg.get("type") == "error" and msg.get("code") in expected
            if not outcome.answered:
                outcome.error = f"expected {expected}, got {msg}"
            return True
        chat = {"type": "chat", "id": turn_id, "content": self.user_text(rng, turn), "params": self.params(rng)}
        start = time.perf_counter()
        num_deltas = rng.randint(0, 3)
        cancel = json.dumps({"type": "cancel", "id": turn_id})
        if outcome.kind == "cancel" and num_deltas == 0:  # the cancel right behind the chat: during the prefill
            outcome.detail = "prefill"
            msg = await self._send(ws, json.dumps(chat), rng, then=cancel)
            return await self._read_cancelled(ws, outcome, msg)
        msg = await self._send(ws, json.dumps(chat), rng)
        if outcome.kind == "healthy":
            return await self._read_turn(ws, outcome, start, msg)
        for i in range(max(num_deltas, 1)):
            msg = msg if i == 0 else json.loads(await ws.recv())
            if msg.get("type") != "delta":  # finished (or failed) before the cancel/drop: no cancel to send
                outcome.answered = msg.get("type") == "done"
                outcome.error = None if outcome.answered else f"unexpected {msg}"
                return True
        if outcome.kind == "drop":
            outcome.detail = rng.choice(("close", "abort"))
            if outcome.detail == "abort":
                ws.transport.abort()  # a vanished client: no close frame
            else:
                await ws.close()
            return False
        outcome.detail = f"after {num_deltas}"
        await ws.send(cancel)
        return await self._read_cancelled(ws, outcome, json.loads(await ws.recv()))

    async def _read_cancelled(self, ws, outcome: Outcome, msg: dict) -> bool:
        """Read a cancelled turn to its end: one `done` ("abort", or "stop"/"length" if the reply
        finished before the cancel reached the server, which then answers the cancel with nothing)."""
        while msg.get("type") == "delta":
            msg = json.loads(await ws.recv())
        outcome.answered = msg.get("type") == "done"
        outcome.error = None if outcome.answered else f"unexpected {msg}"
        return True

    async def _send(self, ws, frame: str | bytes, rng: random.Random, then: str | None = None) -> dict:
        """Send a frame (and `then` right behind it, unanswered if the frame is refused) and return
        the first answer; a turn refused for load (queue_full: every generation slot taken, e.g. by
        dropped clients not yet noticed) is sent again after a pause, as a client should, and
        counted as a retry."""
        for _ in range(MAX_TURN_RETRIES):
            await ws.send(frame)
            if then is not None:
                await ws.send(then)
            msg = json.loads(await ws.recv())
            if msg.get("type") != "error" or msg.get("code") != QUEUE_FULL:
                return msg
            self.result.num_retries += 1
            await asyncio.sleep(0.2 + rng.random())
        return msg

    async def _read_turn(self, ws, outcome: Outcome, start: float, msg: dict) -> bool:
        while True:
            kind = msg.get("type")
            if kind == "delta":
                if outcome.ttft_s is None and msg.get("text"):
                    outcome.ttft_s = time.perf_counter() - start
                msg = json.loads(await ws.recv())
                continue
            outcome.total_s = time.perf_counter() - start
            outcome.answered = kind == "done" and msg.get("finish_reason") in ("stop", "length")
            outcome.error = None if outcome.answered else f"unexpected {msg}"
            return True

    def bad_ws_frame(self, bad: str) -> tuple[str | bytes, tuple[str, ...]]:
        """A frame the server must refuse, and the error codes that say it did."""
        if bad == "malformed":
            return '{"type": "chat", "content": "unterminated', ("bad_json",)
        if bad == "binary":
            return b"\x00\x01binary\xff", ("binary_frame",)
        if bad == "oversized_frame":
            return json.dumps({"type": "chat", "content": "x" * (3 * self.plan.max_message_bytes // 2)}), ("too_large",)
        return json.dumps({"type": "chat", "content": self.oversized_prompt(), "params": {"max_tokens": 4}}), (
            "prompt_too_long", "invalid_prompt")

    def oversized_prompt(self) -> str:
        return "hello " * (self.max_model_len + 64)  # one token a word: over the context

    async def openai_conversation(self, rng: random.Random, http: httpx.AsyncClient, num_turns: int) -> None:
        history: list[dict] = []
        for turn in range(num_turns):
            if not self.take_ticket():
                return
            kind = self.pick_kind(rng)
            if kind == "cancel":
                kind = "drop"  # an OpenAI client cancels by closing the stream
            outcome = Outcome(kind, "openai")
            try:
                async with asyncio.timeout(self.plan.timeout_s):
                    await self.openai_request(http, rng, turn, history, outcome)
            except _Refused:
                self.num_issued -= 1  # not a request: give the ticket back and retry
                raise
            except Exception as e:
                outcome.error = outcome.error or f"{type(e).__name__}: {e}"
            self.record(outcome)

    async def openai_request(self, http: httpx.AsyncClient, rng: random.Random, turn: int, history: list[dict],
                             outcome: Outcome) -> None:
        url = self.plan.url + "/v1/chat/completions"
        if outcome.kind == "bad":
            outcome.detail = rng.choice(BAD_KINDS)
            resp = await http.post(url, content=self.bad_openai_body(outcome.detail),
                                   headers={"content-type": "application/json"})
            if resp.status_code in (429, 503):
                raise _Refused(str(resp.status_code))
            is_error = 400 <= resp.status_code < 500 and "error" in _json_or_empty(resp)
            outcome.answered = is_error
            outcome.error = None if is_error else f"HTTP {resp.status_code}: {resp.text[:200]}"
            return
        user = {"role": "user", "content": self.user_text(rng, turn)}
        body = {"messages": [*history, user], "stream": True, **self.params(rng)}
        num_chunks = rng.randint(0, 3)
        start, parts = time.perf_counter(), []
        async with http.stream("POST", url, json=body) as resp:
            if resp.status_code in (429, 503):
                raise _Refused(str(resp.status_code))
            if resp.status_code != 200:
                outcome.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if outcome.kind == "drop" and len(parts) >= num_chunks:
                    outcome.detail = "close"
                    return  # leaving the `with` closes the stream mid-way
                data = line[len("data: "):]
                if data == "[DONE]":
                    outcome.total_s = time.perf_counter() - start
                    outcome.answered = True
                    history += [user, {"role": "assistant", "content": "".join(parts)}]
                    return
                obj = json.loads(data)
                if "error" in obj:
                    outcome.error = f"stream error: {obj['error']}"
                    return
                for choice in obj.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        parts.append(text)
                        if outcome.ttft_s is None:
                            outcome.ttft_s = time.perf_counter() - start
        outcome.error = outcome.error or "stream ended without [DONE]"

    def bad_openai_body(self, bad: str) -> bytes:
        if bad == "malformed":
            return b'{"messages": [{"role": "user", "content": "unterminated'
        if bad == "binary":
            return b"\x00\x01binary\xff\xfe"
        if bad == "oversized_frame":
            return json.dumps({"messages": [{"role": "user", "content": "x" * (3 * self.plan.max_message_bytes // 2)}]}).encode()
        return json.dumps({"messages": [{"role": "user", "content": self.oversized_prompt()}], "max_tokens": 4}).encode()

    # -- the end ---------------------------------------------------------------------------
    async def finish(self, http: httpx.AsyncClient) -> None:
        """Wait for the pool to drain, sample RSS, check the server still answers on both endpoints."""
        result = self.result
        deadline = time.monotonic() + 120
        while True:
            try:
                result.health_end = (await http.get(self.plan.url + "/health", timeout=10)).json()
            except (httpx.HTTPError, ValueError) as e:
                result.health_end = {"error": f"{type(e).__name__}: {e}"}
            if result.pool_free or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        result.rss_end_bytes = read_rss(self.pid)
        rng = random.Random(self.plan.seed)
        final = [Outcome("healthy", "ws"), Outcome("healthy", "openai")]
        try:
            from websockets.asyncio.client import connect

            async with asyncio.timeout(self.plan.timeout_s):
                async with connect(self.plan.url.replace("http://", "ws://") + "/ws", ping_interval=None) as ws:
                    await ws.recv()
                    start = time.perf_counter()
                    msg = await self._send(ws, json.dumps({"type": "chat", "content": "Still there?",
                                                           "params": {"max_tokens": 8}}), rng)
                    await self._read_turn(ws, final[0], start, msg)
                await self.openai_request(http, rng, 0, [], final[1])
        except Exception as e:
            final[0].error = f"{type(e).__name__}: {e}"
        result.final_turns_ok = all(o.answered for o in final)
        try:
            result.server_alive = (await http.get(self.plan.url + "/health", timeout=10)).status_code == 200
        except httpx.HTTPError:
            result.server_alive = False


def _json_or_empty(resp: httpx.Response) -> dict:
    try:
        obj = resp.json()
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


async def run_soak_async(plan: SoakPlan, server_pid: int | None, progress=print) -> SoakResult:
    soak = Soak(plan, server_pid, progress)
    limits = httpx.Limits(max_connections=plan.num_clients + 8, max_keepalive_connections=plan.num_clients)
    async with httpx.AsyncClient(timeout=plan.timeout_s, limits=limits) as http:
        await asyncio.gather(*(soak.client(i, http) for i in range(plan.num_clients)))
        soak.result.duration_s = time.perf_counter() - soak.started
        await soak.finish(http)
    return soak.result


def run_soak(plan: SoakPlan, server_pid: int | None, progress=print) -> SoakResult:
    return asyncio.run(run_soak_async(plan, server_pid, progress))


# -- command line ------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--url", default=None, help="a running server (default: start `chatserve serve` for --model)")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, to read its VmRSS")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model of the server the soak starts")
    p.add_argument("--server-args", default="--draft ngram", help="more `chatserve serve` arguments")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--cancel-rate", type=float, default=0.15)
    p.add_argument("--drop-rate", type=float, default=0.07)
    p.add_argument("--bad-rate", type=float, default=0.15)
    p.add_argument("--openai-rate", type=float, default=0.3, help="share of conversations over /v1 (SSE)")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--baseline-requests", type=int, default=500, help="RSS baseline after this many requests")
    p.add_argument("--max-rss-ratio", type=float, default=1.2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request, queueing included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the summary as JSON here")


def main(args) -> int:
    """Run the soak (starting a server unless --url), print the summary; exit status 1 if a check failed."""
    import shlex
    from contextlib import nullcontext
    from pathlib import Path

    from chatserve.bench.sweep import ServerProcess

    server = nullcontext() if args.url else ServerProcess(args.model, shlex.split(args.server_args))
    with server as proc:
        url, pid = (args.url, args.pid) if args.url else (proc.url, proc.proc.pid)
        plan = SoakPlan(url=url, num_clients=args.clients, num_requests=args.requests, cancel_rate=args.cancel_rate,
                        drop_rate=args.drop_rate, bad_rate=args.bad_rate, openai_rate=args.openai_rate,
                        max_turns=args.max_turns, max_tokens=args.max_tokens, seed=args.seed,
                        baseline_requests=args.baseline_requests, max_rss_ratio=args.max_rss_ratio,
                        timeout_s=args.timeout)
        print(f"soak: {plan.num_requests} requests, {plan.num_clients} clients against {url} (pid {pid}), "
              f"rss at start {_mib(read_rss(pid))} MiB", flush=True)
        result = run_soak(plan, pid, progress=lambda line: print(line, flush=True))
        summary = {"plan": asdict(plan), "server_args": None if args.url else proc.cmd, **result.summary(plan)}
        if not args.url and result.unanswered:
            summary["server_log_tail"] = proc.log_tail()
    print(json.dumps({k: v for k, v in summary.items() if k not in ("plan", "rss_samples_mib", "server_log_tail")},
                     indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0 if all(summary["checks"].values()) else 1
