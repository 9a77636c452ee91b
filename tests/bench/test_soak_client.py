"""The soak's websocket client against a scripted server that behaves as chatserve's /ws does
(deltas one at a time, a cancel of a running turn answered with `done: abort`, a cancel that
arrives after the turn's `done` answered with nothing): every cancel is read to exactly one end
and none waits for an answer that never comes."""

import asyncio
import json
import random

import pytest

from chatserve.bench.soak import Outcome, Soak, SoakPlan


class ScriptedWs:
    """One turn of `num_deltas` deltas then `done`; `finishes_first`: the reply ends before the
    server reads a cancel sent behind the chat (a tiny model, a short reply)."""

    def __init__(self, num_deltas: int, finishes_first: bool = False):
        self.num_deltas, self.finishes_first = num_deltas, finishes_first
        self.sent: list[dict] = []
        self.pending: list[dict] = []
        self.running = False

    async def send(self, frame: str) -> None:
        msg = json.loads(frame)
        self.sent.append(msg)
        if msg["type"] == "chat":
            self.turn_id, self.running, self.left = msg["id"], True, self.num_deltas
            if self.finishes_first:
                while self.running:
                    self.pending.append(self._next())
        elif msg["type"] == "cancel" and self.running:
            self.running = False
            self.pending.append({"type": "done", "id": self.turn_id, "finish_reason": "abort"})

    def _next(self) -> dict:
        if self.left:
            self.left -= 1
            return {"type": "delta", "id": self.turn_id, "text": "x"}
        self.running = False
        return {"type": "done", "id": self.turn_id, "finish_reason": "length"}

    async def recv(self) -> str:
        if not self.pending and self.running:
            self.pending.append(self._next())
        if not self.pending:
            await asyncio.Future()  # nothing more will come: the client waits forever
        return json.dumps(self.pending.pop(0))


class FixedDeltas(random.Random):
    """A generator whose cancel point (`randint(0, 3)`) is fixed."""

    def __init__(self, num_deltas: int):
        super().__init__(0)
        self.num_deltas = num_deltas

    def randint(self, a: int, b: int) -> int:
        return self.num_deltas if (a, b) == (0, 3) else super().randint(a, b)


def run_cancel(ws: ScriptedWs, cancel_after: int) -> Outcome:
    soak = Soak(SoakPlan(url="http://127.0.0.1:1", max_tokens=8), server_pid=None, progress=lambda _: None)
    outcome = Outcome("cancel", "ws")

    async def go():
        async with asyncio.timeout(2):
            assert await soak.ws_request(ws, FixedDeltas(cancel_after), 0, outcome) is True

    asyncio.run(go())
    return outcome


@pytest.mark.parametrize("cancel_after", [0, 1, 2, 3])
@pytest.mark.parametrize("reply_deltas", [0, 1, 2, 5])
def test_a_cancel_is_read_to_one_done_whenever_the_reply_ends(reply_deltas, cancel_after):
    ws = ScriptedWs(reply_deltas)
    outcome = run_cancel(ws, cancel_after)
    assert outcome.answered, outcome.error
    cancels = [m for m in ws.sent if m["type"] == "cancel"]
    # a cancel goes out behind the chat (0), or after that many deltas if the reply is still running
    assert len(cancels) == (1 if cancel_after == 0 or reply_deltas >= cancel_after else 0)
    assert not ws.pending and not ws.running  # every answer was read


@pytest.mark.parametrize("reply_deltas", [0, 3])
def test_a_cancel_behind_the_chat_that_crosses_the_done_is_not_waited_for(reply_deltas):
    ws = ScriptedWs(reply_deltas, finishes_first=True)
    outcome = run_cancel(ws, 0)
    assert outcome.answered and outcome.detail == "prefill"
    assert [m["type"] for m in ws.sent] == ["chat", "cancel"] and not ws.pending
