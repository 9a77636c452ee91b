"""The wire format in one place: websocket messages, OpenAI request/response shapes, errors.

Parsing and shaping only: no I/O, no engine. Malformed input raises ProtocolError(code, message).
docs/protocol.md describes the same messages for clients.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

import numpy as np

from chatserve.openai_fields import UNSUPPORTED_PARAMETER, FieldError, check_fields
from chatserve.grammar import json_schema_grammar
from chatserve.sampling_params import RequestStats, SamplingParams
from chatserve.spec_methods import SPEC_METHODS
from chatserve.tool_calls import parse_tool_choice, parse_tools, tool_call_grammar

# Error codes sent in websocket `error` messages and as OpenAI `error.code`.
BAD_JSON = "bad_json"
BAD_MESSAGE = "bad_message"  # valid JSON, wrong shape or types
UNKNOWN_TYPE = "unknown_type"
BINARY_FRAME = "binary_frame"
TOO_LARGE = "too_large"
EMPTY_MESSAGES = "empty_messages"
INVALID_PARAMS = "invalid_params"
PROMPT_TOO_LONG = "prompt_too_long"  # over the server's max_prompt_tokens
INVALID_PROMPT = "invalid_prompt"  # the engine refused the prompt (context, KV pool, token ids)
BUSY = "busy"
UNKNOWN_ID = "unknown_id"
UNAUTHORIZED = "unauthorized"
FORBIDDEN_ORIGIN = "forbidden_origin"
TOO_MANY_CONNECTIONS = "too_many_connections"
MODEL_NOT_FOUND = "model_not_found"
ENGINE_ERROR = "engine_error"
QUEUE_FULL = "queue_full"  # max_num_seqs + max_queued_requests generations already in flight
SHUTTING_DOWN = "shutting_down"  # the server is draining after SIGTERM
TOO_DEEP = "too_deep"  # JSON nested deeper than MAX_JSON_DEPTH

# Websocket close codes (RFC 6455 section 7.4; 4000-4999 belong to the application).
CLOSE_GOING_AWAY = 1001  # the server is shutting down
CLOSE_POLICY_VIOLATION = 1008  # refused for good: origin, API key
CLOSE_TRY_AGAIN_LATER = 1013  # too many connections
CLOSE_SLOW_READER = 4008  # the client left too much output unread; reconnecting is fine

MAX_JSON_DEPTH = 32  # our messages nest 4 deep ({"messages": [{"content": [{"type": ...}]}]})

ROLES = ("system", "user", "assistant", "tool")
SETTINGS_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logit_bias", "max_tokens", "stop", "seed", "speculation", "spec_method",
                 "num_draft_tokens", "ignore_eos", "response_format")
MAX_ID_CHARS = 128


class ProtocolError(Exception):
    """A client mistake: `code` is one of the constants above, `status` the HTTP status to use."""

    def __init__(self, code: str, message: str, status: int = 400, param: str | None = None,
                 id: str | int | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.code, self.message, self.status, self.param = code, message, status, param
        self.id = id  # the websocket turn it belongs to, if any
        self.retry_after = retry_after  # seconds, for a Retry-After header (429, 503)


# ---------------------------------------------------------------- websocket: client -> server

@dataclass(frozen=True)
class ChatTurn:
    """`messages` replaces the connection's conversation; `content` appends one user message."""

    id: str | int | None
    messages: list[dict] | None
    content: str | None
    params: dict = field(default_factory=dict)  # overrides the connection settings for this turn
    is_continue: bool = False  # `continue`: extend the last (assistant) message instead of answering it


@dataclass(frozen=True)
class Settings:
    params: dict


@dataclass(frozen=True)
class Cancel:
    id: str | int | None  # None cancels whatever is running


@dataclass(frozen=True)
class Reset:
    pass


@dataclass(frozen=True)
class Auth:
    api_key: str


ClientMessage = ChatTurn | Settings | Cancel | Reset | Auth


def parse_client_message(text: str) -> ClientMessage:
    """One websocket text frame -> a client message. Raises ProtocolError."""
    obj = loads(text, "message")
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_MESSAGE, "message must be a JSON object with a 'type' field")
    kind = obj.get("type")
    if kind == "chat":
        return _parse_chat_turn(obj)
    if kind == "settings":
        _check_keys(obj, ("type", "params"))
        return Settings(parse_settings(obj.get("params")))
    if kind == "cancel":
        _check_keys(obj, ("type", "id"))
        return Cancel(_parse_id(obj.get("id")))
    if kind == "reset":
        _check_keys(obj, ("type",))
        return Reset()
    if kind == "auth":
        _check_keys(obj, ("type", "api_key"))
        if not isinstance(obj.get("api_key"), str):
            raise ProtocolError(BAD_MESSAGE, "auth: 'api_key' must be a string")
        return Auth(obj["api_key"])
    if not isinstance(kind, str):
        raise ProtocolError(BAD_MESSAGE, "message needs a string 'type': chat, settings, cancel, reset or auth")
    raise ProtocolError(UNKNOWN_TYPE, f"unknown message type {kind!r}; expected chat, settings, cancel, reset or auth")


def _parse_chat_turn(obj: dict) -> ChatTurn:
    _check_keys(obj, ("type", "id", "messages", "content", "params", "continue"))
    has_messages, has_content = "messages" in obj, "content" in obj
    if has_messages == has_content:
        raise ProtocolError(BAD_MESSAGE, "chat: give exactly one of 'messages' (full history) or 'content' "
                            "(the next user message)")
    params = parse_settings(obj["params"]) if "params" in obj else {}
    if has_content:
        if "continue" in obj:
            raise ProtocolError(BAD_MESSAGE, "chat: 'continue' needs 'messages' ending with the assistant's")
        content = obj["content"]
        if not isinstance(content, str):
            raise ProtocolError(BAD_MESSAGE, "chat: 'content' must be a string")
        if not content.strip():
            raise ProtocolError(EMPTY_MESSAGES, "chat: 'content' is empty")
        return ChatTurn(_parse_id(obj.get("id")), None, content, params)
    messages = parse_chat_messages(obj["messages"])
    is_continue = obj.get("continue", False)
    if not isinstance(is_continue, bool):
        raise ProtocolError(BAD_MESSAGE, "chat: 'continue' must be true or false")
    if is_continue and messages[-1]["role"] != "assistant":
        raise ProtocolError(BAD_MESSAGE, "chat: 'continue' extends the last message, which must be the assistant's")
    return ChatTurn(_parse_id(obj.get("id")), messages, None, params, is_continue)


def parse_chat_messages(messages) -> list[dict]:
    """A list of {"role", "content"} -> normalized copies. Content may be a string or OpenAI text parts.
    A `tool` message carries `tool_call_id`; an assistant message may carry `tool_calls` (and
    null content), whose `arguments` JSON strings become objects, as chat templates render them."""
    if not isinstance(messages, list):
        raise ProtocolError(BAD_MESSAGE, "'messages' must be a list of {role, content} objects", param="messages")
    if not messages:
        raise ProtocolError(EMPTY_MESSAGES, "'messages' is empty", param="messages")
    normalized = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ProtocolError(BAD_MESSAGE, f"{where} must be an object with 'role' and 'content'", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise ProtocolError(BAD_MESSAGE, f"{where}.role must be one of {list(ROLES)}, got {role!r}", param=where)
        calls = message.get("tool_calls") if role == "assistant" else None
        content = message.get("content")
        out = {"role": role, "content": "" if content is None and calls else _message_text(content, where)}
        if calls:
            out["tool_calls"] = _parse_message_tool_calls(calls, where)
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise ProtocolError(BAD_MESSAGE, f"{where}.tool_call_id: a tool message needs the id of the call "
                                    "it answers", param=where)
            out["tool_call_id"] = message["tool_call_id"]
        normalized.append(out)
    return normalized


def _parse_message_tool_calls(calls, where: str) -> list[dict]:
    def refuse(why: str) -> ProtocolError:
        return ProtocolError(BAD_MESSAGE, f"{where}.tool_calls: {why}", param=where)

    if not isinstance(calls, list):
        raise refuse("must be a list of {id, type: function, function: {name, arguments}}")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise refuse("each must be {id, type: function, function: {name, arguments}}")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise refuse(f"the arguments of {function['name']!r} are not JSON") from None
        if not isinstance(arguments, dict):
            raise refuse(f"the arguments of {function['name']!r} must be a JSON object")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _message_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ProtocolError(BAD_MESSAGE, f"{where}.content must be a string or a list of text parts", param=where)


def _parse_id(value) -> str | int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or len(str(value)) > MAX_ID_CHARS:
        raise ProtocolError(BAD_MESSAGE, f"'id' must be a string or integer of at most {MAX_ID_CHARS} characters")
    return value


def _check_keys(obj: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise ProtocolError(BAD_MESSAGE, f"{obj.get('type')}: unknown field(s) {unknown}; allowed: {list(allowed)}")


# ---------------------------------------------------------------- settings -> SamplingParams

def parse_settings(params) -> dict:
    """Check the keys of a settings object; values are checked by build_sampling_params."""
    if not isinstance(params, dict):
        raise ProtocolError(BAD_MESSAGE, "'params' must be an object")
    unknown = sorted(set(params) - set(SETTINGS_KEYS))
    if unknown:
        raise ProtocolError(INVALID_PARAMS, f"unknown setting(s) {unknown}; known: {list(SETTINGS_KEYS)}")
    if "speculation" in params and not isinstance(params["speculation"], bool):
        raise ProtocolError(INVALID_PARAMS, "speculation: must be true or false", param="speculation")
    if params.get("spec_method") is not None and (not isinstance(params["spec_method"], str)
                                                  or params["spec_method"] not in SPEC_METHODS):
        names = ", ".join(f'"{name}"' for name in SPEC_METHODS)
        raise ProtocolError(INVALID_PARAMS, f"spec_method: must be one of {names} or null (the server's "
                            f"default), got {params['spec_method']!r}", param="spec_method")
    return dict(params)


def check_spec_method(params: SamplingParams, available: tuple[str, ...]) -> None:
    """The engine must run the asked-for method: "draft" needs a draft model, and a server
    started without speculation runs none. `available` is the engine's spec_methods."""
    method = params.spec_method
    if method is None or method in available:
        return
    have = f"this server offers only {', '.join(available)}" if available else "this server runs without speculation"
    raise ProtocolError(INVALID_PARAMS, f"spec_method: {method!r} is not available; {have}", param="spec_method")


def build_sampling_params(settings: dict, max_tokens_limit: int) -> SamplingParams:
    """Settings (websocket or OpenAI extras) -> SamplingParams. speculation=false -> num_draft_tokens=0;
    response_format -> json_schema."""
    values = {k: v for k, v in settings.items() if k not in ("speculation", "response_format") and v is not None}
    if settings.get("speculation") is False:
        values["num_draft_tokens"] = 0
    if settings.get("response_format") is not None:
        values["json_schema"] = parse_response_format(settings["response_format"])
    if isinstance(values.get("stop"), list):
        values["stop"] = tuple(values["stop"])
    if "logit_bias" in values:
        values["logit_bias"] = _parse_logit_bias(values["logit_bias"])
    max_tokens = values.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > max_tokens_limit:
        raise ProtocolError(INVALID_PARAMS, f"max_tokens: must be <= {max_tokens_limit}, got {max_tokens}",
                            param="max_tokens")
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as e:
        param = str(e).split(":", 1)[0] if ":" in str(e) else None
        raise ProtocolError(INVALID_PARAMS, str(e), param=param) from None


def _parse_logit_bias(bias) -> dict[int, float]:
    """OpenAI's {"token id as a string": bias}; the values are checked by SamplingParams."""
    if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() for k in bias):
        raise ProtocolError(INVALID_PARAMS, "logit_bias: must map token ids (as strings) to numbers",
                            param="logit_bias")
    return {int(k): v for k, v in bias.items()}


def parse_response_format(response_format) -> str | None:
    """OpenAI's response_format -> SamplingParams.json_schema (None: free text).
    {"type": "text"}, {"type": "json_object"} (any JSON object), or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": bool}}; the schema is enforced
    whatever `strict` says. A schema llguidance cannot compile is refused here, before queueing."""
    def refuse(why: str) -> ProtocolError:
        return ProtocolError(INVALID_PARAMS, f"response_format: {why}", param="response_format")

    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise refuse("json_schema must be an object {name, schema, strict} whose schema is a JSON object")
        schema = spec.get("schema", {})
    else:
        raise refuse(f"must be an object whose type is text, json_object or json_schema, got {kind!r}")
    try:
        json_schema_grammar(schema)
    except ValueError as e:
        raise refuse(str(e)) from None
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


# ---------------------------------------------------------------- websocket: server -> client

@dataclass(frozen=True)
class DoneStats:
    """Per-turn numbers in a `done` message; None where unknown (for example after a cancel)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    queue_ms: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    generated_tokens: int = 0
    drafted: int | None = None
    accepted: int | None = None
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    spec_method: str | None = None  # the request's method (a SPEC_METHODS name); None = no speculation

    @classmethod
    def from_request_stats(cls, stats: RequestStats) -> "DoneStats":
        return cls(ttft_ms=stats.ttft_ms, tpot_ms=stats.tpot_ms, queue_ms=stats.queue_ms,
                   prompt_tokens=stats.prompt_tokens, cached_tokens=stats.cached_tokens,
                   generated_tokens=stats.num_generated, drafted=stats.num_drafted,
                   accepted=stats.num_accepted, acceptance_rate=stats.acceptance_rate,
                   mean_accepted_length=stats.mean_accepted_length, spec_method=stats.spec_method)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def ready_message(model: str, draft: str | None, max_model_len: int, max_tokens_limit: int, settings: dict,
                  spec_methods: tuple[str, ...] = ()) -> dict:
    """`spec_methods`: the spec_method values this server runs, its default first ([] = no speculation);
    `spec_method_labels` names them for people."""
    labels = {name: SPEC_METHODS[name].label for name in spec_methods if name in SPEC_METHODS}
    return {"type": "ready", "model": model, "draft": draft, "spec_methods": list(spec_methods),
            "spec_method_labels": labels,
            "max_model_len": max_model_len, "max_tokens_limit": max_tokens_limit, "settings": settings}


def delta_message(id: str | int, text: str, num_tokens: int, tokens: list[tuple[str, str]] | None = None) -> dict:
    """tokens: per token, (the text it released, how it came: sampling_params.TOKEN_ORIGINS); the
    texts join to `text`. None when the engine does not say (the message then has no `tokens`)."""
    out = {"type": "delta", "id": id, "text": text, "num_tokens": num_tokens}
    if tokens is not None:
        out["tokens"] = [list(token) for token in tokens]
    return out


def done_message(id: str | int, finish_reason: str, stats: DoneStats) -> dict:
    return {"type": "done", "id": id, "finish_reason": finish_reason, "stats": stats.to_dict()}


def error_message(code: str, message: str, id: str | int | None = None) -> dict:
    out = {"type": "error", "code": code, "message": message}
    if id is not None:
        out["id"] = id
    return out


def settings_message(settings: dict) -> dict:
    return {"type": "settings", "params": settings}


def reset_message() -> dict:
    return {"type": "reset"}


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a string literal may hold brackets
_DEPTH_STEPS = np.zeros(256, np.int8)  # byte -> +1 for "[" "{", -1 for "]" "}", else 0
_DEPTH_STEPS[[ord("["), ord("{")]], _DEPTH_STEPS[[ord("]"), ord("}")]] = 1, -1


def loads(data: str | bytes, what: str) -> object:
    """json.loads behind a nesting limit that is checked first, so "[[[[..." is refused without
    being parsed (json's own limit is the interpreter's recursion depth, about 1000)."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise ProtocolError(BAD_JSON, f"{what} is not valid UTF-8: {e}") from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and json_depth(text) > MAX_JSON_DEPTH:
        raise ProtocolError(TOO_DEEP, f"{what} nests JSON deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(BAD_JSON, f"{what} is not valid JSON: {e}") from None


def json_depth(text: str) -> int:
    """The deepest array/object nesting in `text`: the running count of open brackets outside
    string literals, at its maximum. O(n) in numpy (a 1 MiB body takes milliseconds), so it can
    run before json.loads; text that is not JSON gets a number too, and json.loads the blame."""
    codes = np.frombuffer(_JSON_STRING.sub('""', text).encode(), np.uint8)  # [num_bytes]
    return int(np.cumsum(_DEPTH_STEPS[codes], dtype=np.int32).max(initial=0))


def dumps(message: dict) -> str:
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False)


# ---------------------------------------------------------------- OpenAI-compatible HTTP

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable_error"}
# OpenAI's keys and extensions (vLLM's, ours): top_k, min_p, repetition_penalty, speculation, spec_method,
# num_draft_tokens, ignore_eos
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "logit_bias", "seed", "stop", "speculation", "spec_method", "num_draft_tokens",
                  "ignore_eos", "response_format")


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed /v1/chat/completions (`messages`) or /v1/completions (`prompt*`) body."""

    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    # Offered to the model through the chat template, and its reply parsed for calls; None: no
    # tools (none given, or tool_choice "none")
    tools: list[dict] | None = None
    is_parallel_tool_calls: bool = True  # false: at most one call


def parse_chat_completion_request(body, max_tokens_limit: int, max_model_len: int,
                                  defaults: dict | None = None, are_tool_tags_tokens: bool = False) -> OpenAIRequest:
    """max_tokens defaults to max_tokens_limit: a chat reply runs until it stops (or the context ends).
    `defaults`: sampling settings for the keys the body leaves out or sets to null (the model's).
    are_tool_tags_tokens: the tokenizer has <tool_call> as a token (tool_calls.tool_call_grammar)."""
    common = _parse_openai_common(body, max_tokens_limit, max_model_len, defaults or {}, is_chat=True)
    if "messages" not in body:
        raise ProtocolError(BAD_MESSAGE, "'messages' is required", param="messages")
    messages = parse_chat_messages(body["messages"])
    return _with_tools(OpenAIRequest(**common, messages=messages), body, are_tool_tags_tokens)


def _with_tools(req: OpenAIRequest, body: dict, are_tool_tags_tokens: bool) -> OpenAIRequest:
    """`tools`, `tool_choice` and `parallel_tool_calls` applied: "none" offers no tools (the model
    is not told of them, so it does not try to call); "required" and a named function constrain
    the reply by a grammar, so the call always parses; "auto" is parsed after."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ProtocolError(INVALID_PARAMS, "parallel_tool_calls: must be true or false", param="parallel_tool_calls")
    try:
        tools = parse_tools(body.get("tools") or [])
    except ValueError as e:
        raise ProtocolError(INVALID_PARAMS, str(e), param="tools") from None
    try:
        choice = parse_tool_choice(body.get("tool_choice"), tools)
    except ValueError as e:
        raise ProtocolError(INVALID_PARAMS, str(e), param="tool_choice") from None
    if choice == "none":
        return req
    is_parallel = parallel is not False
    params = req.params
    if choice != "auto":
        if params.json_schema is not None:
            raise ProtocolError(INVALID_PARAMS, f"tool_choice: {choice!r} forces a tool call, which response_format "
                                "would contradict; give one of them", param="tool_choice")
        name = None if choice == "required" else choice
        params = replace(params, grammar=tool_call_grammar(tools, name, is_parallel, are_tool_tags_tokens))
    return replace(req, params=params, tools=tools, is_parallel_tool_calls=is_parallel)


def parse_completion_request(body, max_tokens_limit: int, max_model_len: int,
                             defaults: dict | None = None) -> OpenAIRequest:
    """`prompt` is a string, a list of token ids, or a one-element list of either. max_tokens defaults to 16."""
    common = _parse_openai_common(body, min(16, max_tokens_limit), max_model_len, defaults or {}, is_chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ProtocolError(EMPTY_MESSAGES, "'prompt' is empty", param="prompt")
        return OpenAIRequest(**common, prompt=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return OpenAIRequest(**common, prompt_token_ids=list(prompt))
    if isinstance(prompt, list) and not prompt:
        raise ProtocolError(EMPTY_MESSAGES, "'prompt' is empty", param="prompt")
    raise ProtocolError(BAD_MESSAGE, "'prompt' must be a string or a list of token ids (batches are not supported)",
                        param="prompt")


def _parse_logprobs(body: dict, is_chat: bool) -> int | None:
    """Chat: `logprobs` true/false and `top_logprobs` 0-20. Completions: `logprobs` 0-5 (the
    number of top logprobs). -> SamplingParams.logprobs (None: none)."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if not is_chat:
        if logprobs is False:  # not OpenAI's (an integer or null) but asks for nothing
            logprobs = None
        if top:
            raise ProtocolError(INVALID_PARAMS, "top_logprobs: only for chat completions; here 'logprobs' is "
                                "the number of top logprobs", param="top_logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= 5):
            raise ProtocolError(INVALID_PARAMS, "logprobs: must be an integer in [0, 5]", param="logprobs")
        return logprobs
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ProtocolError(INVALID_PARAMS, "logprobs: must be true or false", param="logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise ProtocolError(INVALID_PARAMS, "top_logprobs: must be an integer in [0, 20]", param="top_logprobs")
        if top and not logprobs:
            raise ProtocolError(INVALID_PARAMS, "top_logprobs: needs logprobs=true", param="top_logprobs")
    return (top or 0) if logprobs else None


def _parse_openai_common(body, default_max_tokens: int, max_model_len: int, defaults: dict, is_chat: bool) -> dict:
    """max_tokens may be anything up to the context (fit_to_context cuts it to what the prompt leaves)."""
    if not isinstance(body, dict):
        raise ProtocolError(BAD_MESSAGE, "request body must be a JSON object")
    try:
        check_fields(body, is_chat)
    except FieldError as e:
        raise ProtocolError(UNSUPPORTED_PARAMETER, str(e), param=e.param) from None
    model, stream, options = body.get("model"), body.get("stream", False), body.get("stream_options")
    if model is not None and not isinstance(model, str):
        raise ProtocolError(BAD_MESSAGE, "'model' must be a string", param="model")
    if not isinstance(stream, bool) and stream is not None:
        raise ProtocolError(BAD_MESSAGE, "'stream' must be a boolean", param="stream")
    if options is not None and (not stream or not isinstance(options, dict)
                                or not isinstance(options.get("include_usage", False), bool)):
        raise ProtocolError(BAD_MESSAGE, "'stream_options' must be {\"include_usage\": bool} and needs stream=true",
                            param="stream_options")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > max_model_len:
        raise ProtocolError(INVALID_PARAMS, f"{name}: must be <= {max_model_len} (the model's context), "
                            f"got {max_tokens}", param=name)
    settings = {**defaults, **{k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}}
    settings["logprobs"] = _parse_logprobs(body, is_chat)
    settings["max_tokens"] = min(default_max_tokens, max_model_len) if max_tokens is None else max_tokens
    if isinstance(settings.get("stop"), list) and not all(isinstance(s, str) for s in settings["stop"]):
        raise ProtocolError(INVALID_PARAMS, "stop: must be a string or a list of strings", param="stop")
    return {"model": model, "params": build_sampling_params(settings, max_model_len), "stream": bool(stream),
            "include_usage": bool(options and options.get("include_usage"))}


def fit_to_context(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """max_tokens cut to what the context leaves after the prompt, so a large value is accepted
    rather than refused. Never below 1: a prompt that fills the context is the engine's to refuse."""
    room = max(1, max_model_len - num_prompt_tokens)
    return params if params.max_tokens <= room else replace(params, max_tokens=room)


def openai_error(code: str, message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens or 0}}


TokenLogprobs = tuple[str, float, list[tuple[str, float]]]  # (token, logprob, [(token, logprob)] best first)


def chat_logprobs(tokens: list[TokenLogprobs]) -> dict:
    """A choice's `logprobs` in a chat completion or chunk."""
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}
    return {"content": [entry(t, lp) | {"top_logprobs": [entry(*alt) for alt in top]} for t, lp, top in tokens]}


def completion_logprobs(tokens: list[TokenLogprobs], text_offset: int) -> dict:
    """A choice's `logprobs` in a (legacy) completion or chunk; text_offset: where the first token starts."""
    offsets = []
    for token, _, _ in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": [t for t, _, _ in tokens], "token_logprobs": [_finite(lp) for _, lp, _ in tokens],
            "top_logprobs": [_by_text(top) for _, _, top in tokens], "text_offset": offsets}


def _by_text(top: list[tuple[str, float]]) -> dict[str, float]:
    """{token text: logprob}; ids that read the same (pieces of one UTF-8 character) keep the best."""
    out: dict[str, float] = {}
    for text, logprob in top:
        out.setdefault(text, _finite(logprob))
    return out


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token outside top-k/top-p gets the most negative float, as vLLM does."""
    return max(logprob, -9999.0)


def chat_completion_response(id: str, model: str, created: int, text: str, finish_reason: str, usage: dict,
                             logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    """With tool_calls: the message carries them, and content is null when no text is left."""
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": id, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": usage}


def chat_completion_chunk(id: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
                          with_usage: bool = False, logprobs: dict | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    chunk = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    if with_usage:
        chunk["usage"] = None  # include_usage: every chunk carries "usage": null except the last
    return chunk


def completion_response(id: str, model: str, created: int, text: str, finish_reason: str | None,
                        usage: dict | None = None, with_usage: bool = False, logprobs: dict | None = None) -> dict:
    """A whole completion (usage set) or one streamed chunk (usage None)."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    out = {"id": id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if usage is not None or with_usage:
        out["usage"] = usage
    return out


def usage_chunk(object: str, id: str, model: str, created: int, usage: dict) -> dict:
    """The final streamed chunk when stream_options.include_usage is set: no choices, only usage."""
    return {"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage}


def model_object(model: str, max_model_len: int, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "chatserve", "max_model_len": max_model_len}


def models_response(model: str, max_model_len: int, created: int) -> dict:
    return {"object": "list", "data": [model_object(model, max_model_len, created)]}


@dataclass(frozen=True)
class TokenizeRequest:
    """A parsed /tokenize body (vLLM's shape): exactly one of `prompt` and `messages`."""

    prompt: str | None = None
    messages: list[dict] | None = None
    add_generation_prompt: bool = True


def parse_tokenize_request(body) -> TokenizeRequest:
    if not isinstance(body, dict):
        raise ProtocolError(BAD_MESSAGE, "request body must be a JSON object")
    if ("prompt" in body) == ("messages" in body):
        raise ProtocolError(BAD_MESSAGE, "give exactly one of 'prompt' and 'messages'", param="prompt")
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise ProtocolError(BAD_MESSAGE, "'add_generation_prompt' must be a boolean", param="add_generation_prompt")
    if "messages" in body:
        return TokenizeRequest(messages=parse_chat_messages(body["messages"]),
                               add_generation_prompt=add_generation_prompt)
    if not isinstance(body["prompt"], str):
        raise ProtocolError(BAD_MESSAGE, "'prompt' must be a string", param="prompt")
    return TokenizeRequest(prompt=body["prompt"])


def parse_detokenize_request(body, vocab_size: int) -> list[int]:
    """{"tokens": [ids]} -> the ids, each an int in [0, vocab_size)."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list):
        raise ProtocolError(BAD_MESSAGE, "'tokens' must be a list of token ids", param="tokens")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ProtocolError(BAD_MESSAGE, f"tokens[{i}]: {t!r} is not a token id in [0, {vocab_size})",
                                param="tokens")
    return tokens
