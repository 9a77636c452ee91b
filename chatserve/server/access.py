"""Security and limits: Origin, API key, prompt length, message size. No I/O.

Every refusal is a ProtocolError carrying its HTTP status; the routes decide how to send it.
How much work the server takes on (connections, generations) is admission.py's.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from chatserve import protocol as P
from chatserve.config import ServerConfig


class AccessControl:
    """The checks every route shares."""

    def __init__(self, config: ServerConfig, max_prompt_tokens: int):
        self.config = config
        self.max_prompt_tokens = max_prompt_tokens

    def is_origin_allowed(self, headers) -> bool:
        """No Origin = not a browser. Otherwise it must name this host, or be listed in allowed_origins."""
        origin = headers.get("origin")
        if origin is None or origin in self.config.allowed_origins or "*" in self.config.allowed_origins:
            return True
        host = headers.get("host")
        return host is not None and urlsplit(origin).netloc.lower() == host.lower()

    def is_key_valid(self, key: str | None) -> bool:
        expected = self.config.api_key
        return expected is None or (key is not None and hmac.compare_digest(key.encode(), expected.encode()))

    def check_http(self, headers) -> None:
        """An HTTP request needs an allowed Origin and, when the server has one, the Bearer key."""
        if not self.is_origin_allowed(headers):
            raise P.ProtocolError(P.FORBIDDEN_ORIGIN, f"origin {headers.get('origin')!r} is not allowed", 403)
        if not self.is_key_valid(bearer_token(headers)):
            raise P.ProtocolError(P.UNAUTHORIZED, "missing or invalid API key (Authorization: Bearer <key>)", 401)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) > self.max_prompt_tokens:
            raise P.ProtocolError(P.PROMPT_TOO_LONG, f"the prompt is {len(prompt_ids)} tokens; the limit is "
                                  f"{self.max_prompt_tokens}. Start a new chat or shorten it.", param="messages")

    def check_message_size(self, text: str) -> None:
        """A websocket text frame over max_message_bytes (counted as UTF-8) is refused."""
        limit = self.config.max_message_bytes
        if len(text) > limit or (4 * len(text) > limit and len(text.encode("utf-8", "surrogatepass")) > limit):
            raise P.ProtocolError(P.TOO_LARGE, f"message is larger than the {limit}-byte limit")


def bearer_token(headers) -> str | None:
    value = headers.get("authorization", "")
    return value[7:].strip() if value[:7].lower() == "bearer " else None
