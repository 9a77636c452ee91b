"""The Ray Serve application: N chatserve replicas behind Ray's proxy, routed by AffinityRouter.

Imports ray at the top: import it only when ray is installed (launch.py checks first). Each
replica is one Engine with the whole chatserve app (create_app) as its ASGI ingress, so /ws,
/v1 and the UI pass through Ray's proxy unchanged. Ray restarts a replica that dies or fails
its health check; its conversations re-home on the least loaded replica (affinity.py).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
import time

import ray
from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from chatserve.config import EngineConfig, ServerConfig
from chatserve.metrics import CONTENT_TYPE
from chatserve.scale.affinity import POLICIES, session_key
from chatserve.scale.gateway import Gateway, call_asgi
from chatserve.scale.metrics_merge import merge_replica_metrics

METRICS_PUSH_PERIOD = 5.0  # seconds between a replica's pushes of its /metrics page to the board
METRICS_MAX_AGE = 30.0  # seconds: a page older than this belongs to a replica that is gone
UNROUTED_TIMEOUT = 60.0  # seconds a chosen replica counts as loaded before Ray reports the request routed
PROBE_PERIOD = 5.0  # seconds between asking a replica this router counts as busy for its own count
REPLICA_HEADER = b"x-chatserve-replica"  # on replies relayed by the gateway: which replica answered


class AffinityRouter(RequestRouter):
    """Ray Serve's request router for chatserve: the routing key is the request's session key
    (`x-session-id`, which Ray's proxy also puts in `metadata.session_id`, or `?session=`, read
    from the ASGI scope the proxy sends); AffinityPolicy picks the replica. Load is this router's
    own count of requests in flight (an open websocket counts as one)."""

    def initialize_state(self, policy: str = "affinity", **kwargs) -> None:
        self.policy = POLICIES[policy]()  # round_robin: the baseline for benchmarks/scale_affinity.py
        self.in_flight: dict[str, str] = {}  # internal request id -> replica unique id
        self.loads: dict[str, int] = {}  # replica unique id -> requests in flight
        self.unconfirmed: dict[str, float] = {}  # internal request id -> when chosen, until Ray routes it
        self.probed: dict[str, float] = {}  # replica unique id -> when last asked for its queue length

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """The key's home first, then the rest. The choice counts as load at once: Ray asks for
        every request of a burst before it reports any of them routed (on_request_routed), and a
        burst of new keys must not all see the same least loaded replica."""
        if not candidate_replicas:
            return []
        self._forget_unrouted()
        self._reconcile(candidate_replicas)
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        self._uncount(request_id)  # asked again (its first choice refused): its old count goes
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {replica: self.loads.get(replica, 0) for replica in by_id}
        first, *rest = self.policy.ranked(_routing_key(pending_request), loads)
        if request_id is not None:
            self._count(request_id, first)
            self.unconfirmed[request_id] = time.monotonic()
        # the home first; if it refuses (full), Ray picks the least queued of the rest
        return [[by_id[first]], [by_id[replica] for replica in rest]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        self.unconfirmed.pop(request_id, None)
        self._uncount(request_id)
        self._count(request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.unconfirmed.pop(internal_request_id, None)
        self._uncount(internal_request_id)

    def _count(self, request_id: str, replica: str) -> None:
        self.in_flight[request_id] = replica
        self.loads[replica] = self.loads.get(replica, 0) + 1

    def _uncount(self, request_id: str | None) -> None:
        replica = self.in_flight.pop(request_id, None)
        if replica is not None and self.loads.get(replica, 0) > 0:
            self.loads[replica] -= 1

    def _forget_unrouted(self) -> None:
        """Drop the counts of choices Ray never routed (the request was cancelled first)."""
        now = time.monotonic()
        for request_id in [r for r, t in self.unconfirmed.items() if now - t > UNROUTED_TIMEOUT]:
            del self.unconfirmed[request_id]
            self._uncount(request_id)

    def _reconcile(self, replicas: list[RunningReplica]) -> None:
        """Trim this router's count of a replica down to what the replica itself reports.

        A request whose completion is never reported (seen once around a killed replica: a
        reconnect that failed mid-way) would otherwise count against its replica for good, and
        every new key would avoid it. Ray keeps each replica's own count of ongoing requests (every
        router's) in its queue-length cache, fresh for 10 s after a send or a probe; this router's
        routed requests can never outnumber it, so any excess is stale and the oldest entries go.
        A replica counted busy without a fresh entry is probed in the background, at most every
        PROBE_PERIOD seconds, so a replica no request reaches any more is corrected too."""
        cache = getattr(self, "_replica_queue_len_cache", None)
        if cache is None:  # not running inside Ray's router (tests of the policy alone)
            return
        stale = []
        for replica in replicas:
            replica_id = replica.replica_id.unique_id
            routed = [r for r, home in self.in_flight.items() if home == replica_id and r not in self.unconfirmed]
            if not routed:
                continue
            ongoing = cache.get(replica.replica_id)
            if ongoing is None:
                if time.monotonic() - self.probed.get(replica_id, float("-inf")) > PROBE_PERIOD:
                    self.probed[replica_id] = time.monotonic()
                    stale.append(replica)
                continue
            for request_id in routed[:max(0, len(routed) - ongoing)]:
                self._uncount(request_id)
        if stale:  # Ray's probe fills the cache for the next call; the task is kept so it is not collected
            self.probe_task = asyncio.get_running_loop().create_task(self._probe_queue_lens(stale, 0))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.loads.pop(replica_id.unique_id, None)


def _routing_key(pending_request: PendingRequest | None) -> str | None:
    """The session key of a request from Ray's HTTP proxy (its argument is a pickled
    StreamingHTTPRequest holding the ASGI scope); None for anything else."""
    if pending_request is None:
        return None
    if pending_request.metadata.session_id:
        return pending_request.metadata.session_id
    args = pending_request.args
    if not args or not isinstance(args[0], bytes):
        return None
    try:
        scope = pickle.loads(args[0])._asgi_scope
    except Exception:
        return None
    return session_key(scope)


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The latest /metrics page of every replica, so that any replica can answer for all."""

    def __init__(self):
        self.pages: dict[str, tuple[float, str]] = {}  # replica id -> (time, page)

    def put(self, replica: str, page: str) -> dict[str, str]:
        """Store `replica`'s page; return every page younger than METRICS_MAX_AGE."""
        now = time.time()
        self.pages[replica] = (now, page)
        self.pages = {r: (t, p) for r, (t, p) in self.pages.items() if now - t < METRICS_MAX_AGE}
        return {r: p for r, (_, p) in sorted(self.pages.items())}


@serve.deployment(name="chatserve", max_ongoing_requests=1000, health_check_period_s=5,
                  health_check_timeout_s=30, graceful_shutdown_timeout_s=35)
@serve.ingress()  # the ASGI app is built per replica, after its engine (__serve_build_asgi_app__)
class ChatReplica:
    """One engine and the whole chatserve app. Routes added in front: /metrics (every replica's
    page, each sample labelled with its replica) and /replica (which replica answered)."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, board, draft_name: str | None):
        from chatserve.async_engine import AsyncEngine
        from chatserve.engine import Engine
        from chatserve.loading import limit_malloc_arenas
        from chatserve.server import create_app

        limit_malloc_arenas()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.engine = AsyncEngine(Engine(engine_config), server_config.served_model_name, draft_name)
        self.chat_app = create_app(self.engine, server_config)
        self.board = board
        threading.Thread(target=self._push_metrics, name="chatserve-metrics-push", daemon=True).start()

    def __serve_build_asgi_app__(self):
        return Starlette(routes=[
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/replica", self.whoami, methods=["GET"]),
            Mount("/", app=self.chat_app),
        ])

    async def metrics(self, request: Request) -> Response:
        page = self.chat_app.state.server.metrics.render().decode()
        pages = await self.board.put.remote(self.replica, page)
        return Response(merge_replica_metrics(pages), media_type=CONTENT_TYPE)

    def _push_metrics(self) -> None:
        while True:
            try:
                ray.get(self.board.put.remote(self.replica, self.chat_app.state.server.metrics.render().decode()))
            except Exception:  # the board is gone (shutting down): keep serving
                pass
            time.sleep(METRICS_PUSH_PERIOD)

    async def asgi_call(self, scope: dict, body: bytes):
        """One HTTP request relayed by the gateway (GatewayIngress): the app's reply, message by
        message, its first one naming this replica. Cancelled when the gateway's client leaves."""
        async for message in call_asgi(self.chat_app, scope, body):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, self.replica.encode())]}
            yield message

    async def whoami(self, request: Request) -> Response:
        return JSONResponse({"replica": self.replica, "pid": os.getpid()})

    def check_health(self) -> None:
        """Ray calls this every health_check_period_s; raising marks the replica for restart."""
        if not self.engine._thread.is_alive():
            raise RuntimeError("the engine thread has stopped")
        self.engine.stats()


@serve.deployment(name="gateway", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class GatewayIngress:
    """The /v1 routes' ingress: reads each body, routes it by affinity.body_key (the OpenAI `user`
    field or a hash of the prompt) as well as the session header, and relays it to a ChatReplica
    through a handle whose router (AffinityRouter) reads the key from the request's session id."""

    def __init__(self, app_name: str, max_body_bytes: int):
        self.replicas = serve.get_deployment_handle(ChatReplica.name, app_name=app_name)
        self.gateway = Gateway(self.forward, max_body_bytes)  # not self.app: Ray's ASGI wrapper owns that name

    async def forward(self, key: str | None, scope: dict, body: bytes):
        handle = self.replicas.options(stream=True, **({"session_id": key} if key else {}))
        reply = handle.asgi_call.remote(scope, body)
        try:
            async for message in reply:
                yield message
        finally:
            reply.cancel()  # a no-op once it is done; else the replica's call is cancelled

    def __serve_build_asgi_app__(self):
        return Starlette(routes=[Mount("/", app=self.gateway)])
