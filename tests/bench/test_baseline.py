"""`--baseline transformers`: HF generate timed through a streamer (plain, assisted, prompt lookup)
and the our-vs-baseline ratios. The run against a real server is in test_e2e.py (shares its server)."""

import pytest

from chatserve.bench.baseline import method_of, ratios, run_transformers
from chatserve.bench.metrics import tpot_ms, ttft_ms


@pytest.mark.parametrize("method", ["plain", "assisted", "prompt_lookup"])
def test_transformers_records_every_token(tiny_llama_dir, tiny_draft_dir, method):
    records = run_transformers(str(tiny_llama_dir), ["Hello there", "Write a poem"], max_tokens=10,
                               temperature=0.0, dtype="float32", method=method, draft_model=str(tiny_draft_dir),
                               progress=False)
    assert len(records) == 2
    for r in records:
        assert 1 <= r.num_generated <= 10 and r.prompt_tokens > 2
        assert sum(r.chunk_tokens) == r.num_generated  # the streamer saw every generated token
        assert r.end >= r.chunk_times[-1] >= r.chunk_times[0] > r.start
        assert ttft_ms(r) > 0 and (r.num_generated < 2 or tpot_ms(r) >= 0)


def test_method_of_maps_server_configs():
    assert method_of(["--no-spec"], None) == "plain"
    assert method_of(["--draft", "ngram"], None) == "prompt_lookup"
    assert method_of(["--draft", "suffix"], None) == method_of(None, "suffix") == "prompt_lookup"
    assert method_of(["--draft-model", "x"], None) == "assisted"
    assert method_of(None, "ngram") == "prompt_lookup" and method_of(None, "some-draft") == "assisted"
    assert method_of(None, None) == "plain"


def test_ratios_at_lowest_concurrency():
    def summary(ttft, tpot):
        return {"ttft_ms": {"p50": ttft}, "tpot_ms": {"p50": tpot}}

    points = [{"config": "off", "serve_args": ["--no-spec"], "concurrency": c, "report": {"summary": summary(100, t)}}
              for c, t in ((2, 50.0), (1, 10.0))]
    points.append({"config": "ngram", "serve_args": ["--draft", "ngram"], "concurrency": 1,
                   "report": {"summary": summary(120, 5.0)}})
    methods = {"plain": {"summary": summary(200, 40.0)}, "prompt_lookup": {"summary": summary(250, 25.0)}}
    rows = ratios(points, methods, None)
    got = {(r["config"], r["vs"]): (r["ttft_ratio"], r["tpot_ratio"]) for r in rows}
    assert got == {("off", "transformers plain"): (0.5, 0.25), ("ngram", "transformers plain"): (0.6, 0.125),
                   ("ngram", "transformers prompt_lookup"): (0.48, 0.2)}
