"""A short soak (chatserve/bench/soak.py) against a real `chatserve serve` subprocess on a tiny
model: clients over /ws and /v1 with cancels, drops, bad frames and oversized prompts at the
issue's rates, then the soak's own end checks: the pool all free, resident memory bounded, every
turn that should have been answered answered, the server still serving. No timing assertions."""

import pytest

from chatserve.bench.soak import SoakPlan, read_rss, run_soak
from chatserve.bench.sweep import ServerProcess


@pytest.fixture(scope="module")
def soak_server(tiny_llama_dir):
    args = ["--draft", "ngram", "--kv-cache-memory", "8M", "--threads", "1", "--max-num-batched-tokens", "64"]
    with ServerProcess(str(tiny_llama_dir), args, startup_timeout_s=120) as server:
        yield server


def test_soak_ends_with_pool_free_memory_bounded_and_all_answered(soak_server):
    plan = SoakPlan(url=soak_server.url, num_clients=12, num_requests=240, max_turns=4, max_tokens=16,
                    baseline_requests=80, timeout_s=120, progress_every=80)
    result = run_soak(plan, soak_server.proc.pid, progress=print)
    summary = result.summary(plan)
    assert len(result.outcomes) == plan.num_requests
    counts = summary["counts"]
    for kind in ("healthy", "cancel", "drop", "bad"):  # every kind of request was really tried
        assert counts[f"{kind}_ws"] + counts[f"{kind}_openai"] > 0, (kind, counts)
    assert counts["healthy_openai"] > 0 and {o.detail for o in result.outcomes if o.kind == "bad"} == {
        "malformed", "binary", "oversized_frame", "oversized_prompt"}
    assert not result.unanswered, summary["unanswered_examples"]
    assert summary["checks"] == {"pool_all_free": True, "rss_bounded": True, "all_answered": True,
                                 "server_alive": True}, summary
    assert result.rss_baseline_bytes and read_rss(soak_server.proc.pid) is not None
    assert soak_server.proc.poll() is None
