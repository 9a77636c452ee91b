"""The gateway in front of the replicas' /v1 routes: it reads a request's body, so it can route
by the OpenAI `user` field and by a hash of the prompt (affinity.body_key), which Ray's proxy
cannot: the proxy picks a replica before it reads a body (docs/scale-out.md).

Two halves, both plain ASGI and free of Ray, so they are tested in-process:
- `Gateway`, the gateway's app: reads the body (up to a limit), makes the routing key and hands
  the request, as picklable values, to `forward(key, scope, body)`, which returns the reply as
  ASGI messages (ray_app.GatewayIngress forwards through a Ray handle to the chosen replica).
- `call_asgi`, on the replica: runs the unchanged chatserve app on that scope and body and
  yields the messages it sends.
A client that leaves mid-stream is seen by the gateway (http.disconnect), which closes the
forwarding; the replica then tells its app the client disconnected, and the engine aborts.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from chatserve import protocol as P
from chatserve.openai_protocol import openai_error
from chatserve.scale.affinity import body_key, session_key

# The scope's fields that cross to the replica (the rest are the server's own objects).
SCOPE_FIELDS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string",
                "headers", "client", "server")
APP_EXIT_TIMEOUT = 10.0  # seconds an app gets to end after its client disconnected


def routing_key(scope: dict, body: bytes) -> str | None:
    """A request's key: the session header or query parameter, else the body's (body_key)."""
    return session_key(scope) or body_key(body)


def forwarded_scope(scope: dict) -> dict:
    """The picklable part of an HTTP scope, its path whole again (a mount or a route prefix may
    have split it into root_path and path)."""
    out = {k: scope[k] for k in SCOPE_FIELDS if k in scope}
    root, path = scope.get("root_path", ""), scope.get("path", "")
    if root and not path.startswith(root):
        out["path"] = root + path
        out["raw_path"] = out["path"].encode()
    out["root_path"] = ""
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers") or ()]
    for name in ("client", "server"):
        if out.get(name) is not None:
            out[name] = tuple(out[name])
    return out


async def call_asgi(app, scope: dict, body: bytes) -> AsyncIterator[dict]:
    """Run `app` on one HTTP request (`scope`, its whole `body`) and yield what it sends, as it
    sends it. Closing the iterator before the end means the client left: the app's receive()
    then returns http.disconnect, and the app gets APP_EXIT_TIMEOUT seconds to end."""
    queue: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False
    done = object()

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await queue.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            queue.put_nowait(done)

    task = asyncio.create_task(run())
    try:
        while (message := await queue.get()) is not done:
            yield message
        await task  # an app's own error surfaces here
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, APP_EXIT_TIMEOUT)
            except (asyncio.CancelledError, Exception):  # timed out, or the app failed on its way out
                task.cancel()


Forward = Callable[[str | None, dict, bytes], AsyncIterator[dict]]


class Gateway:
    """ASGI app: route an HTTP request by its key, pass it on with `forward`, relay the reply.

    A body over `max_body_bytes` is refused here with the server's own 413 (never read whole);
    a websocket is refused (the /ws path is routed by Ray's proxy, not by this gateway)."""

    def __init__(self, forward: Forward, max_body_bytes: int):
        self.forward = forward
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = await self._read_body(receive, scope)
        if body is None:
            await _send_error(send, P.TOO_LARGE, f"request body is larger than the {self.max_body_bytes}-byte limit", 413)
            return
        if body is False:  # the client left while sending
            return
        messages = self.forward(routing_key(scope, body), forwarded_scope(scope), body)
        started = []
        relay = asyncio.create_task(_relay(messages, send, started))
        left = asyncio.create_task(_wait_disconnect(receive))
        try:
            await asyncio.wait((relay, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not relay.done():  # the client left: stop the reply where it is
                relay.cancel()
                await asyncio.gather(relay, return_exceptions=True)
                return
        if relay.exception() is not None and not started:  # no replica answered: say so, in the API's shape
            await _send_error(send, P.ENGINE_ERROR, f"no replica could serve the request: {relay.exception()!r}", 503)
            return
        relay.result()

    async def _read_body(self, receive, scope) -> bytes | None | bool:
        """The body; None when it passes the limit (from Content-Length, or as it arrives);
        False when the client disconnected first."""
        for name, value in scope.get("headers") or ():
            if name.lower() == b"content-length":
                try:
                    if int(value) > self.max_body_bytes:
                        return None
                except ValueError:
                    pass  # the replica's own check answers a bad Content-Length
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return bytes(body)


async def _relay(messages: AsyncIterator[dict], send, started: list) -> None:
    try:
        async for message in messages:
            if not started:
                started.append(True)
            await send(message)
    finally:
        await messages.aclose()


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_error(send, code: str, message: str, status: int) -> None:
    """An error in the OpenAI shape the replicas' own API uses (openai_protocol.openai_error)."""
    data = json.dumps(openai_error(code, message, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
