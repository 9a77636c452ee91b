"""CORS for `allowed_origins`: a browser app on a listed origin may call the HTTP API.

Starlette's CORSMiddleware answers preflights and adds Access-Control-Allow-Origin for listed
origins. Whether a request is served at all stays access.py's Origin check (a 403 for others).
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from chatserve import protocol as P
from chatserve.config import ServerConfig
from chatserve.server.openai_api import error_response


class _CORS(CORSMiddleware):
    """Starlette's CORS, except that an origin not listed gets no Access-Control-* header at all:
    its preflight is a plain 403 (Starlette's 400 lists the allowed methods), and its responses
    pass untouched (Starlette adds the exposed headers to any response to a request with an Origin)."""

    def preflight_response(self, request_headers: Headers) -> Response:
        origin = request_headers["origin"]
        if self.is_allowed_origin(origin):
            return super().preflight_response(request_headers)
        return error_response(P.ProtocolError(P.FORBIDDEN_ORIGIN, f"origin {origin!r} is not allowed", 403))

    async def simple_response(self, scope: Scope, receive: Receive, send: Send, request_headers: Headers) -> None:
        origin = request_headers.get("origin")
        if origin is None or not self.is_allowed_origin(origin):
            await self.app(scope, receive, send)
            return
        await super().simple_response(scope, receive, send, request_headers)


def cors_middleware(config: ServerConfig) -> Middleware:
    """Requested headers are mirrored rather than listed: the browser builds of the OpenAI SDK send
    their own (x-stainless-*) besides Authorization and Content-Type, and the origin is trusted.
    No credentials: the API key travels in Authorization, never in a cookie."""
    return Middleware(_CORS, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                      allow_headers=["*"], expose_headers=["Retry-After"], max_age=600)
