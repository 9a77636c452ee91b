"""The OpenAI-compatible wire format: /v1/chat/completions and /v1/completions bodies -> OpenAIRequest,
and the responses, chunks, errors and models list they answer with; vLLM's /tokenize and /detokenize.

Parsing and shaping only: no I/O, no engine. Malformed input raises protocol.ProtocolError; which
fields are read, accepted or refused is openai_fields.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from chatserve.openai_fields import UNSUPPORTED_PARAMETER, FieldError, check_fields
from chatserve.protocol import (BAD_MESSAGE, EMPTY_MESSAGES, INVALID_PARAMS, ProtocolError, build_sampling_params,
                                parse_chat_messages)
from chatserve.sampling_params import SamplingParams
from chatserve.tool_calls import parse_tool_choice, parse_tools, tool_call_grammar

MAX_CHOICES = 16  # n: each choice is a generation of its own, counted against the admission limits

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
    n: int = 1  # choices: n generations of one prompt, computed once (Engine.add_request's prompt_source_id)
    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    # Offered to the model through the chat template, and its reply parsed for calls; None: no
    # tools (none given, or tool_choice "none")
    tools: list[dict] | None = None
    is_parallel_tool_calls: bool = True  # false: at most one call
    # Asked for with the deprecated `functions` / `function_call`: the reply carries
    # `message.function_call` and finish_reason "function_call", as that API's did
    is_legacy_functions: bool = False


def parse_chat_completion_request(body, max_tokens_limit: int, max_model_len: int,
                                  defaults: dict | None = None, are_tool_tags_tokens: bool = False) -> OpenAIRequest:
    """max_tokens defaults to max_tokens_limit: a chat reply runs until it stops (or the context ends).
    `defaults`: sampling settings for the keys the body leaves out or sets to null (the model's).
    are_tool_tags_tokens: the tokenizer has <tool_call> as a token (tool_calls.tool_call_grammar)."""
    common = _parse_openai_common(body, max_tokens_limit, max_model_len, defaults or {}, is_chat=True)
    if "messages" not in body:
        raise ProtocolError(BAD_MESSAGE, "'messages' is required", param="messages")
    messages = parse_chat_messages(body["messages"])
    legacy = _functions_as_tools(body)
    req = OpenAIRequest(**common, messages=messages, is_legacy_functions=bool(legacy))
    return _with_tools(req, {**body, **legacy}, are_tool_tags_tokens)


def _functions_as_tools(body: dict) -> dict:
    """The deprecated `functions` and `function_call` as `tools`, `tool_choice` and at most one
    call (that API's limit): [f, ...] -> [{"type": "function", "function": f}, ...]; "none" and
    "auto" stay; {"name": n} -> {"type": "function", "function": {"name": n}}. {} when neither is
    given; either beside tools or tool_choice is a 400 naming it."""
    functions, call = body.get("functions"), body.get("function_call")
    if functions is None and call is None:
        return {}
    name = "functions" if functions is not None else "function_call"
    if body.get("tools") is not None or body.get("tool_choice") is not None:
        raise ProtocolError(INVALID_PARAMS, f"{name}: the deprecated form of tools and tool_choice; give one form, "
                            "not both", param=name)
    if not isinstance(functions if functions is not None else [], list):
        raise ProtocolError(INVALID_PARAMS, "functions: must be a list of {name, description, parameters}",
                            param="functions")
    tools = [{"type": "function", "function": f} for f in functions or []]
    choice = {"type": "function", "function": call} if isinstance(call, dict) else call
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": False}


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


def _parse_n(body: dict) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ProtocolError(INVALID_PARAMS, f"n: must be an integer in [1, {MAX_CHOICES}] (choices per request), "
                            f"got {n!r:.40}", param="n")
    return n


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s settings: with a seed, seed + index (vLLM's rule), so the choices differ and
    the request as a whole is reproducible; choice 0 samples as an n = 1 request would."""
    return params if params.seed is None else replace(params, seed=params.seed + index)


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
            "include_usage": bool(options and options.get("include_usage")), "n": _parse_n(body)}


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


def chat_choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None, is_legacy_functions: bool = False) -> dict:
    """One choice of a chat completion. With tool_calls: the message carries them (or the first as
    the deprecated `function_call`), and content is null when no text is left."""
    message = {"role": "assistant", "content": text}
    if tool_calls and is_legacy_functions:
        message = {"role": "assistant", "content": text or None, "function_call": tool_calls[0]["function"]}
    elif tool_calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion_response(id: str, model: str, created: int, choices: list[dict], usage: dict) -> dict:
    return {"id": id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage}


def chat_completion_chunk(id: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
                          with_usage: bool = False, logprobs: dict | None = None, index: int = 0) -> dict:
    """A streamed piece of choice `index` (choices interleave as they come)."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    chunk = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    if with_usage:
        chunk["usage"] = None  # include_usage: every chunk carries "usage": null except the last
    return chunk


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(id: str, model: str, created: int, choices: list[dict], usage: dict | None = None,
                        with_usage: bool = False) -> dict:
    """A whole completion (usage set) or one streamed chunk (usage None, one choice)."""
    out = {"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices}
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
