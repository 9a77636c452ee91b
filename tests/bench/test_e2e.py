"""`chatserve bench` end to end against a real `chatserve serve` subprocess (tiny target + draft
model, the fixture of tests/server/test_real_server.py) over both endpoints: JSON fields and counts."""

import json

import pytest

from chatserve.cli import main
from tests.server.test_real_server import server, wait_pool_free  # noqa: F401  (the fixture)

REQUEST_FIELDS = {"ttft_ms", "tpot_ms", "e2e_ms", "chunk_times", "chunk_tokens", "num_generated", "error"}


def run_bench(tmp_path, url: str, *args: str, exit_code: int = 0) -> dict:
    out = tmp_path / "bench.json"
    argv = ["bench", "--url", url, "--out", str(out), "--no-progress", "--max-tokens", "12", *args]
    assert main(argv) == exit_code
    return json.loads(out.read_text())


@pytest.mark.parametrize("endpoint", ["ws", "openai"])
def test_bench_single_runs_counts_and_fields(server, tmp_path, endpoint):
    result = run_bench(tmp_path, server, "--endpoint", endpoint, "--num-requests", "3", "--concurrency", "2",
                       "--rounds", "2", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000")
    assert result["args"]["endpoint"] == endpoint and result["args"]["rounds"] == 2
    assert len(result["machine"]["git_commit"]) == 40 and isinstance(result["machine"]["git_dirty"], bool)
    (point,) = result["points"]  # 2 rounds of 3 requests pooled into one point
    report = point["report"]
    summary, requests = report["summary"], report["requests"]
    assert point["concurrency"] == 2 and point["rounds"] == 2 and report["meta"]["endpoint"] == endpoint
    assert report["meta"]["server"]["model"] == "tiny" and len(report["meta"]["loadavg_before"]) == 3
    assert (summary["num_requests"], summary["num_completed"], summary["num_failed"]) == (6, 6, 0)
    assert len(requests) == 6 and all(REQUEST_FIELDS <= set(r) for r in requests)
    for r in requests:
        assert r["error"] is None and 1 <= r["num_generated"] <= 12 and r["ttft_ms"] > 0
        assert r["e2e_ms"] >= r["ttft_ms"]
        if endpoint == "ws":  # exact counts: deltas add up to the server's generated_tokens
            assert sum(r["chunk_tokens"]) == r["num_generated"] == r["server_stats"]["generated_tokens"]
        else:
            assert r["chunk_tokens"] is None and len(r["chunk_times"]) >= 1
    assert summary["generated_tokens"] == sum(r["num_generated"] for r in requests)
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])  # generous SLOs
    assert summary["ttft_ms"]["count"] == 6 and summary["ttft_ms"]["p50"] > 0
    counters = report["server_counters"]
    assert counters["spec_decode_num_draft_tokens"] > 0  # the server drafts with its draft model
    if endpoint == "ws":
        spec = summary["speculation"]
        assert spec["drafted"] == sum(r["server_stats"]["drafted"] for r in requests) > 0
        assert 0 <= spec["acceptance_rate"] <= 1
        # this bench was the server's only client: its /metrics counters agree with the done stats
        assert counters["spec_decode_num_draft_tokens"] == spec["drafted"]
    else:
        assert 0 <= summary["speculation"]["server_counters_acceptance_rate"] <= 1
    wait_pool_free(server)


@pytest.mark.parametrize("endpoint", ["ws", "openai"])
def test_bench_multi_turn_sessions_reuse_the_prefix(server, tmp_path, endpoint):
    result = run_bench(tmp_path, server, "--endpoint", endpoint, "--prompts", "multiturn", "--turns", "2",
                       "--num-requests", "4", "--concurrency", "2", "--think-time", "0.01", "--warmup", "0")
    requests = result["points"][0]["report"]["requests"]
    assert [(r["session_idx"], r["turn_idx"]) for r in requests] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["error"] is None for r in requests)
    assert all(r["cached_tokens"] > 0 for r in requests if r["turn_idx"] == 1)
    wait_pool_free(server)


def test_bench_open_loop_poisson_and_failures_reported(server, tmp_path):
    result = run_bench(tmp_path, server, "--request-rate", "20", "--max-concurrency", "2", "--num-requests", "3",
                       "--param", "max_tokens=999999", exit_code=1)  # over max_tokens_limit: every turn fails
    summary = result["points"][0]["report"]["summary"]
    assert result["points"][0]["concurrency"] is None
    assert summary["num_failed"] == 3 and summary["failure_reasons"] == {"invalid_params": 3}


def test_bench_with_baseline_against_real_server(server, tmp_path, tiny_llama_dir):
    out = tmp_path / "b.json"
    assert main(["bench", "--url", server, "--model", str(tiny_llama_dir), "--num-requests", "2", "--max-tokens", "8",
                 "--baseline", "transformers", "--baseline-requests", "2", "--no-progress", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["baseline"]["methods"]) == {"plain", "assisted"}  # the server drafts with a model
    assert all(m["summary"]["num_completed"] == 2 for m in result["baseline"]["methods"].values())
    assert {r["vs"] for r in result["ratios"]} == {"transformers plain", "transformers assisted"}
    assert all(r["tpot_ratio"] > 0 and r["ttft_ratio"] > 0 for r in result["ratios"])
