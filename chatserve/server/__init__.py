"""The chat server: create_app(engine, config) -> Starlette, and run_server for `chatserve serve`.

app.py (routes, uvicorn), websocket.py (/ws), openai_api.py (/v1), access.py (origin, key,
limits), state.py (what the routes share, and the engine calls).
"""

from chatserve.server.app import create_app, make_uvicorn_server, run_server

__all__ = ["create_app", "make_uvicorn_server", "run_server"]
