"""Admission: how much work the server has taken on, and when it says no. No I/O.

Two counts, each bounded. Connections: open websockets + in-flight HTTP generations
(max_connections). Generations: websocket turns + HTTP completions, from admission to their last
delta. The engine runs max_running of them (its max_num_seqs) and queues the rest, so at most
max_running + max_queued_requests may be in flight; one more is refused with 429 and Retry-After
rather than left waiting without bound. (vLLM's --max-num-queued-reqs caps the same sum in front
of its engine, also with 429; llama.cpp's server queues without a bound.) While draining for
shutdown everything new is refused with 503.
"""

from __future__ import annotations

import asyncio

from chatserve import protocol as P
from chatserve.config import ServerConfig

BUSY_RETRY_AFTER = 1  # seconds: a slot frees when any one generation or connection ends
SHUTDOWN_RETRY_AFTER = 5  # seconds: long enough for a supervisor to restart the server


class Admission:
    def __init__(self, config: ServerConfig, max_running: int):
        self.max_connections = config.max_connections
        self.max_running = max_running
        self.max_queued = config.max_queued_requests
        self.num_connections = 0
        self.num_generations = 0
        self.is_draining = False
        self._no_generations = asyncio.Event()
        self._no_generations.set()

    def acquire_connection(self) -> None:
        self._check_not_draining()
        if self.num_connections >= self.max_connections:
            raise P.ProtocolError(P.TOO_MANY_CONNECTIONS, f"server busy: {self.max_connections} connections "
                                  "already open; retry later", 503, retry_after=BUSY_RETRY_AFTER)
        self.num_connections += 1

    def release_connection(self) -> None:
        self.num_connections -= 1

    @property
    def max_generations(self) -> int:
        return self.max_running + self.max_queued

    def acquire_generation(self, num: int = 1) -> None:
        """`num` generations at once (the choices of an n > 1 request), all or none."""
        self._check_not_draining()
        if self.num_generations + num > self.max_generations:
            raise P.ProtocolError(P.QUEUE_FULL, f"server busy: {self.num_generations} generations in flight, the "
                                  f"limit ({self.max_running} running + {self.max_queued} queued); retry later",
                                  429, retry_after=BUSY_RETRY_AFTER)
        self.num_generations += num
        self._no_generations.clear()

    def release_generation(self, num: int = 1) -> None:
        self.num_generations -= num
        if self.num_generations == 0:
            self._no_generations.set()

    def acquire_http(self) -> None:
        """An HTTP generation is a connection too: both or neither (a full queue answers first)."""
        self.acquire_generation()
        try:
            self.acquire_connection()
        except P.ProtocolError:
            self.release_generation()
            raise

    def release_http(self) -> None:
        self.release_connection()
        self.release_generation()

    def start_draining(self) -> None:
        self.is_draining = True

    async def wait_no_generations(self, timeout: float) -> bool:
        """True once no generation is in flight; False if `timeout` seconds pass first."""
        try:
            await asyncio.wait_for(self._no_generations.wait(), max(timeout, 0.0))
        except TimeoutError:
            return False
        return True

    def _check_not_draining(self) -> None:
        if self.is_draining:
            raise P.ProtocolError(P.SHUTTING_DOWN, "server shutting down; retry later", 503,
                                  retry_after=SHUTDOWN_RETRY_AFTER)
