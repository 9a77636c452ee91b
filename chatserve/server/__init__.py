"""The chat server: create_app(engine, config) -> Starlette, and run_server for `chatserve serve`.

app.py (routes, uvicorn), websocket.py (/ws) and its outbox.py (bounded unread output),
openai_api.py (/v1, /tokenize, /detokenize, /version), access.py (origin, key, sizes),
admission.py (connection and generation counts, the bounded queue), shutdown.py (the SIGTERM
drain), state.py (what the routes share, and the engine calls).
"""

from chatserve.server.app import create_app, make_uvicorn_server, run_server

__all__ = ["create_app", "make_uvicorn_server", "run_server"]
