"""OpenAI-compatible routes: /v1/chat/completions and /v1/completions (SSE or whole), /v1/models,
and vLLM's /tokenize, /detokenize and /version.

A request is checked (access, then admission: a full queue is a 429 before the body is read;
then body, limits) and waits for its first delta before any header is sent, so refusals are
proper OpenAI error responses; after that, errors are reported in-band.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from chatserve import openai_protocol as OP
from chatserve import protocol as P
from chatserve.sampling_params import Delta
from chatserve.server.state import AppState
from chatserve.tool_calls import ToolCall, ToolCallParser


def _access_checked(route):
    """`route` behind the access check (Origin, API key); a ProtocolError from either becomes an
    OpenAI error response."""
    @functools.wraps(route)
    async def checked(self: "OpenAIRoutes", request: Request) -> Response:
        try:
            self.state.access.check_http(request.headers)
            return await route(self, request)
        except P.ProtocolError as e:
            return error_response(e)
    return checked


class OpenAIRoutes:
    def __init__(self, state: AppState):
        self.state = state

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, is_chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, is_chat=False)

    @_access_checked
    async def models(self, request: Request) -> Response:
        s = self.state
        return JSONResponse(OP.models_response(s.model_name, s.engine.max_model_len, s.created))

    @_access_checked
    async def model(self, request: Request) -> Response:
        s = self.state
        self._check_model(request.path_params["model_id"])
        return JSONResponse(OP.model_object(s.model_name, s.engine.max_model_len, s.created))

    @_access_checked
    async def tokenize(self, request: Request) -> Response:
        """A prompt, or messages through the chat template as /v1/chat/completions applies it."""
        s = self.state
        req = OP.parse_tokenize_request(await self._read_json(request))
        if req.messages is not None:
            token_ids = await s.tokenize_chat(req.messages, req.add_generation_prompt)
        else:
            token_ids = await s.tokenize(req.prompt)
        return JSONResponse({"tokens": token_ids, "count": len(token_ids), "max_model_len": s.engine.max_model_len})

    @_access_checked
    async def detokenize(self, request: Request) -> Response:
        s = self.state
        token_ids = OP.parse_detokenize_request(await self._read_json(request), s.engine.vocab_size)
        return JSONResponse({"prompt": await s.detokenize(token_ids)})

    @_access_checked
    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": importlib.metadata.version("chatserve")})

    def _check_model(self, model: str) -> None:
        if model != self.state.model_name:
            raise P.ProtocolError(P.MODEL_NOT_FOUND, f"model {model!r} does not exist; this server serves "
                                  f"{self.state.model_name!r}", 404, "model")

    async def _read_json(self, request: Request):
        """The body, refused (413) from its Content-Length or as soon as the bytes read pass the
        limit, so a 100 MB upload is never held; then parsed behind protocol.loads' depth limit."""
        limit = self.state.config.max_message_bytes
        too_large = P.ProtocolError(P.TOO_LARGE, f"request body is larger than the {limit}-byte limit", 413)
        try:
            declared = int(request.headers.get("content-length") or 0)
        except ValueError:
            raise P.ProtocolError(P.BAD_MESSAGE, "Content-Length is not a number") from None
        if declared > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        return P.loads(bytes(body), "request body")

    async def _complete(self, request: Request, is_chat: bool) -> Response:
        s = self.state
        try:
            s.access.check_http(request.headers)
            s.admission.acquire_http()
        except P.ProtocolError as e:
            return error_response(e)
        is_released = False

        def release() -> None:  # exactly once, however the request ends
            nonlocal is_released
            if not is_released:
                is_released = True
                s.admission.release_http()

        try:
            return await self._admitted(request, is_chat, release)
        except BaseException:
            release()
            raise

    async def _admitted(self, request: Request, is_chat: bool, release) -> Response:
        """_complete once admitted; `release` frees the admission, here or when a stream ends."""
        s = self.state
        timer = s.metrics.start_request()
        try:
            body = await self._read_json(request)
            if is_chat:
                req = OP.parse_chat_completion_request(body, s.config.max_tokens_limit, s.engine.max_model_len,
                                                      s.sampling_defaults, s.engine.are_tool_tags_tokens)
            else:
                req = OP.parse_completion_request(body, s.config.max_tokens_limit, s.engine.max_model_len,
                                                 s.sampling_defaults)
            P.check_spec_method(req.params, s.engine.spec_methods)
            if req.model is not None:
                self._check_model(req.model)
            if is_chat:
                prompt_ids = await s.tokenize_chat(req.messages, tools=req.tools)
            else:
                prompt_ids = req.prompt_token_ids or await s.tokenize(req.prompt)
            s.access.check_prompt(prompt_ids)
        except P.ProtocolError as e:
            release()
            return error_response(e)
        request_id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex
        params = OP.fit_to_context(req.params, len(prompt_ids), s.engine.max_model_len)
        deltas = s.generate(prompt_ids, params, request_id, timer)

        async def close() -> None:
            try:
                await deltas.aclose()
            finally:
                release()

        try:  # wait for the first delta before answering: the engine's ValueError (too long) becomes a 400
            first = await _until_disconnect(request, anext(deltas))
        except BaseException as e:
            await close()
            if isinstance(e, StopAsyncIteration):
                e = P.ProtocolError(P.ENGINE_ERROR, "the engine produced no output", 500)
            if not isinstance(e, P.ProtocolError):
                raise
            return error_response(e)
        if first is None:
            await close()
            return Response(status_code=499)  # the client left during the prefill
        token_text = (lambda t: s.engine.detokenize([t])) if req.params.logprobs is not None else None
        shape = _Shape(is_chat, request_id, s.model_name, int(time.time()), req.include_usage, token_text,
                       tool_names=None if req.tools is None else tuple(t["function"]["name"] for t in req.tools),
                       max_tool_calls=None if req.is_parallel_tool_calls else 1)
        if req.stream:
            return _SSEResponse(self._events(shape, first, deltas, len(prompt_ids)), close)
        try:
            whole = await _until_disconnect(request, self._whole(shape, first, deltas, len(prompt_ids)))
            return whole or Response(status_code=499)
        except P.ProtocolError as e:
            return error_response(e)
        finally:
            await close()

    async def _events(self, shape: "_Shape", first: Delta, deltas, num_prompt_tokens: int) -> AsyncIterator[str]:
        if shape.is_chat:
            yield _sse(shape.chunk("", None, role=True))
        delta, num_tokens, text_offset = first, 0, 0
        parser = shape.tool_call_parser()
        while True:
            num_tokens += len(delta.token_ids)
            if delta.finish_reason == "error":
                yield _sse(OP.openai_error(P.ENGINE_ERROR, f"generation failed: {delta.error}", 500))
                break
            logprobs = shape.logprobs(delta.logprobs, text_offset)
            pieces = _pieces(parser, delta.text, is_last=delta.finished)
            for piece in pieces or ([""] if logprobs else []):  # logprobs ride on the delta's first chunk
                yield _sse(shape.piece_chunk(piece, parser, logprobs))
                logprobs = None
            text_offset += len(delta.text)
            if delta.finished:
                yield _sse(shape.chunk("", shape.finish_reason(delta.finish_reason, parser)))
                if shape.include_usage:
                    yield _sse(shape.usage_chunk(_usage(delta, num_prompt_tokens, num_tokens)))
                break
            try:
                delta = await anext(deltas, None)
            except P.ProtocolError as e:  # headers are sent: report in-band, as OpenAI does
                yield _sse(OP.openai_error(e.code, e.message, e.status))
                break
            if delta is None:
                break
        yield "data: [DONE]\n\n"

    async def _whole(self, shape: "_Shape", first: Delta, deltas, num_prompt_tokens: int) -> Response:
        parts, num_tokens, delta, token_logprobs = [], 0, first, []
        while True:
            parts.append(delta.text)
            token_logprobs += delta.logprobs or []
            num_tokens += len(delta.token_ids)
            following = None if delta.finished else await anext(deltas, None)
            if following is None:
                break
            delta = following
        if delta.finish_reason == "error":
            return error_response(P.ProtocolError(P.ENGINE_ERROR, f"generation failed: {delta.error}", 500))
        usage = _usage(delta, num_prompt_tokens, num_tokens)
        logprobs = shape.logprobs(token_logprobs, 0)
        parser = shape.tool_call_parser()
        text = "".join(parts)
        if parser is not None:
            text = "".join(p for p in _pieces(parser, text, is_last=True) if isinstance(p, str))
        finish_reason = shape.finish_reason(delta.finish_reason or "abort", parser)
        return JSONResponse(shape.whole(text, finish_reason, usage, logprobs, parser.calls if parser else None))


def _pieces(parser: ToolCallParser | None, text: str, is_last: bool) -> list:
    """A delta's text -> what to send now: content strings and ToolCalls (without tools: the text)."""
    if parser is None:
        return [text] if text else []
    return parser.feed(text) + (parser.finish() if is_last else [])


@dataclass(frozen=True)
class _Shape:
    """Shapes chunks and responses for one OpenAI request (chat or text completion)."""

    is_chat: bool
    id: str
    model: str
    created: int
    include_usage: bool
    token_text: Callable[[int], str] | None = None  # set when logprobs were asked for
    tool_names: tuple[str, ...] | None = None  # the tools offered; None: the reply is not parsed for calls
    max_tool_calls: int | None = None  # parallel_tool_calls false: 1

    def tool_call_parser(self) -> ToolCallParser | None:
        return None if self.tool_names is None else ToolCallParser(self.max_tool_calls, self.tool_names)

    @staticmethod
    def finish_reason(reason: str, parser: ToolCallParser | None) -> str:
        """OpenAI's "tool_calls" when the model stopped after calling (not when cut by max_tokens)."""
        return "tool_calls" if reason == "stop" and parser is not None and parser.calls else reason

    def piece_chunk(self, piece: str | ToolCall, parser: ToolCallParser | None, logprobs: dict | None) -> dict:
        """A streamed content piece, or a whole tool call (`delta.tool_calls`, index = its place
        among the reply's calls: id, type, name and arguments in one chunk)."""
        if isinstance(piece, str):
            return self.chunk(piece, None, logprobs=logprobs)
        entry = piece.to_dict(index=parser.calls.index(piece))
        return OP.chat_completion_chunk(self.id, self.model, self.created, {"tool_calls": [entry]}, None,
                                       self.include_usage, logprobs)

    def logprobs(self, tokens: list | None, text_offset: int) -> dict | None:
        """Delta.logprobs entries -> the choice's `logprobs` (None when not asked for or none)."""
        if self.token_text is None or not tokens:
            return None
        text = self.token_text
        shaped = [(text(t), lp, [(text(alt), alp) for alt, alp in top]) for t, lp, top in tokens]
        return OP.chat_logprobs(shaped) if self.is_chat else OP.completion_logprobs(shaped, text_offset)

    def chunk(self, text: str, finish_reason: str | None, role: bool = False, logprobs: dict | None = None) -> dict:
        if not self.is_chat:
            return OP.completion_response(self.id, self.model, self.created, text, finish_reason,
                                         with_usage=self.include_usage, logprobs=logprobs)
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        return OP.chat_completion_chunk(self.id, self.model, self.created, delta, finish_reason, self.include_usage,
                                       logprobs)

    def usage_chunk(self, usage: dict) -> dict:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        return OP.usage_chunk(kind, self.id, self.model, self.created, usage)

    def whole(self, text: str, finish_reason: str, usage: dict, logprobs: dict | None = None,
              tool_calls: list[ToolCall] | None = None) -> dict:
        if self.is_chat:
            calls = [c.to_dict() for c in tool_calls or []]
            return OP.chat_completion_response(self.id, self.model, self.created, text, finish_reason, usage, logprobs,
                                              calls)
        return OP.completion_response(self.id, self.model, self.created, text, finish_reason, usage,
                                     logprobs=logprobs)


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
        return OP.usage_dict(num_prompt_tokens, num_tokens, None)
    return OP.usage_dict(stats.prompt_tokens or num_prompt_tokens, stats.num_generated, stats.cached_tokens)


def _sse(obj: dict) -> str:
    return f"data: {P.dumps(obj)}\n\n"


def error_response(error: P.ProtocolError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return JSONResponse(OP.openai_error(error.code, error.message, error.status, error.param), status_code=error.status,
                        headers=headers)
