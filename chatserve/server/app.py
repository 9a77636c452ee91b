"""The app factory: routes (/ws, /v1, /tokenize, /detokenize, /version, /health, /metrics, the static UI)
and the uvicorn runner."""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from chatserve import protocol as P
from chatserve.config import ServerConfig
from chatserve.metrics import CONTENT_TYPE
from chatserve.server.cors import cors_middleware
from chatserve.server.openai_api import OpenAIRoutes, error_response
from chatserve.server.shutdown import UVICORN_GRACE, DrainingServer
from chatserve.server.state import AppState
from chatserve.server.websocket import Connection

WEB_DIR = (Path(__file__).resolve().parents[1] / "web").resolve()  # chatserve/web -> ../web, in a wheel too


def create_app(engine, config: ServerConfig) -> Starlette:
    """The whole server as one ASGI app; `engine` implements the AsyncEngine interface."""
    state = AppState(engine, config)
    openai = OpenAIRoutes(state)

    async def websocket_endpoint(websocket: WebSocket) -> None:
        await Connection(state, websocket).serve()

    async def health(request: Request) -> Response:
        try:
            stats = engine.stats()
        except Exception as e:
            return JSONResponse({"status": "error", "message": f"engine.stats() failed: {e!r}"}, status_code=503)
        keys = ("num_running", "num_waiting", "num_blocks", "num_free_blocks", "kv_usage")
        admission = state.admission
        body = {"status": "draining" if admission.is_draining else "ok", "model": state.model_name,
                "draft": engine.draft_name, **{k: stats.get(k) for k in keys},
                "num_connections": admission.num_connections, "num_generations": admission.num_generations}
        return JSONResponse(body, status_code=503 if admission.is_draining else 200)  # draining: route elsewhere

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    routes = [
        WebSocketRoute("/ws", websocket_endpoint),
        Mount("/v1", routes=[  # a mount of its own, so /v1 404s and 405s never fall through to the UI
            Route("/chat/completions", openai.chat_completions, methods=["POST"]),
            Route("/completions", openai.completions, methods=["POST"]),
            Route("/models", openai.models, methods=["GET"]),
            Route("/models/{model_id:path}", openai.model, methods=["GET"]),  # ids may hold a "/"
        ]),
        Route("/tokenize", openai.tokenize, methods=["POST"]),  # vLLM's paths, outside /v1
        Route("/detokenize", openai.detokenize, methods=["POST"]),
        Route("/version", openai.version, methods=["GET"]),
        Route("/health", health, methods=["GET"]),  # health and metrics stay open (no key) for probes
        Route("/metrics", metrics, methods=["GET"]),
        Mount("/", app=StaticFiles(directory=WEB_DIR, html=True, check_dir=False), name="web"),
    ]
    app = Starlette(routes=routes, middleware=[cors_middleware(config)],
                    exception_handlers={HTTPException: _http_exception})
    app.state.server = state
    return app


_VLLM_PATHS = ("/tokenize", "/detokenize", "/version")


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """404/405 under /v1 and on vLLM's paths in OpenAI's error shape; plain text elsewhere (the static UI)."""
    if not request.url.path.startswith("/v1/") and request.url.path not in _VLLM_PATHS:
        return Response(exc.detail, status_code=exc.status_code, headers=exc.headers)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(P.ProtocolError(code, f"{request.method} {request.url.path}: {exc.detail}",
                                          exc.status_code))


def make_uvicorn_server(engine, config: ServerConfig, log_level: str = "info") -> DrainingServer:
    """uvicorn with uvloop and sans-I/O websockets, serving create_app(engine, config); SIGTERM
    drains it (shutdown.py)."""
    import uvicorn

    app = create_app(engine, config)
    # Frames up to 4x the limit reach the app and get a clear `too_large` error; bigger ones are
    # closed by the protocol layer with code 1009.
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, loop="uvloop", ws="websockets-sansio",
                               ws_max_size=4 * config.max_message_bytes, log_level=log_level,
                               timeout_graceful_shutdown=UVICORN_GRACE)
    return DrainingServer(uv_config, app.state.server)


def run_server(engine, config: ServerConfig) -> None:
    """Serve `engine` until interrupted; prints the URL to open."""
    server = make_uvicorn_server(engine, config)
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    host = f"[{host}]" if ":" in host else host
    hint = "  (append ?api_key=<key> to the URL)" if config.api_key else ""
    print(f"chatserve: serving {engine.model_name} - open http://{host}:{config.port}/{hint}", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl+C after its graceful shutdown
        print("chatserve: stopped", flush=True)
