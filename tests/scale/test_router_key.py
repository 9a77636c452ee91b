"""AffinityRouter's routing key from what Ray's proxy hands it (no Ray cluster started; skipped
without ray installed). Guards the one place that reads a Ray internal: the pickled ASGI scope."""

import asyncio
import pickle

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import RequestMetadata, StreamingHTTPRequest  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from chatserve.scale.ray_app import _routing_key  # noqa: E402


def _in_loop(make):
    """A PendingRequest makes an asyncio.Future, so it needs a running loop (as in Ray's proxy); an
    earlier test may have left the main thread without one."""
    async def run():
        return make()
    return asyncio.run(run())


def _pending(scope: dict, session_id: str = "") -> PendingRequest:
    arg = pickle.dumps(StreamingHTTPRequest(asgi_scope=scope, proxy_actor_name="proxy"))
    metadata = RequestMetadata(request_id="r", internal_request_id="i", session_id=session_id)
    return _in_loop(lambda: PendingRequest(args=[arg], kwargs={}, metadata=metadata))


def test_websocket_query_key():
    scope = {"type": "websocket", "path": "/ws", "query_string": b"session=tab-7", "headers": []}
    assert _routing_key(_pending(scope)) == "tab-7"


def test_header_key_from_the_proxy_wins():
    scope = {"type": "http", "path": "/v1/chat/completions", "query_string": b"session=q", "headers": []}
    assert _routing_key(_pending(scope, session_id="h")) == "h"


def test_no_key_and_non_proxy_arguments():
    assert _routing_key(_pending({"type": "http", "headers": [], "query_string": b""})) is None
    handle_call = _in_loop(lambda: PendingRequest(args=[{"messages": []}], kwargs={},
                                                  metadata=RequestMetadata(request_id="r", internal_request_id="i")))
    assert _routing_key(handle_call) is None
    assert _routing_key(None) is None


class _Replica:
    def __init__(self, name: str):
        self.replica_id = type("ReplicaID", (), {"unique_id": name})()


def _router():
    from chatserve.scale.ray_app import AffinityRouter
    router = AffinityRouter.__new__(AffinityRouter)  # the routing state only, no Ray deployment
    router.initialize_state()
    return router


def test_a_burst_of_new_keys_spreads_before_any_is_reported_routed():
    """Ray asks for a replica for every request of a burst before it reports any routed: each
    choice must count as load at once, or the whole burst sees one least loaded replica."""
    router, replicas = _router(), [_Replica("a"), _Replica("b")]
    scope = {"type": "http", "path": "/v1/chat/completions", "query_string": b"", "headers": []}
    requests = [_in_loop(lambda i=i: PendingRequest(args=[pickle.dumps(StreamingHTTPRequest(
        asgi_scope=scope, proxy_actor_name="proxy"))], kwargs={}, metadata=RequestMetadata(
        request_id=f"r{i}", internal_request_id=f"i{i}", session_id=f"user-{i}"))) for i in range(8)]
    chosen = [asyncio.run(router.choose_replicas(replicas, r))[0][0].replica_id.unique_id for r in requests]
    assert sorted(chosen) == ["a"] * 4 + ["b"] * 4
    # asked again for the same request (its first choice was full): counted once, not twice
    asyncio.run(router.choose_replicas(replicas, requests[0]))
    assert sum(router.loads.values()) == 8
    for r, replica in zip(requests, chosen):
        router.on_request_completed(_Replica(replica).replica_id, r.metadata.internal_request_id)
    assert sum(router.loads.values()) == 0 and not router.unconfirmed


def test_a_count_the_replica_contradicts_is_trimmed():
    """A request whose completion Ray never reports must not count against its replica for good
    (every new key would avoid that replica): the replica's own count of ongoing requests, from
    Ray's queue-length cache or a probe of a replica no request reaches, trims the router's."""
    from ray.serve._private.request_router.common import ReplicaQueueLengthCache

    router, replicas = _router(), [_Replica("a"), _Replica("b")]
    cache = router._replica_queue_len_cache = ReplicaQueueLengthCache()
    probed = []

    async def probe(stale, backoff_index):  # what Ray's probe does: ask each replica, fill the cache
        probed.extend(r.replica_id.unique_id for r in stale)
        for r in stale:
            cache.update(r.replica_id, 0)

    router._probe_queue_lens = probe
    for request_id in ("lost-1", "lost-2", "live"):  # routed to "a"; the two lost ones never complete
        router._count(request_id, "a")

    def new_key(i):
        return _in_loop(lambda: PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(
            request_id=f"r{i}", internal_request_id=f"n{i}", session_id=f"new-{i}")))

    cache.update(replicas[0].replica_id, 1)  # "a" reports one request ongoing: the live one
    first = asyncio.run(router.choose_replicas(replicas, new_key(0)))[0][0].replica_id.unique_id
    assert router.loads["a"] == 1 and list(router.in_flight)[0] == "live"  # the oldest two went
    router.on_request_completed(_Replica(first).replica_id, "n0")

    router._count("lost-3", "b")  # "b" counted busy, and no fresh entry in the cache: probed once

    later = [new_key(1), new_key(2)]

    async def twice():
        await router.choose_replicas(replicas, later[0])
        await asyncio.sleep(0)  # the background probe runs
        await router.choose_replicas(replicas, later[1])
    asyncio.run(twice())
    assert probed == ["b"] and "lost-3" not in router.in_flight
