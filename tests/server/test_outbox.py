"""Outbox against a websocket stand-in whose send blocks while `is_writable` is clear, as
uvicorn's does while the socket's buffers are full. test_backpressure.py runs a real slow reader."""

from __future__ import annotations

import asyncio
import json

from chatserve import protocol as P
from chatserve.server.outbox import Outbox


class StalledSocket:
    def __init__(self):
        self.is_writable = asyncio.Event()
        self.sent: list[dict] = []
        self.closed: tuple[int, str] | None = None

    async def send_text(self, text: str) -> None:
        await self.is_writable.wait()
        self.sent.append(json.loads(text))

    async def close(self, code: int, reason: str) -> None:
        await self.is_writable.wait()
        self.closed = (code, reason)


def message(i: int, size: int = 100) -> dict:
    return {"type": "delta", "i": i, "text": "x" * size}


def started_outbox(writable: bool) -> tuple[StalledSocket, Outbox]:
    """A socket (reading or stalled) and a started Outbox over it with a 1000-byte cap."""
    ws = StalledSocket()
    if writable:
        ws.is_writable.set()
    outbox = Outbox(ws, max_pending_bytes=1000)
    outbox.start()
    return ws, outbox


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_reader_keeping_up_gets_everything_in_order_then_the_close():
    async def run():
        ws, outbox = started_outbox(writable=True)
        for i in range(50):  # 50 x ~130 bytes, far past the cap, but each leaves before the next comes
            outbox.put(message(i))
            await settle()
        outbox.close(1001, "server shutting down")
        outbox.put(message(99))  # after close: dropped
        await outbox.finish(timeout=5)
        return ws, outbox

    ws, outbox = asyncio.run(run())
    assert [m["i"] for m in ws.sent] == list(range(50)) and ws.closed == (1001, "server shutting down")
    assert not outbox.overflowed.is_set() and outbox.num_pending_bytes == 0


def test_a_stalled_reader_overflows_at_the_cap_and_gets_4008_once_it_reads():
    async def run():
        ws, outbox = started_outbox(writable=False)
        outbox.put(message(0))
        await settle()  # the writer took message 0 and is stuck sending it
        num_put = 1
        while not outbox.overflowed.is_set():
            assert outbox.num_pending_bytes <= 1000
            outbox.put(message(num_put))
            num_put += 1
        outbox.put(message(999))  # nothing more is queued after the overflow
        ws.is_writable.set()  # the client reads again
        await outbox.finish(timeout=5)
        return ws, outbox, num_put

    ws, outbox, num_put = asyncio.run(run())
    assert 7 <= num_put <= 9  # ~130-byte messages behind the one in flight, up to 1,000 bytes
    assert [m["i"] for m in ws.sent] == [0]  # the queue was dropped; what was in flight went out
    assert ws.closed[0] == P.CLOSE_SLOW_READER and "slow reader: over 1000 bytes" in ws.closed[1]


def test_one_message_over_the_cap_still_goes_out_when_nothing_waits():
    async def run():
        ws, outbox = started_outbox(writable=True)
        outbox.put(message(0, size=5000))  # e.g. a settings echo with long stop strings
        await outbox.finish(timeout=5)
        return ws, outbox

    ws, outbox = asyncio.run(run())
    assert len(ws.sent) == 1 and not outbox.overflowed.is_set()


def test_finish_gives_a_reader_that_never_reads_no_more_than_the_timeout():
    async def run():
        ws, outbox = started_outbox(writable=False)
        outbox.put(message(0))
        outbox.close(1001, "server shutting down")
        await outbox.finish(timeout=0.05)  # returns: the writer is cancelled
        return ws

    ws = asyncio.run(run())
    assert ws.sent == [] and ws.closed is None
