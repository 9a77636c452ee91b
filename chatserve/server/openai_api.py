"""OpenAI-compatible routes: /v1/chat/completions and /v1/completions (SSE or whole), /v1/models,
and vLLM's /tokenize, /detokenize and /version.

n > 1 choices run as n engine requests whose deltas are merged as they come; openai_reply.py
shapes them. A request is checked (access, then admission: a full queue is a 429 before the body is read;
then body, limits) and waits for its first delta before any header is sent, so refusals are
proper OpenAI error responses; after that, errors are reported in-band.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from chatserve import openai_protocol as OP
from chatserve import protocol as P
from chatserve.sampling_params import Delta
from chatserve.server import openai_reply as R
from chatserve.server.state import AppState


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
        try:
            self.state.access.check_http(request.headers)
            hold = _Hold(self.state.admission)
        except P.ProtocolError as e:
            return error_response(e)
        try:
            return await self._admitted(request, is_chat, hold)
        except BaseException:
            hold.release()
            raise

    async def _admitted(self, request: Request, is_chat: bool, hold: "_Hold") -> Response:
        """_complete once admitted; `hold` is released here or when a stream ends."""
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
            hold.add_choices(req.n - 1)
            if is_chat:
                prompt_ids = await s.tokenize_chat(req.messages, tools=req.tools)
            else:
                prompt_ids = req.prompt_token_ids or await s.tokenize(req.prompt)
            s.access.check_prompt(prompt_ids)
        except P.ProtocolError as e:
            hold.release()
            return error_response(e)
        request_id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex
        params = OP.fit_to_context(req.params, len(prompt_ids), s.engine.max_model_len)
        deltas = _merged([self._choice_deltas(prompt_ids, params, request_id, i, timer) for i in range(req.n)])

        async def close() -> None:
            try:
                await deltas.aclose()
            finally:
                hold.release()

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
        shape = R.Shape(is_chat, request_id, s.model_name, int(time.time()), req.include_usage, token_text,
                       tool_names=None if req.tools is None else tuple(t["function"]["name"] for t in req.tools),
                       max_tool_calls=None if req.is_parallel_tool_calls else 1,
                       is_legacy_functions=req.is_legacy_functions)
        choices = [R.Choice(i, shape.tool_call_parser()) for i in range(req.n)]
        if req.stream:
            return _SSEResponse(self._events(shape, first, deltas, choices, len(prompt_ids)), close)
        try:
            whole = await _until_disconnect(request, self._whole(shape, first, deltas, choices, len(prompt_ids)))
            return whole or Response(status_code=499)
        except P.ProtocolError as e:
            return error_response(e)
        finally:
            await close()

    def _choice_deltas(self, prompt_ids: list[int], params, request_id: str, index: int,
                       timer) -> AsyncIterator[Delta]:
        """Choice `index` as an engine request of its own: choice 0 under the request's id and timer,
        the others named after it, waiting for it to compute the prompt and then sharing its blocks."""
        s = self.state
        if index == 0:
            return s.generate(prompt_ids, params, request_id, timer)
        return s.generate(prompt_ids, OP.choice_params(params, index), f"{request_id}-{index}",
                          s.metrics.start_request(), prompt_source_id=request_id)

    async def _events(self, shape: R.Shape, first: tuple[int, Delta], deltas, choices: list[R.Choice],
                      num_prompt_tokens: int) -> AsyncIterator[str]:
        if shape.is_chat:
            for choice in choices:
                yield _sse(shape.chunk(choice.index, "", None, role=True))
        item, num_open = first, len(choices)
        while True:
            index, delta = item
            choice = choices[index]
            choice.add(delta)
            if delta.finish_reason == "error":
                yield _sse(OP.openai_error(P.ENGINE_ERROR, f"generation failed: {delta.error}", 500))
                break
            logprobs = shape.logprobs(delta.logprobs, choice.text_offset)
            pieces = R.reply_pieces(choice.parser, delta.text, is_last=delta.finished)
            for piece in pieces or ([""] if logprobs else []):  # logprobs ride on the delta's first chunk
                yield _sse(shape.piece_chunk(choice, piece, logprobs))
                logprobs = None
            choice.text_offset += len(delta.text)
            if delta.finished:
                yield _sse(shape.chunk(index, "", shape.finish_reason(delta.finish_reason, choice.parser)))
                num_open -= 1
                if num_open == 0:
                    if shape.include_usage:
                        yield _sse(shape.usage_chunk(R.total_usage(choices, num_prompt_tokens)))
                    break
            try:
                item = await anext(deltas, None)
            except P.ProtocolError as e:  # headers are sent: report in-band, as OpenAI does
                yield _sse(OP.openai_error(e.code, e.message, e.status))
                break
            if item is None:
                break
        yield "data: [DONE]\n\n"

    async def _whole(self, shape: R.Shape, first: tuple[int, Delta], deltas, choices: list[R.Choice],
                     num_prompt_tokens: int) -> Response:
        item = first
        while item is not None:
            index, delta = item
            choices[index].add(delta)
            if delta.finish_reason == "error":
                return error_response(P.ProtocolError(P.ENGINE_ERROR, f"generation failed: {delta.error}", 500))
            item = await anext(deltas, None)
        return JSONResponse(shape.whole(choices, R.total_usage(choices, num_prompt_tokens)))


class _Hold:
    """What one HTTP request holds of the admission: a connection and a generation per choice,
    released exactly once however the request ends."""

    def __init__(self, admission):
        self.admission = admission
        admission.acquire_http()  # a full queue is a 429 before the body is read
        self.num_more_choices = 0
        self.is_released = False

    def add_choices(self, num: int) -> None:
        """`num` more generations (choices 1..n-1); 400 naming `n` when n could never be admitted."""
        if 1 + num > self.admission.max_generations:
            raise P.ProtocolError(P.INVALID_PARAMS, f"n: {1 + num} choices are more generations than this server "
                                  f"takes at once ({self.admission.max_generations})", param="n")
        self.admission.acquire_generation(num)
        self.num_more_choices = num

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self.admission.release_http()
            self.admission.release_generation(self.num_more_choices)


async def _merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every stream as they come, until all have ended. An exception in
    one is raised here; closing this early closes them all, so each aborts its engine request.
    Stream i's first step (its engine add) runs before stream i + 1's: tasks start in order."""
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for delta in stream:
                arrivals.put_nowait((index, delta, None))
        except Exception as e:
            arrivals.put_nowait((index, None, e))
        else:
            arrivals.put_nowait((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_open = len(streams)
        while num_open:
            index, delta, error = await arrivals.get()
            if error is not None:
                raise error
            if delta is None:
                num_open -= 1
            else:
                yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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


# Characters Python's str.splitlines() (and so httpx's aiter_lines) breaks a line at, besides the
# \r and \n that JSON escapes anyway. SSE itself splits only at CR and LF, but a client that reads
# lines with such a splitter cut a `data:` line at a generated U+2028 and failed on the JSON (seen
# in the soak test). Escaped, an event is one line for every client and the same JSON.
_LINE_BREAKS = {ord(c): f"\\u{ord(c):04x}" for c in "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


def _sse(obj: dict) -> str:
    return f"data: {P.dumps(obj).translate(_LINE_BREAKS)}\n\n"


def error_response(error: P.ProtocolError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return JSONResponse(OP.openai_error(error.code, error.message, error.status, error.param), status_code=error.status,
                        headers=headers)
