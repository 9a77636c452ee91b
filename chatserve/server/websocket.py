"""The /ws chat route: one Connection per socket, holding its conversation, settings and running turn.

Messages are parsed by protocol.py; every early exit (cancel, reset, disconnect) aborts the request.
docs/protocol.md describes the conversation from the client's side.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import aclosing, suppress
from dataclasses import dataclass, field

from starlette.websockets import WebSocket, WebSocketDisconnect

from chatserve import protocol as P
from chatserve.metrics import RequestTimer
from chatserve.sampling_params import Delta, SamplingParams
from chatserve.server.access import bearer_token
from chatserve.server.state import AppState


@dataclass
class _Turn:
    """One chat turn on a websocket: the reply so far, for the history and for stats after a cancel."""

    id: str | int
    request_id: str
    messages: list[dict]  # the conversation including this turn's user message
    timer: RequestTimer
    task: asyncio.Task | None = None
    prompt_tokens: int | None = None
    parts: list[str] = field(default_factory=list)
    num_pending_tokens: int = 0  # tokens whose text has not been sent yet (partial UTF-8, stop-string hold)
    is_finished: bool = False

    def reply(self) -> dict:
        return {"role": "assistant", "content": "".join(self.parts)}

    def partial_stats(self) -> P.DoneStats:
        return P.DoneStats(ttft_ms=self.timer.ttft_ms, tpot_ms=self.timer.tpot_ms,
                           prompt_tokens=self.prompt_tokens, generated_tokens=self.timer.num_tokens)


class Connection:
    """One websocket: its conversation, settings and at most one running turn (a second chat -> busy)."""

    def __init__(self, state: AppState, websocket: WebSocket):
        self.state, self.ws = state, websocket
        self.history: list[dict] = []
        self.settings: dict = {}
        self.turn: _Turn | None = None
        self.num_turns = 0
        self.send_lock = asyncio.Lock()  # the turn task and the receive loop both send

    async def send(self, message: dict) -> None:
        async with self.send_lock:
            await self.ws.send_text(P.dumps(message))

    async def refuse(self, code: str, message: str, close_code: int) -> None:
        await self.send(P.error_message(code, message))
        await self.ws.close(close_code, message.encode()[:120].decode(errors="ignore"))  # reason <= 123 bytes

    async def serve(self) -> None:
        access = self.state.access
        await self.ws.accept()
        try:
            if not access.is_origin_allowed(self.ws.headers):
                return await self.refuse(P.FORBIDDEN_ORIGIN, f"origin {self.ws.headers.get('origin')!r} is not "
                                         "allowed; add it to allowed_origins", 1008)
            try:
                access.acquire_connection()
            except P.ProtocolError as e:
                return await self.refuse(e.code, e.message, 1013)
            try:
                await self._serve_messages()
            finally:
                access.release_connection()
                await self._stop_turn(reason="disconnect")
        except WebSocketDisconnect:
            pass  # the client left while we were sending

    async def _serve_messages(self) -> None:
        access = self.state.access
        key = bearer_token(self.ws.headers) or self.ws.query_params.get("api_key")
        if key is not None and not access.is_key_valid(key):
            return await self.refuse(P.UNAUTHORIZED, "invalid API key", 1008)
        is_authed = access.is_key_valid(key)
        if is_authed:
            await self.send(self._ready())
        while True:
            frame = await self.ws.receive()
            if frame["type"] == "websocket.disconnect":
                return
            try:
                message = self._parse_frame(frame)
                if not is_authed:
                    if not isinstance(message, P.Auth) or not access.is_key_valid(message.api_key):
                        return await self.refuse(P.UNAUTHORIZED, "an API key is required: send "
                                                 '{"type":"auth","api_key":...} first', 1008)
                    is_authed = True
                await self._dispatch(message)
            except P.ProtocolError as e:
                await self.send(P.error_message(e.code, e.message, e.id))

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
            await self.send(P.settings_message(self.settings))
        elif isinstance(message, P.Cancel):
            if self.turn is not None and message.id is not None and message.id != self.turn.id:
                raise P.ProtocolError(P.UNKNOWN_ID, f"no running chat with id {message.id!r}", id=message.id)
            await self._stop_turn(reason="cancel")  # nothing running (a race with `done`) is not an error
        elif isinstance(message, P.Reset):
            await self._stop_turn(reason="reset")
            self.history = []
            await self.send(P.reset_message())
        elif isinstance(message, P.Auth):
            await self.send(self._ready())

    def _ready(self) -> dict:
        s = self.state
        return P.ready_message(s.model_name, s.engine.draft_name, s.engine.max_model_len,
                               s.config.max_tokens_limit, self.settings, s.engine.spec_methods)

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
        self.num_turns += 1
        turn_id = message.id if message.id is not None else f"turn-{self.num_turns}"
        turn = _Turn(turn_id, f"ws-{uuid.uuid4().hex}", messages, self.state.metrics.start_request())
        turn.task = asyncio.create_task(self._run_turn(turn, params))
        self.turn = turn

    async def _run_turn(self, turn: _Turn, params: SamplingParams) -> None:
        try:
            prompt_ids = await self.state.tokenize_chat(turn.messages)
            self.state.access.check_prompt(prompt_ids)
            turn.prompt_tokens = len(prompt_ids)
            async with aclosing(self.state.generate(prompt_ids, params, turn.request_id, turn.timer)) as deltas:
                async for delta in deltas:
                    await self._send_delta(turn, delta)
        except P.ProtocolError as e:
            turn.is_finished = True
            await self.send(P.error_message(e.code, e.message, turn.id))
        except Exception as e:  # a send after disconnect, or an engine bug: never leave the turn hanging
            turn.is_finished = True
            with suppress(Exception):
                await self.send(P.error_message(P.ENGINE_ERROR, f"generation failed: {e!r}", turn.id))
        else:
            if not turn.is_finished:  # the engine's stream ended without a final delta
                turn.is_finished = True
                await self.send(P.done_message(turn.id, "abort", turn.partial_stats()))
        finally:
            if turn.is_finished and self.turn is turn:
                self.turn = None

    async def _send_delta(self, turn: _Turn, delta: Delta) -> None:
        turn.num_pending_tokens += len(delta.token_ids)
        if delta.text:
            turn.parts.append(delta.text)
            await self.send(P.delta_message(turn.id, delta.text, turn.num_pending_tokens))
            turn.num_pending_tokens = 0
        if not delta.finished:
            return
        turn.is_finished = True  # from here a cancel waits for `done` instead of aborting
        if delta.finish_reason == "error":
            await self.send(P.error_message(P.ENGINE_ERROR, f"generation failed: {delta.error}", turn.id))
            return
        self.history = [*turn.messages, turn.reply()]
        stats = P.DoneStats.from_request_stats(delta.stats) if delta.stats else turn.partial_stats()
        await self.send(P.done_message(turn.id, delta.finish_reason, stats))

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
            self.history = [*turn.messages, turn.reply()] if turn.parts else turn.messages
        await self.send(P.done_message(turn.id, "abort", turn.partial_stats()))
