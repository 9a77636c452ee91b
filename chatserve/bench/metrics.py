"""Latency arithmetic on recorded timestamps: TTFT, TPOT, ITL, E2E, percentiles, goodput.

Pure functions over `RequestRecord`s; no I/O, no clock. Times are seconds (perf_counter), results ms.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request (one chat turn) as the client saw it.

    `chunk_times[i]` is when the i-th chunk carrying generated text arrived; `chunk_tokens[i]` is how
    many tokens it carried (the websocket `delta.num_tokens`), or None when the endpoint does not say
    (OpenAI SSE): then `num_generated` is spread evenly over the chunks, see `tokens_per_chunk`.
    """

    session_idx: int
    turn_idx: int
    start: float
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] | None = field(default_factory=list)
    num_generated: int = 0  # from the server's `done` stats or `usage`; the authoritative count
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    server_stats: dict | None = None  # the websocket `done.stats`
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.error is None and bool(self.chunk_times) and self.end is not None

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(ttft_ms=ttft_ms(self), tpot_ms=tpot_ms(self), e2e_ms=e2e_ms(self))
        return out


def ttft_ms(r: RequestRecord) -> float | None:
    """Send -> first chunk of generated text."""
    return (r.chunk_times[0] - r.start) * 1e3 if r.chunk_times else None


def e2e_ms(r: RequestRecord) -> float | None:
    """Send -> end of the response (`done` / `[DONE]`)."""
    return (r.end - r.start) * 1e3 if r.end is not None else None


def tpot_ms(r: RequestRecord) -> float | None:
    """Mean time per output token after the first: (last chunk - first chunk) / (num_generated - 1).

    The first token's wait is TTFT and is excluded. Tokens that arrive together with the first
    (a speculative first chunk) count with zero wait, as in vLLM's (latency - ttft) / (n - 1).
    None for fewer than 2 tokens.
    """
    if len(r.chunk_times) == 0 or r.num_generated < 2:
        return None
    return (r.chunk_times[-1] - r.chunk_times[0]) * 1e3 / (r.num_generated - 1)


def tokens_per_chunk(r: RequestRecord) -> list[float]:
    """Tokens behind each chunk: exact when the server said, else num_generated spread evenly."""
    if r.chunk_tokens is not None and len(r.chunk_tokens) == len(r.chunk_times):
        return [float(n) for n in r.chunk_tokens]
    n = len(r.chunk_times)
    return [r.num_generated / n] * n if n else []


def itl_ms(chunk_times: list[float], chunk_tokens: list[float]) -> list[float]:
    """Per-token inter-token latencies: a chunk of n tokens after a gap g gives n values g/n.

    Example: chunks at [0.0, 0.1, 0.4] s carrying [1, 1, 3] tokens -> [100, 100, 100, 100] ms:
    one token after 100 ms, then three tokens that took 300 ms together. The first chunk has no
    predecessor (its wait is TTFT), so len(result) = sum(chunk_tokens[1:]) for integer counts.
    A fractional count (estimated, see `tokens_per_chunk`) gives one value per chunk.
    """
    out: list[float] = []
    for prev, cur, n in zip(chunk_times, chunk_times[1:], chunk_tokens[1:]):
        if n <= 0:  # a chunk with no token (should not happen) adds its gap to the next one
            continue
        reps = int(n) if float(n).is_integer() else 1
        out += [(cur - prev) * 1e3 / n] * reps
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default method); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: list[float | None]) -> dict:
    """{'mean', 'p50', 'p90', 'p99', 'count'} over the non-None values."""
    xs = [v for v in values if v is not None]
    out = {"mean": sum(xs) / len(xs) if xs else None}
    out.update({f"p{q}": percentile(xs, q) for q in PERCENTILES})
    out["count"] = len(xs)
    return out


def meets_slo(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """A request is good if it succeeded and met every SLO given (a 1-token reply has no TPOT)."""
    if not r.is_ok:
        return False
    if slo_ttft_ms is not None and ttft_ms(r) > slo_ttft_ms:
        return False
    tpot = tpot_ms(r)
    return slo_tpot_ms is None or tpot is None or tpot <= slo_tpot_ms


def goodput(records: list[RequestRecord], duration_s: float, slo_ttft_ms: float | None,
            slo_tpot_ms: float | None) -> float:
    """Requests per second that met the SLOs (vLLM's definition of goodput)."""
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records)
    return good / duration_s if duration_s > 0 else 0.0


def speculation_summary(records: list[RequestRecord]) -> dict:
    """Acceptance from the websocket `done` stats: pooled accepted / drafted, and the mean over
    requests of the server's mean accepted length (tokens per verification step)."""
    drafted = accepted = 0
    lengths, rates = [], []
    for r in records:
        s = r.server_stats or {}
        if s.get("drafted"):
            drafted += s["drafted"]
            accepted += s.get("accepted") or 0
            rates.append(s.get("acceptance_rate"))
        if s.get("mean_accepted_length") is not None:
            lengths.append(s["mean_accepted_length"])
    return {
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": sum(lengths) / len(lengths) if lengths else None,
        "per_request_acceptance": [x for x in rates if x is not None],
    }


def aggregate(records: list[RequestRecord], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    """Everything the report shows, from the records of one run lasting `duration_s`."""
    ok = [r for r in records if r.is_ok]
    failed = [r for r in records if not r.is_ok]
    itls = [x for r in ok for x in itl_ms(r.chunk_times, tokens_per_chunk(r))]
    num_out = sum(r.num_generated for r in ok)
    num_chunks = sum(len(r.chunk_times) for r in ok)
    reasons: dict[str, int] = {}
    for r in failed:
        key = (r.error or "no output").split(":", 1)[0]
        reasons[key] = reasons.get(key, 0) + 1
    queue = [(r.server_stats or {}).get("queue_ms") for r in ok]
    return {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_failed": len(failed),
        "failure_reasons": reasons,
        "duration_s": duration_s,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "generated_tokens": num_out,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": num_out / duration_s if duration_s > 0 else 0.0,
        "goodput": goodput(records, duration_s, slo_ttft_ms, slo_tpot_ms),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "ttft_ms": describe([ttft_ms(r) for r in ok]),
        "tpot_ms": describe([tpot_ms(r) for r in ok]),
        "itl_ms": describe(itls),
        "e2e_ms": describe([e2e_ms(r) for r in ok]),
        "queue_ms": describe(queue),
        "tokens_per_chunk": num_out / num_chunks if num_chunks else None,
        "speculation": speculation_summary(ok),
    }
