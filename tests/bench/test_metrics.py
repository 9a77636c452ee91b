"""Metric arithmetic on synthetic timings: TPOT excludes the first token, multi-token chunks give
per-token ITL, percentiles interpolate like numpy, goodput counts only requests within the SLOs."""

import pytest

from chatserve.bench.metrics import (RequestRecord, aggregate, describe, e2e_ms, goodput, itl_ms, meets_slo,
                                     percentile, tokens_per_chunk, tpot_ms, ttft_ms)


def record(start, chunk_times, chunk_tokens, end=None, num_generated=None, **kw) -> RequestRecord:
    num = sum(chunk_tokens) if num_generated is None else num_generated
    return RequestRecord(0, 0, start=start, end=chunk_times[-1] if end is None else end,
                         chunk_times=list(chunk_times), chunk_tokens=list(chunk_tokens), num_generated=num, **kw)


def test_ttft_tpot_e2e_exclude_first_token_wait():
    # 1 s to the first token, then 4 tokens every 50 ms; done 10 ms after the last token.
    r = record(10.0, [11.0, 11.05, 11.10, 11.15, 11.20], [1] * 5, end=11.21)
    assert ttft_ms(r) == pytest.approx(1000.0)
    assert tpot_ms(r) == pytest.approx(50.0)  # not (1210 / 5) and not 1200 / 4
    assert e2e_ms(r) == pytest.approx(1210.0)


def test_tpot_with_multi_token_chunks_divides_by_tokens_not_chunks():
    # first token at 0.2 s, then a 3-token chunk at 0.5 and a 2-token chunk at 0.7: 5 tokens in 500 ms
    r = record(0.0, [0.2, 0.5, 0.7], [1, 3, 2])
    assert r.num_generated == 6
    assert tpot_ms(r) == pytest.approx(500.0 / 5)


def test_tpot_undefined_for_one_token():
    assert tpot_ms(record(0.0, [0.3], [1])) is None


def test_itl_spreads_a_chunk_over_its_tokens():
    itls = itl_ms([0.0, 0.1, 0.4], [1, 1, 3])
    assert itls == pytest.approx([100.0, 100.0, 100.0, 100.0])
    assert len(itls) == 4  # tokens after the first chunk
    itls = itl_ms([0.0, 0.2, 0.3], [2, 4, 1])
    assert itls == pytest.approx([50.0] * 4 + [100.0])
    assert sum(itls) == pytest.approx(300.0)  # per-token latencies add up to the stream time


def test_estimated_token_counts_spread_usage_over_chunks():
    r = RequestRecord(0, 0, start=0.0, end=1.0, chunk_times=[0.1, 0.5, 0.9], chunk_tokens=None, num_generated=9)
    assert tokens_per_chunk(r) == [3.0, 3.0, 3.0]
    assert itl_ms(r.chunk_times, tokens_per_chunk(r)) == pytest.approx([400 / 3] * 6)
    r.num_generated = 4  # 4/3 tokens per chunk: one estimated per-token value per chunk
    assert itl_ms(r.chunk_times, tokens_per_chunk(r)) == pytest.approx([300.0, 300.0])
    assert tpot_ms(r) == pytest.approx(800.0 / 3)


def test_percentiles_match_numpy_linear():
    import numpy as np

    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 100.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None
    d = describe([1.0, None, 3.0])
    assert d["count"] == 2 and d["mean"] == 2.0 and d["p50"] == 2.0


def test_goodput_counts_requests_within_every_slo():
    fast = record(0.0, [0.1, 0.12, 0.14], [1, 1, 1])  # TTFT 100 ms, TPOT 20 ms
    slow_start = record(0.0, [0.9, 0.92], [1, 1])  # TTFT 900 ms
    slow_tokens = record(0.0, [0.1, 0.3, 0.5], [1, 1, 1])  # TPOT 200 ms
    one_token = record(0.0, [0.2], [1])  # no TPOT: only TTFT applies
    failed = RequestRecord(0, 0, start=0.0, end=0.1, error="engine_error: boom")
    records = [fast, slow_start, slow_tokens, one_token, failed]
    assert [meets_slo(r, 500, 50) for r in records] == [True, False, False, True, False]
    assert goodput(records, 2.0, 500, 50) == pytest.approx(1.0)  # 2 good requests in 2 s
    assert goodput(records, 2.0, None, None) == pytest.approx(2.0)  # all successful ones


def test_aggregate_counts_tokens_throughput_and_failures():
    ws = record(0.0, [0.1, 0.2, 0.3], [1, 2, 1], server_stats={
        "drafted": 8, "accepted": 3, "acceptance_rate": 0.375, "mean_accepted_length": 2.0, "queue_ms": 4.0},
        prompt_tokens=20, cached_tokens=16)
    plain = record(1.0, [1.2, 1.4], [1, 1], prompt_tokens=10)
    failed = RequestRecord(0, 1, start=0.0, end=0.5, error="busy: one turn at a time")
    s = aggregate([ws, plain, failed], duration_s=2.0, slo_ttft_ms=150, slo_tpot_ms=None)
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (3, 2, 1)
    assert s["failure_reasons"] == {"busy": 1}
    assert s["generated_tokens"] == 6 and s["prompt_tokens"] == 30 and s["cached_tokens"] == 16
    assert s["output_throughput"] == pytest.approx(3.0) and s["request_throughput"] == pytest.approx(1.0)
    assert s["goodput"] == pytest.approx(0.5)  # plain's TTFT is 200 ms
    assert s["itl_ms"]["count"] == 4  # 3 tokens after ws's first chunk + 1 after plain's
    assert s["tokens_per_chunk"] == pytest.approx(6 / 5)
    assert s["speculation"]["acceptance_rate"] == pytest.approx(3 / 8)
    assert s["queue_ms"]["count"] == 1
