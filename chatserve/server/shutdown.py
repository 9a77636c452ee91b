"""Graceful shutdown. On SIGTERM: stop accepting, let running generations finish for up to
`shutdown_grace` seconds, then abort the rest (their streams end with finish_reason "abort"),
and close every websocket with 1001 "server shutting down"; uvicorn's own shutdown then closes
whatever is left within timeout_graceful_shutdown.

uvicorn alone would close each websocket at once with 1012, mid-turn, and give HTTP streams
only timeout_graceful_shutdown; DrainingServer runs the drain before handing over to it.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import uvicorn

from chatserve import protocol as P
from chatserve.server.state import AppState

ABORT_WAIT = 2.0  # seconds aborted generations get to deliver their final "abort" delta
UVICORN_GRACE = 3  # uvicorn's timeout_graceful_shutdown, for what the drain leaves behind


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown drains the chat app first."""

    def __init__(self, config: uvicorn.Config, state: AppState):
        super().__init__(config)
        self.chat_state = state

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()  # stop accepting: a new connection is refused while the drain runs
        await drain(self.chat_state, self.chat_state.config.shutdown_grace, lambda: self.force_exit)
        await super().shutdown(sockets)


async def drain(state: AppState, grace: float, is_forced: Callable[[], bool]) -> None:
    """Refuse new work (503 / `shutting_down`), wait up to `grace` seconds for the generations in
    flight, abort what is still running, and close the websockets (idle ones at once)."""
    admission, loop = state.admission, asyncio.get_running_loop()
    admission.start_draining()
    print(f"chatserve: shutting down: {admission.num_generations} generation(s) running, "
          f"waiting up to {grace:g} s for them", flush=True)
    for connection in list(state.connections):
        connection.shut_down()  # idle: closed now; busy: closed after its turn's `done`
    deadline = loop.time() + grace
    while not is_forced() and loop.time() < deadline:
        if await admission.wait_no_generations(min(0.25, deadline - loop.time())):
            break
    if admission.num_generations:
        print(f"chatserve: aborting {admission.num_generations} generation(s) still running", flush=True)
        deadline = loop.time() + ABORT_WAIT
        while True:  # again each round: a turn that was still tokenizing reaches the engine later
            state.abort_all()
            if await admission.wait_no_generations(0.1) or loop.time() > deadline:
                break
    for connection in list(state.connections):
        connection.refuse(P.SHUTTING_DOWN, "server shutting down", P.CLOSE_GOING_AWAY)
