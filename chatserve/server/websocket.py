"""The /ws chat route: one Connection per socket, holding its conversation, settings and running turn.

Messages are parsed by protocol.py and sent through an Outbox (outbox.py); every early exit (cancel,
reset, disconnect, a client too slow to read, shutdown) aborts the request. docs/protocol.md
describes the conversation from the client's side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field

from starlette.websockets import WebSocket

from chatserve import protocol as P
from chatserve.metrics import RequestTimer
from chatserve.sampling_params import Delta, SamplingParams
from chatserve.server.access import bearer_token
from chatserve.server.outbox import Outbox
from chatserve.server.state import AppState

CLOSE_TIMEOUT = 10.0  # seconds the last messages and the close frame get to leave (uvicorn's close_timeout)
# What each setting is when no one sets it (before the model's generation config): the `ready`
# message's `defaults`, so a client can show them.
SETTING_DEFAULTS = {f.name: list(f.default) if isinstance(f.default, tuple) else f.default
                    for f in dataclasses.fields(SamplingParams) if f.name in P.SETTINGS_KEYS and f.name != "logit_bias"}


@dataclass
class _Turn:
    """One chat turn on a websocket: the reply so far, for the history and for stats after a cancel."""

    id: str | int
    request_id: str
    messages: list[dict]  # the conversation including this turn's user message
    timer: RequestTimer
    is_continue: bool = False  # the reply extends messages[-1] (an assistant message)
    task: asyncio.Task | None = None
    prompt_tokens: int | None = None
    parts: list[str] = field(default_factory=list)
    num_pending_tokens: int = 0  # tokens whose text has not been sent yet (partial UTF-8, stop-string hold)
    pending_origins: list[str] = field(default_factory=list)  # theirs, and their pieces of text (engine.Delta)
    pending_pieces: list[str] = field(default_factory=list)
    is_finished: bool = False

    def reply(self) -> dict:
        return {"role": "assistant", "content": "".join(self.parts)}

    def history(self) -> list[dict]:
        """The conversation with this turn's reply (so far) in it."""
        if self.is_continue:
            last = self.messages[-1]
            return [*self.messages[:-1], {**last, "content": last["content"] + "".join(self.parts)}]
        return [*self.messages, self.reply()]

    def partial_stats(self) -> P.DoneStats:
        return P.DoneStats(ttft_ms=self.timer.ttft_ms, tpot_ms=self.timer.tpot_ms,
                           prompt_tokens=self.prompt_tokens, generated_tokens=self.timer.num_tokens)


class Connection:
    """One websocket: its conversation, settings and at most one running turn (a second chat -> busy)."""

    def __init__(self, state: AppState, websocket: WebSocket):
        self.state, self.ws = state, websocket
        self.outbox = Outbox(websocket, state.config.max_pending_output_bytes)
        self.history: list[dict] = []
        self.settings: dict = dict(state.sampling_defaults)
        self.turn: _Turn | None = None
        self.num_turns = 0
        self.is_shutting_down = False

    def send(self, message: dict) -> None:
        self.outbox.put(message)  # never waits: a client that does not read overflows the outbox instead

    def refuse(self, code: str, message: str, close_code: int) -> None:
        """An `error` message, then the close frame (the reason repeats the message, cut to fit)."""
        self.send(P.error_message(code, message))
        self.outbox.close(close_code, message)

    def shut_down(self) -> None:
        """The server is draining: close now if idle, else right after the running turn's `done`."""
        self.is_shutting_down = True
        if self.turn is None:
            self.refuse(P.SHUTTING_DOWN, "server shutting down", P.CLOSE_GOING_AWAY)

    async def serve(self) -> None:
        s = self.state
        await self.ws.accept()
        self.outbox.start()
        try:
            if not s.access.is_origin_allowed(self.ws.headers):
                return self.refuse(P.FORBIDDEN_ORIGIN, f"origin {self.ws.headers.get('origin')!r} is not "
                                   "allowed; add it to allowed_origins", P.CLOSE_POLICY_VIOLATION)
            try:
                s.admission.acquire_connection()
            except P.ProtocolError as e:
                is_draining = e.code == P.SHUTTING_DOWN
                return self.refuse(e.code, e.message, P.CLOSE_GOING_AWAY if is_draining else P.CLOSE_TRY_AGAIN_LATER)
            s.connections.add(self)
            try:
                await self._serve_until_overflow()
            finally:
                s.connections.discard(self)
                s.admission.release_connection()
                await self._stop_turn(reason="disconnect")
        finally:
            await self.outbox.finish(CLOSE_TIMEOUT)

    async def _serve_until_overflow(self) -> None:
        """The receive loop, cut short when the outbox overflows (the client stopped reading)."""
        receiving = asyncio.create_task(self._serve_messages())
        overflowed = asyncio.create_task(self.outbox.overflowed.wait())
        try:
            await asyncio.wait({receiving, overflowed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            receiving.cancel()
            overflowed.cancel()
            await asyncio.gather(receiving, overflowed, return_exceptions=True)
        if not receiving.cancelled() and receiving.exception() is not None:
            raise receiving.exception()

    async def _serve_messages(self) -> None:
        access = self.state.access
        key = bearer_token(self.ws.headers) or self.ws.query_params.get("api_key")
        if key is not None and not access.is_key_valid(key):
            return self.refuse(P.UNAUTHORIZED, "invalid API key", P.CLOSE_POLICY_VIOLATION)
        is_authed = access.is_key_valid(key)
        if is_authed:
            self.send(self._ready())
        while True:
            frame = await self.ws.receive()
            if frame["type"] == "websocket.disconnect":
                return
            try:
                message = self._parse_frame(frame)
                if not is_authed:
                    if not isinstance(message, P.Auth) or not access.is_key_valid(message.api_key):
                        return self.refuse(P.UNAUTHORIZED, "an API key is required: send "
                                           '{"type":"auth","api_key":...} first', P.CLOSE_POLICY_VIOLATION)
                    is_authed = True
                await self._dispatch(message)
            except P.ProtocolError as e:
                self.send(P.error_message(e.code, e.message, e.id))

    def _parse_frame(self, frame: dict) -> P.ClientMessage:
        text = frame.get("text")
        if text is None:
            raise P.ProtocolError(P.BINARY_FRAME, "binary frames are not supported; send JSON text frames")
        self.state.access.check_message_size(text)
        return P.parse_client_message(text)

    async def _dispatch(self, message: P.ClientMessage) -> None:
        if isinstance(message, P.ChatTurn):
            self._start_turn(message)
        elif isinstance(message, P.Settings):
            merged = {**self.settings, **message.params}
            params = P.build_sampling_params(merged, self.state.config.max_tokens_limit)  # validate before storing
            P.check_spec_method(params, self.state.engine.spec_methods)
            self.settings = merged
            self.send(P.settings_message(self.settings))
        elif isinstance(message, P.Cancel):
            if self.turn is not None and message.id is not None and message.id != self.turn.id:
                raise P.ProtocolError(P.UNKNOWN_ID, f"no running chat with id {message.id!r}", id=message.id)
            await self._stop_turn(reason="cancel")  # nothing running (a race with `done`) is not an error
        elif isinstance(message, P.Reset):
            await self._stop_turn(reason="reset")
            self.history = []
            self.send(P.reset_message())
        elif isinstance(message, P.Auth):
            self.send(self._ready())

    def _ready(self) -> dict:
        s = self.state
        message = P.ready_message(s.model_name, s.engine.draft_name, s.engine.max_model_len,
                                  s.config.max_tokens_limit, self.settings, s.engine.spec_methods)
        return {**message, "defaults": {**SETTING_DEFAULTS, **s.sampling_defaults}}

    def _start_turn(self, message: P.ChatTurn) -> None:
        if self.turn is not None:
            raise P.ProtocolError(P.BUSY, f"chat {self.turn.id!r} is still running; cancel it or wait for its "
                                  "`done`", id=message.id)
        try:
            params = P.build_sampling_params({**self.settings, **message.params}, self.state.config.max_tokens_limit)
            P.check_spec_method(params, self.state.engine.spec_methods)
        except P.ProtocolError as e:
            e.id = message.id
            raise
        if message.messages is not None:
            messages = message.messages
        else:
            messages = [*self.history, {"role": "user", "content": message.content}]
        try:
            self.state.admission.acquire_generation()  # released when the turn's task ends
        except P.ProtocolError as e:
            e.id = message.id
            raise
        self.num_turns += 1
        turn_id = message.id if message.id is not None else f"turn-{self.num_turns}"
        turn = _Turn(turn_id, f"ws-{uuid.uuid4().hex}", messages, self.state.metrics.start_request(),
                     is_continue=message.is_continue)
        turn.task = asyncio.create_task(self._run_turn(turn, params))
        self.turn = turn

    async def _run_turn(self, turn: _Turn, params: SamplingParams) -> None:
        try:
            prompt_ids = await self.state.tokenize_chat(turn.messages, continue_final_message=turn.is_continue)
            self.state.access.check_prompt(prompt_ids)
            turn.prompt_tokens = len(prompt_ids)
            async with aclosing(self.state.generate(prompt_ids, params, turn.request_id, turn.timer)) as deltas:
                async for delta in deltas:
                    self._send_delta(turn, delta)
        except P.ProtocolError as e:
            turn.is_finished = True
            self.send(P.error_message(e.code, e.message, turn.id))
        except Exception as e:  # an engine bug: never leave the turn hanging
            turn.is_finished = True
            self.send(P.error_message(P.ENGINE_ERROR, f"generation failed: {e!r}", turn.id))
        else:
            if not turn.is_finished:  # the engine's stream ended without a final delta
                turn.is_finished = True
                self.send(P.done_message(turn.id, "abort", turn.partial_stats()))
        finally:
            self.state.admission.release_generation()
            if turn.is_finished and self.turn is turn:
                self.turn = None
                if self.is_shutting_down:
                    self.shut_down()

    def _send_delta(self, turn: _Turn, delta: Delta) -> None:
        turn.num_pending_tokens += len(delta.token_ids)
        if delta.origins is not None:
            turn.pending_origins += delta.origins
            turn.pending_pieces += delta.pieces
        if delta.text:
            turn.parts.append(delta.text)
            tokens = list(zip(turn.pending_pieces, turn.pending_origins)) or None
            self.send(P.delta_message(turn.id, delta.text, turn.num_pending_tokens, tokens))
            turn.num_pending_tokens = 0
            turn.pending_origins, turn.pending_pieces = [], []
        if not delta.finished:
            return
        turn.is_finished = True  # from here a cancel waits for `done` instead of aborting
        if delta.finish_reason == "error":
            self.send(P.error_message(P.ENGINE_ERROR, f"generation failed: {delta.error}", turn.id))
            return
        self.history = turn.history()
        stats = P.DoneStats.from_request_stats(delta.stats) if delta.stats else turn.partial_stats()
        self.send(P.done_message(turn.id, delta.finish_reason, stats))

    async def _stop_turn(self, reason: str) -> None:
        """Cancel the running turn (its generator's finally aborts the request), then report it.

        cancel: the partial reply joins the history (what the user saw is what the model sees next turn).
        reset: the turn is dropped. disconnect: nothing is sent.
        """
        turn = self.turn
        if turn is None:
            return
        if not turn.is_finished:
            turn.task.cancel()
        await asyncio.gather(turn.task, return_exceptions=True)
        self.turn = None
        if turn.is_finished or reason == "disconnect":
            return
        if reason == "cancel":
            self.history = turn.history() if turn.parts else turn.messages
        self.send(P.done_message(turn.id, "abort", turn.partial_stats()))
