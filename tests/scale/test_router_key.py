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
