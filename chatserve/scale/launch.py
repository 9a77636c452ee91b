"""`chatserve serve --replicas N`: start Ray (or join the cluster at RAY_ADDRESS), deploy N
chatserve replicas behind Ray Serve's proxy on --host:--port, and serve until interrupted.

Ray is imported only here and in ray_app.py, so chatserve imports without it; without it,
`require_ray` fails at start with the install command.
"""

from __future__ import annotations

import signal
import threading

from chatserve.config import EngineConfig, ServerConfig

APP_NAME = "chatserve"
GATEWAY_APP_NAME = "chatserve-gateway"
GATEWAY_ROUTE = "/v1"  # the gateway reads these bodies; everything else goes straight to a replica
ROUTER_CLASS = "chatserve.scale.ray_app.AffinityRouter"
RAY_MISSING = ("--replicas needs Ray Serve, which is not installed here: pip install 'chatserve[scale]' "
               "(in a checkout: pip install -e '.[scale]')")


def require_ray() -> None:
    """Raise ValueError (the CLI's start error, exit 2) when ray[serve] cannot be imported."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{RAY_MISSING} ({e})") from None


def build_app(engine_config: EngineConfig, server_config: ServerConfig, num_replicas: int,
              draft_name: str | None = None, policy: str = "affinity"):
    """The Serve application (for serve.run): `num_replicas` ChatReplicas routed by AffinityRouter
    (`policy`: affinity, or round_robin for comparisons).
    Needs a connected Ray (ray.init) for the metrics board. Each replica asks Ray for
    --threads CPUs (1 by default), so Ray places as many per machine as it has cores for."""
    from ray.serve.config import RequestRouterConfig

    from chatserve.scale.ray_app import ChatReplica, MetricsBoard

    board = MetricsBoard.remote()
    return ChatReplica.options(
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": engine_config.num_threads or 1},
        request_router_config=RequestRouterConfig(request_router_class=ROUTER_CLASS,
                                                  request_router_kwargs={"policy": policy}),
    ).bind(engine_config, server_config, board, draft_name)


def build_gateway(server_config: ServerConfig, app_name: str = APP_NAME):
    """The gateway application (for serve.run at GATEWAY_ROUTE): one GatewayIngress routing the
    /v1 requests to app `app_name`'s replicas by `user` and prompt hash as well as by session key."""
    from chatserve.scale.ray_app import GatewayIngress

    return GatewayIngress.bind(app_name, server_config.max_message_bytes)


def serve_replicas(engine_config: EngineConfig, server_config: ServerConfig, num_replicas: int,
                   draft_name: str | None = None) -> None:
    """Run until Ctrl+C or SIGTERM, then tear the application (and a Ray started here) down."""
    import ray
    from ray import serve

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    ray.init(include_dashboard=False, logging_level="WARNING")  # joins RAY_ADDRESS when it is set
    signal.signal(signal.SIGTERM, interrupt)  # after ray.init, which installs its own; SIGTERM tears down like Ctrl+C
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        serve.run(build_app(engine_config, server_config, num_replicas, draft_name), name=APP_NAME,
                  route_prefix="/")
        serve.run(build_gateway(server_config), name=GATEWAY_APP_NAME, route_prefix=GATEWAY_ROUTE)
        host = "127.0.0.1" if server_config.host in ("0.0.0.0", "::", "") else server_config.host
        print(f"chatserve: serving {server_config.served_model_name} on {num_replicas} replicas (Ray Serve) - "
              f"open http://{host}:{server_config.port}/", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
        print("chatserve: stopped", flush=True)
