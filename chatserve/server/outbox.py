"""Outbox: the messages on their way to one websocket, written in order by one writer task.

put() never waits, so a client that stops reading stalls neither its turn nor the receive loop.
uvicorn takes a frame only while the socket's buffers have room; what the client leaves unread
beyond that piles up here, and past max_pending_bytes the outbox gives up: it drops what is
queued, ends with close code 4008 (a reason string says why) and sets `overflowed`, on which the
connection aborts its turn. Memory per connection stays under max_pending_bytes plus the
socket's buffers, however long the client stalls.
"""

from __future__ import annotations

import asyncio
from collections import deque

from starlette.websockets import WebSocket, WebSocketDisconnect

from chatserve import protocol as P


class Outbox:
    def __init__(self, websocket: WebSocket, max_pending_bytes: int):
        self.ws = websocket
        self.max_pending_bytes = max_pending_bytes
        self.num_pending_bytes = 0  # queued behind the frame being written
        self.overflowed = asyncio.Event()
        self._frames: deque[tuple[str, int]] = deque()  # (text, its UTF-8 size)
        self._wake = asyncio.Event()  # a frame, the close or the finish is waiting for the writer
        self._close: tuple[int, str] | None = None
        self._is_finishing = False
        self._writer: asyncio.Task | None = None

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write())

    def put(self, message: dict) -> None:
        """Queue one message; after close() (or an overflow) nothing more goes out."""
        if self._close is not None:
            return
        text = P.dumps(message)
        size = len(text.encode())
        # One message larger than the cap still goes out when nothing else waits (a long settings echo).
        if self._frames and self.num_pending_bytes + size > self.max_pending_bytes:
            self._overflow()
            return
        self._frames.append((text, size))
        self.num_pending_bytes += size
        self._wake.set()

    def close(self, code: int, reason: str) -> None:
        """Send what is queued, then a close frame with `code` and `reason` (cut to the frame's 123 bytes)."""
        if self._close is None:
            self._close = (code, reason.encode()[:120].decode(errors="ignore"))
            self._wake.set()

    async def finish(self, timeout: float) -> None:
        """Let the writer send what is queued (and the close frame, if asked for) for up to
        `timeout` seconds, then stop it: a client that never reads gets no more time than that."""
        if self._writer is None:
            return
        self._is_finishing = True
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._writer), timeout)
        except TimeoutError:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)

    def _overflow(self) -> None:
        self._frames.clear()
        self.num_pending_bytes = 0
        self.close(P.CLOSE_SLOW_READER, f"slow reader: over {self.max_pending_bytes} bytes of output unread")
        self.overflowed.set()

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._frames:
                    text, size = self._frames.popleft()
                    self.num_pending_bytes -= size
                    await self.ws.send_text(text)  # waits while the socket's buffers are full
                if self._close is not None:
                    await self.ws.close(*self._close)
                    return
                if self._is_finishing:
                    return
        except (WebSocketDisconnect, OSError, RuntimeError):
            pass  # the client is gone (or the socket already closed): nothing more can be sent
