from prometheus_client.parser import text_string_to_metric_families

from chatserve.metrics import ServerMetrics
from chatserve.scale.metrics_merge import merge_replica_metrics


class _Engine:
    def __init__(self, hits):
        self.hits = hits

    def stats(self):
        return {"num_running": 1, "prefix_cache_queries": 100, "prefix_cache_hits": self.hits}


def _page(hits: int, num_requests: int) -> str:
    metrics = ServerMetrics(_Engine(hits), "smol")
    for _ in range(num_requests):
        metrics.start_request().finish("stop", prompt_tokens=10, stats=None)
    return metrics.render().decode()


def test_two_replicas_pages_merge_with_a_replica_label():
    merged = merge_replica_metrics({"r1": _page(hits=32, num_requests=2), "r2": _page(hits=0, num_requests=1)})
    assert merged.count("# TYPE chatserve:prefix_cache_hits_total ") == 1
    families = {f.name: f for f in text_string_to_metric_families(merged)}  # parses: valid text format
    hits = {s.labels["replica"]: s.value for s in families["chatserve:prefix_cache_hits"].samples
            if s.name.endswith("_total")}
    assert hits == {"r1": 32.0, "r2": 0.0}
    success = {s.labels["replica"]: s.value for s in families["chatserve:request_success"].samples
               if s.name.endswith("_total")}
    assert success == {"r1": 2.0, "r2": 1.0}
    buckets = [s for s in families["chatserve:e2e_request_latency_seconds"].samples if s.labels.get("le") == "+Inf"]
    assert sorted(s.labels["replica"] for s in buckets) == ["r1", "r2"]


def test_no_pages_no_text():
    assert merge_replica_metrics({}) == ""
