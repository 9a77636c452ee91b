"""Routes: /ws chat, OpenAI-compatible /v1, /health, /metrics and the static UI.

The event loop only awaits: the engine does model work on its own thread and tokenization runs
in a worker thread. The wire format lives in protocol.py; this file parses, checks limits, awaits
engine.generate and writes. Every early exit (cancel, reset, disconnect) aborts the request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from chatserve import protocol as P
from chatserve.config import ServerConfig
from chatserve.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from chatserve.sampling_params import Delta, SamplingParams

WEB_DIR = Path(__file__).resolve().parent.parent / "web"


class _Server:
    """State shared by all routes of one app: engine, limits, metrics, connection count."""

    def __init__(self, engine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.metrics = ServerMetrics(engine)
        self.model_name = config.served_model_name or engine.model_name
        self.max_prompt_tokens = config.max_prompt_tokens or engine.max_model_len
        self.num_connections = 0  # websocket connections + in-flight HTTP generations
        self.created = int(time.time())

    # ---- access and limits

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

    def acquire_connection(self) -> None:
        if self.num_connections >= self.config.max_connections:
            raise P.ProtocolError(P.TOO_MANY_CONNECTIONS,
                                  f"server busy: {self.config.max_connections} connections already open", 503)
        self.num_connections += 1

    def release_connection(self) -> None:
        self.num_connections -= 1

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) > self.max_prompt_tokens:
            raise P.ProtocolError(P.PROMPT_TOO_LONG, f"the prompt is {len(prompt_ids)} tokens; the limit is "
                                  f"{self.max_prompt_tokens}. Start a new chat or shorten it.", param="messages")

    # ---- engine calls

    async def tokenize_chat(self, messages: list[dict]) -> list[int]:
        """The chat template runs in a worker thread. Any failure is the messages' fault (a template
        may refuse, e.g. roles that do not alternate), so it is a client error."""
        try:
            return await asyncio.to_thread(self.engine.tokenize_chat, messages)
        except Exception as e:
            raise P.ProtocolError(P.BAD_MESSAGE, f"cannot apply the chat template: {e}", param="messages") from None

    async def tokenize(self, text: str) -> list[int]:
        try:
            return await asyncio.to_thread(self.engine.tokenize, text)
        except Exception as e:
            raise P.ProtocolError(P.BAD_MESSAGE, f"cannot tokenize the prompt: {e}", param="prompt") from None

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       timer: RequestTimer) -> AsyncIterator[Delta]:
        """engine.generate plus metrics; closing this early (aclose, cancel) aborts the request.

        The engine's ValueError before the first delta becomes ProtocolError(invalid_prompt); an
        exception after that becomes ProtocolError(engine_error). An "error" delta is passed on.
        """
        deltas = self.engine.generate(prompt_ids, params, request_id)
        is_finished, num_deltas = False, 0
        try:
            async for delta in deltas:
                num_deltas += 1
                timer.on_delta(len(delta.token_ids))
                if delta.finished:
                    is_finished = True
                    timer.finish(delta.finish_reason, len(prompt_ids), delta.stats)
                yield delta
                if is_finished:
                    return
        except Exception as e:
            if isinstance(e, ValueError) and not num_deltas:
                is_finished = True  # never admitted: nothing to abort or count
                raise P.ProtocolError(P.INVALID_PROMPT, str(e)) from None
            timer.finish("error", len(prompt_ids), None)
            raise P.ProtocolError(P.ENGINE_ERROR, f"generation failed: {e}", 500) from None
        finally:
            if not is_finished:
                await deltas.aclose()
                self.engine.abort(request_id)  # idempotent; the engine's own finally may have done it
                timer.finish("abort", len(prompt_ids), None)


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


class _Connection:
    """One websocket: its conversation, settings and at most one running turn (a second chat -> busy)."""

    def __init__(self, server: _Server, websocket: WebSocket):
        self.server, self.ws = server, websocket
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
        await self.ws.accept()
        try:
            if not self.server.is_origin_allowed(self.ws.headers):
                return await self.refuse(P.FORBIDDEN_ORIGIN, f"origin {self.ws.headers.get('origin')!r} is not "
                                         "allowed; add it to allowed_origins", 1008)
            try:
                self.server.acquire_connection()
            except P.ProtocolError as e:
                return await self.refuse(e.code, e.message, 1013)
            try:
                await self._serve_messages()
            finally:
                self.server.release_connection()
                await self._stop_turn(reason="disconnect")
        except WebSocketDisconnect:
            pass  # the client left while we were sending

    async def _serve_messages(self) -> None:
        key = _bearer(self.ws.headers) or self.ws.query_params.get("api_key")
        if key is not None and not self.server.is_key_valid(key):
            return await self.refuse(P.UNAUTHORIZED, "invalid API key", 1008)
        is_authed = self.server.is_key_valid(key)
        if is_authed:
            await self.send(self._ready())
        while True:
            frame = await self.ws.receive()
            if frame["type"] == "websocket.disconnect":
                return
            try:
                message = self._parse_frame(frame)
                if not is_authed:
                    if not isinstance(message, P.Auth) or not self.server.is_key_valid(message.api_key):
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
        limit = self.server.config.max_message_bytes
        if len(text) > limit or (4 * len(text) > limit and len(text.encode("utf-8", "surrogatepass")) > limit):
            raise P.ProtocolError(P.TOO_LARGE, f"message is larger than the {limit}-byte limit")
        return P.parse_client_message(text)

    async def _dispatch(self, message: P.ClientMessage) -> None:
        if isinstance(message, P.ChatTurn):
            self._start_turn(message)
        elif isinstance(message, P.Settings):
            merged = {**self.settings, **message.params}
            P.build_sampling_params(merged, self.server.config.max_tokens_limit)  # validate before storing
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
        s = self.server
        return P.ready_message(s.model_name, s.engine.draft_name, s.engine.max_model_len,
                               s.config.max_tokens_limit, self.settings)

    def _start_turn(self, message: P.ChatTurn) -> None:
        if self.turn is not None:
            raise P.ProtocolError(P.BUSY, f"chat {self.turn.id!r} is still running; cancel it or wait for its "
                                  "`done`", id=message.id)
        try:
            params = P.build_sampling_params({**self.settings, **message.params}, self.server.config.max_tokens_limit)
        except P.ProtocolError as e:
            e.id = message.id
            raise
        if message.messages is not None:
            messages = message.messages
        else:
            messages = [*self.history, {"role": "user", "content": message.content}]
        self.num_turns += 1
        turn_id = message.id if message.id is not None else f"turn-{self.num_turns}"
        turn = _Turn(turn_id, f"ws-{uuid.uuid4().hex}", messages, self.server.metrics.start_request())
        turn.task = asyncio.create_task(self._run_turn(turn, params))
        self.turn = turn

    async def _run_turn(self, turn: _Turn, params: SamplingParams) -> None:
        try:
            prompt_ids = await self.server.tokenize_chat(turn.messages)
            self.server.check_prompt(prompt_ids)
            turn.prompt_tokens = len(prompt_ids)
            async with aclosing(self.server.generate(prompt_ids, params, turn.request_id, turn.timer)) as deltas:
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


def _bearer(headers) -> str | None:
    value = headers.get("authorization", "")
    return value[7:].strip() if value[:7].lower() == "bearer " else None


class _HttpRoutes:
    """/v1/chat/completions, /v1/completions (SSE or whole), /v1/models, /health, /metrics."""

    def __init__(self, server: _Server):
        self.server = server

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, is_chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, is_chat=False)

    async def models(self, request: Request) -> Response:
        s = self.server
        try:
            self._check_access(request)
        except P.ProtocolError as e:
            return _error_response(e)
        return JSONResponse(P.models_response(s.model_name, s.engine.max_model_len, s.created))

    async def health(self, request: Request) -> Response:
        s = self.server
        try:
            stats = s.engine.stats()
        except Exception as e:
            return JSONResponse({"status": "error", "message": f"engine.stats() failed: {e!r}"}, status_code=503)
        keys = ("num_running", "num_waiting", "num_blocks", "num_free_blocks", "kv_usage")
        return JSONResponse({"status": "ok", "model": s.model_name, "draft": s.engine.draft_name,
                             **{k: stats.get(k) for k in keys}, "num_connections": s.num_connections})

    async def metrics(self, request: Request) -> Response:
        return Response(self.server.metrics.render(), media_type=CONTENT_TYPE)

    def _check_access(self, request: Request) -> None:
        if not self.server.is_origin_allowed(request.headers):
            raise P.ProtocolError(P.FORBIDDEN_ORIGIN, f"origin {request.headers.get('origin')!r} is not allowed", 403)
        if not self.server.is_key_valid(_bearer(request.headers)):
            raise P.ProtocolError(P.UNAUTHORIZED, "missing or invalid API key (Authorization: Bearer <key>)", 401)

    async def _read_json(self, request: Request):
        limit = self.server.config.max_message_bytes
        too_large = P.ProtocolError(P.TOO_LARGE, f"request body is larger than the {limit}-byte limit", 413)
        if int(request.headers.get("content-length") or 0) > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:
            raise P.ProtocolError(P.BAD_JSON, f"request body is not valid JSON: {e}") from None

    async def _complete(self, request: Request, is_chat: bool) -> Response:
        s = self.server
        timer = s.metrics.start_request()
        try:
            self._check_access(request)
            body = await self._read_json(request)
            parse = P.parse_chat_completion_request if is_chat else P.parse_completion_request
            req = parse(body, s.config.max_tokens_limit)
            if req.model is not None and req.model != s.model_name:
                raise P.ProtocolError(P.MODEL_NOT_FOUND, f"model {req.model!r} does not exist; this server serves "
                                      f"{s.model_name!r}", 404, "model")
            if is_chat:
                prompt_ids = await s.tokenize_chat(req.messages)
            else:
                prompt_ids = req.prompt_token_ids or await s.tokenize(req.prompt)
            s.check_prompt(prompt_ids)
            s.acquire_connection()
        except P.ProtocolError as e:
            return _error_response(e)
        request_id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex
        deltas = s.generate(prompt_ids, req.params, request_id, timer)

        async def close() -> None:
            await deltas.aclose()
            s.release_connection()

        try:  # wait for the first delta before answering: the engine's ValueError (too long) becomes a 400
            first = await _until_disconnect(request, anext(deltas))
        except BaseException as e:
            await close()
            if isinstance(e, StopAsyncIteration):
                e = P.ProtocolError(P.ENGINE_ERROR, "the engine produced no output", 500)
            if not isinstance(e, P.ProtocolError):
                raise
            return _error_response(e)
        if first is None:
            await close()
            return Response(status_code=499)  # the client left during the prefill
        shape = _Shape(is_chat, request_id, s.model_name, int(time.time()), req.include_usage)
        if req.stream:
            return _SSEResponse(self._events(shape, first, deltas, len(prompt_ids)), close)
        try:
            whole = await _until_disconnect(request, self._whole(shape, first, deltas, len(prompt_ids)))
            return whole or Response(status_code=499)
        except P.ProtocolError as e:
            return _error_response(e)
        finally:
            await close()

    async def _events(self, shape: "_Shape", first: Delta, deltas, num_prompt_tokens: int) -> AsyncIterator[str]:
        if shape.is_chat:
            yield _sse(shape.chunk("", None, role=True))
        delta, num_tokens = first, 0
        while True:
            num_tokens += len(delta.token_ids)
            if delta.finish_reason == "error":
                yield _sse(P.openai_error(P.ENGINE_ERROR, f"generation failed: {delta.error}", 500))
                break
            if delta.text:
                yield _sse(shape.chunk(delta.text, None))
            if delta.finished:
                yield _sse(shape.chunk("", delta.finish_reason))
                if shape.include_usage:
                    yield _sse(shape.usage_chunk(_usage(delta, num_prompt_tokens, num_tokens)))
                break
            try:
                delta = await anext(deltas, None)
            except P.ProtocolError as e:  # headers are sent: report in-band, as OpenAI does
                yield _sse(P.openai_error(e.code, e.message, e.status))
                break
            if delta is None:
                break
        yield "data: [DONE]\n\n"

    async def _whole(self, shape: "_Shape", first: Delta, deltas, num_prompt_tokens: int) -> Response:
        parts, num_tokens, delta = [], 0, first
        while True:
            parts.append(delta.text)
            num_tokens += len(delta.token_ids)
            following = None if delta.finished else await anext(deltas, None)
            if following is None:
                break
            delta = following
        if delta.finish_reason == "error":
            return _error_response(P.ProtocolError(P.ENGINE_ERROR, f"generation failed: {delta.error}", 500))
        usage = _usage(delta, num_prompt_tokens, num_tokens)
        return JSONResponse(shape.whole("".join(parts), delta.finish_reason or "abort", usage))


@dataclass(frozen=True)
class _Shape:
    """Shapes chunks and responses for one OpenAI request (chat or text completion)."""

    is_chat: bool
    id: str
    model: str
    created: int
    include_usage: bool

    def chunk(self, text: str, finish_reason: str | None, role: bool = False) -> dict:
        if not self.is_chat:
            return P.completion_response(self.id, self.model, self.created, text, finish_reason,
                                         with_usage=self.include_usage)
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        return P.chat_completion_chunk(self.id, self.model, self.created, delta, finish_reason, self.include_usage)

    def usage_chunk(self, usage: dict) -> dict:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        return P.usage_chunk(kind, self.id, self.model, self.created, usage)

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.is_chat:
            return P.chat_completion_response(self.id, self.model, self.created, text, finish_reason, usage)
        return P.completion_response(self.id, self.model, self.created, text, finish_reason, usage)


class _SSEResponse(StreamingResponse):
    """Server-sent events whose generator and engine request are closed however the stream ends."""

    def __init__(self, events: AsyncIterator[str], close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.close()


async def _until_disconnect(request: Request, work):
    """Await `work`, or cancel it and return None if the client disconnects first (Starlette only
    watches for disconnects while a StreamingResponse is being sent)."""
    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work_task, watch_task = asyncio.ensure_future(work), asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
    await asyncio.gather(watch_task, work_task, return_exceptions=True)
    return None if work_task.cancelled() else work_task.result()


def _usage(last: Delta, num_prompt_tokens: int, num_tokens: int) -> dict:
    stats = last.stats
    if stats is None:
        return P.usage_dict(num_prompt_tokens, num_tokens, None)
    return P.usage_dict(stats.prompt_tokens or num_prompt_tokens, stats.num_generated, stats.cached_tokens)


def _sse(obj: dict) -> str:
    return f"data: {P.dumps(obj)}\n\n"


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """404/405 under /v1 in OpenAI's error shape; plain text elsewhere (the static UI)."""
    if not request.url.path.startswith("/v1/"):
        return Response(exc.detail, status_code=exc.status_code, headers=exc.headers)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _error_response(P.ProtocolError(code, f"{request.method} {request.url.path}: {exc.detail}",
                                           exc.status_code))


def _error_response(error: P.ProtocolError) -> JSONResponse:
    return JSONResponse(P.openai_error(error.code, error.message, error.status, error.param), status_code=error.status)


def create_app(engine, config: ServerConfig) -> Starlette:
    """The whole server as one ASGI app; `engine` implements the AsyncEngine interface."""
    server = _Server(engine, config)
    http = _HttpRoutes(server)

    async def websocket_endpoint(websocket: WebSocket) -> None:
        await _Connection(server, websocket).serve()

    routes = [
        WebSocketRoute("/ws", websocket_endpoint),
        Mount("/v1", routes=[  # a mount of its own, so /v1 404s and 405s never fall through to the UI
            Route("/chat/completions", http.chat_completions, methods=["POST"]),
            Route("/completions", http.completions, methods=["POST"]),
            Route("/models", http.models, methods=["GET"]),
        ]),
        Route("/health", http.health, methods=["GET"]),
        Route("/metrics", http.metrics, methods=["GET"]),
        Mount("/", app=StaticFiles(directory=WEB_DIR, html=True, check_dir=False), name="web"),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})
    app.state.server = server
    return app


def make_uvicorn_server(engine, config: ServerConfig, log_level: str = "info"):
    """uvicorn with uvloop and sans-I/O websockets, serving create_app(engine, config)."""
    import uvicorn

    # Frames up to 4x the limit reach the app and get a clear `too_large` error; bigger ones are
    # closed by the protocol layer with code 1009.
    uv_config = uvicorn.Config(create_app(engine, config), host=config.host, port=config.port, loop="uvloop",
                               ws="websockets-sansio", ws_max_size=4 * config.max_message_bytes,
                               log_level=log_level)
    return uvicorn.Server(uv_config)


def run_server(engine, config: ServerConfig) -> None:
    """Serve `engine` until interrupted; prints the URL to open."""
    server = make_uvicorn_server(engine, config)
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    host = f"[{host}]" if ":" in host else host
    hint = "  (append ?api_key=<key> to the URL)" if config.api_key else ""
    print(f"chatserve: serving {engine.model_name} - open http://{host}:{config.port}/{hint}", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl+C after its graceful shutdown
        print("chatserve: stopped", flush=True)
