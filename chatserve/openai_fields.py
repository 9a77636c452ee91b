"""Which fields of an OpenAI request body chatserve reads, accepts as metadata, or refuses.

Nothing is silently ignored: a field that would change the reply's content or shape and is not
implemented is refused with a 400 naming it, unless it is set to the value that asks for nothing
(`best_of: 1`, `echo: false`, `suffix: ""`). Parsing the fields that are read is openai_protocol.py's.
"""

from __future__ import annotations

import json

UNSUPPORTED_PARAMETER = "unsupported_parameter"  # OpenAI's own code for a field a model does not take

# Read by openai_protocol._parse_openai_common (sampling extensions as in vLLM: top_k, min_p, ...).
COMMON_FIELDS = frozenset({
    "model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop",
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
    "top_logprobs", "response_format", "ignore_eos", "speculation", "spec_method", "num_draft_tokens",
})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                               "functions", "function_call"}  # the last two: read as tools and tool_choice
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "max_completion_tokens"}

# Accepted and not acted on: none of them changes what the model writes or the response's shape.
# `store` and `metadata` label a stored completion in OpenAI's dashboard (nothing is stored here);
# `service_tier` picks a billing queue; `prompt_cache_key` is a routing hint (prefix caching here
# needs none); `user` and `safety_identifier` identify an end user for abuse monitoring.
METADATA_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})

# field -> (the values that ask for nothing, why the field is refused otherwise)
UNSUPPORTED_FIELDS: dict[str, tuple[tuple, str]] = {
    "best_of": ((1,), "only best_of = 1 is implemented"),
    "echo": ((False,), "echo is not implemented"),
    "suffix": (("",), "suffix (insertion) is not implemented"),
    "audio": ((), "audio output is not implemented"),
    "modalities": ((["text"],), "only text output is implemented"),
    "prediction": ((), "predicted outputs are not implemented"),
    "web_search_options": ((), "web search is not implemented"),
    # OpenAI itself refuses these for models that do not reason; none of chatserve's models does.
    "reasoning_effort": ((), "the served model has no reasoning effort setting"),
    "verbosity": ((), "the served model has no verbosity setting"),
}


class FieldError(ValueError):
    """A refused field: `param` names it, str(self) says why."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_fields(body: dict, is_chat: bool) -> None:
    """Raise FieldError for the first refused field of `body` (sorted, so the error is stable):
    an unsupported field set to something, or a key OpenAI's endpoint does not define."""
    known = CHAT_FIELDS if is_chat else COMPLETION_FIELDS
    endpoint = "/v1/chat/completions" if is_chat else "/v1/completions"
    for name in sorted(body):
        if name in known or name in METADATA_FIELDS:
            continue
        if name in UNSUPPORTED_FIELDS:
            asks_for_nothing, why = UNSUPPORTED_FIELDS[name]
            value = body[name]
            if value is None or any(_same(value, v) for v in asks_for_nothing):
                continue
            raise FieldError(name, f"{name}: {why}; got {_short(value)}. Leave it out, or set it to "
                                   f"{_short(asks_for_nothing[0]) if asks_for_nothing else 'null'}")
        else:
            raise FieldError(name, f"{name}: not a field of {endpoint} (unknown fields are refused, not ignored)")


def _same(value, neutral) -> bool:
    """== that keeps booleans apart from numbers: `n: true` and `logprobs: 0` are not neutral."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
