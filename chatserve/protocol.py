"""The websocket wire format, and what the OpenAI routes share with it: error codes, ProtocolError,
chat messages, settings -> SamplingParams, bounded JSON parsing (openai_protocol.py has the /v1 shapes).

Parsing and shaping only: no I/O, no engine. Malformed input raises ProtocolError(code, message).
docs/protocol.md describes the same messages for clients.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from chatserve.grammar import json_schema_grammar
from chatserve.sampling_params import RequestStats, SamplingParams
from chatserve.spec_methods import SPEC_METHODS

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

ROLES = ("system", "user", "assistant", "tool", "function")  # function: the deprecated form of tool
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
        if role == "assistant" and calls is None and message.get("function_call") is not None:
            calls = [{"type": "function", "function": message["function_call"]}]  # the deprecated form
        content = message.get("content")
        out = {"role": role, "content": "" if content is None and calls else _message_text(content, where)}
        if calls:
            out["tool_calls"] = _parse_message_tool_calls(calls, where)
        if role == "function":  # the deprecated form of a tool message: names the function, not the call
            if not isinstance(message.get("name"), str):
                raise ProtocolError(BAD_MESSAGE, f"{where}.name: a function message needs the name of the function "
                                    "it answers", param=where)
            out = {"role": "tool", "content": out["content"], "tool_call_id": message["name"]}
        elif role == "tool":
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
