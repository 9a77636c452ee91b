"""Tool calls in the Hermes / Qwen2.5 format: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.

Three pure pieces, no engine and no I/O: the OpenAI `tools` / `tool_choice` checked, the llguidance
grammar that forces a call (`required`, a named function), and the parser of the model's reply
(whole or streamed), which turns each call into OpenAI's `tool_calls` entry.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from chatserve.grammar import json_schema_grammar

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function name
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without any
# A forced call is written as the chat templates write calls in the history (jinja's tojson is
# json.dumps: ", " and ": ", no other whitespace), which also keeps a model from padding it.
_CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# ---------------------------------------------------------------- the request: tools and tool_choice

def parse_tools(tools) -> list[dict]:
    """OpenAI's `tools` -> normalized copies [{"type": "function", "function": {name, description?,
    parameters}}], as the chat template takes them. Raises ValueError naming the bad entry; a
    parameters schema llguidance cannot compile is refused here, as response_format's is."""
    if not isinstance(tools, list):
        raise ValueError("tools: must be a list of {type: function, function: {name, description, parameters}}")
    normalized, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f"{where}: must be {{type: function, function: {{name, description, parameters}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name: must be 1-64 letters, digits, _ or -, got {name!r}")
        if name in names:
            raise ValueError(f"{where}.function.name: {name!r} is declared twice")
        names.add(name)
        out = {"name": name}
        if function.get("description") is not None:
            if not isinstance(function["description"], str):
                raise ValueError(f"{where}.function.description: must be a string")
            out["description"] = function["description"]
        parameters = function.get("parameters")
        parameters = _NO_PARAMETERS if parameters is None else parameters
        try:
            json_schema_grammar(parameters)
        except ValueError as e:
            raise ValueError(f"{where}.function.parameters: {e}") from None
        out["parameters"] = parameters
        normalized.append({"type": "function", "function": out})
    return normalized


def parse_tool_choice(tool_choice, tools: list[dict]) -> str | None:
    """OpenAI's `tool_choice` -> "auto", "none", "required", or the name of the function to call.
    None (absent) means "auto" when tools are given and "none" otherwise, as OpenAI does."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None:
        return "auto" if tools else "none"
    if tool_choice in ("auto", "none", "required"):
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice: {tool_choice!r} needs a non-empty 'tools' list")
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict):
        raise ValueError('tool_choice: must be "auto", "none", "required" or {"type": "function", '
                         f'"function": {{"name": ...}}}}, got {json.dumps(tool_choice)[:80]}')
    if function.get("name") not in names:
        raise ValueError(f"tool_choice: function {function.get('name')!r} is not among the tools {names}")
    return function["name"]


def tool_call_grammar(tools: list[dict], name: str | None, is_parallel: bool, are_tags_tokens: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one call, or one or more when is_parallel:

        <tool_call>\\n{"name": "<a tool>", "arguments": <that tool's parameters schema>}\\n</tool_call>

    `name`: only that tool (a named tool_choice); None: any of `tools` (`required`). Calls are
    joined by "\\n", as Qwen2.5 writes them; the grammar ends after the last one.
    are_tags_tokens: the tokenizer has the tags as (added) tokens, which llguidance matches only
    as `<tool_call>`, never as the quoted text; a tokenizer without them spells the text."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    rules = [f"call_{i}: %json {json.dumps(_call_schema(f))}" for i, f in enumerate(chosen)]
    alternatives = " | ".join(f"call_{i}" for i in range(len(chosen)))
    open_tag, close_tag = (OPEN_TAG, CLOSE_TAG) if are_tags_tokens else map(json.dumps, (OPEN_TAG, CLOSE_TAG))
    start = 'start: tool_call ("\\n" tool_call)*' if is_parallel else "start: tool_call"
    return "\n".join([start, f'tool_call: {open_tag} "\\n" ({alternatives}) "\\n" {close_tag}', *rules])


def _call_schema(function: dict) -> dict:
    """The JSON object of one call: "name" first (llguidance keeps the properties' order), then
    the arguments."""
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": function["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _CALL_JSON_OPTIONS}


# ---------------------------------------------------------------- the reply: text -> content and calls

@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_dict(self, index: int | None = None) -> dict:
        """OpenAI's `tool_calls` entry; with `index`, the streamed `delta.tool_calls` entry."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def parse_call(body: str) -> ToolCall | None:
    """The JSON between the tags -> a call; None when it is not {"name": str, "arguments": object}."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """Splits a reply, fed in pieces, into content text and calls, as soon as each is certain.

    feed(text) and finish() return a list of items, each a str (content) or a ToolCall. Held back:
    a tail that may begin `<tool_call>` (`<tool_c` at a delta's end), a call until its closing
    tag, and whitespace until non-blank content follows (so blank lines around calls are never
    content). A call whose JSON does not parse stays content, tags included. At the end an
    unclosed call counts if its JSON parses (the model stopped before `</tool_call>`).
    `max_calls`: later calls are dropped (parallel_tool_calls false: 1).

    Bare calls: Qwen2.5-Coder often answers with the call's JSON and no tags, alone or in a
    ```json fence. With `tool_names` given, a reply that starts with "{" or "```" is held to the
    end, and is one call if it is exactly such an object naming one of the tools; otherwise it is
    parsed as above.
    """

    def __init__(self, max_calls: int | None = None, tool_names: tuple[str, ...] = ()):
        self.max_calls = max_calls
        self.tool_names = tool_names
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet classified
        self._blank = ""  # whitespace content held back
        self._is_in_call = False
        self._is_bare = None if tool_names else False  # may the reply be a bare call? None: not yet known

    def feed(self, text: str) -> list:
        self._pending += text
        if self._is_bare is None:
            head = self._pending.lstrip()
            if not head or (head.startswith("`") and "```".startswith(head)):
                return []
            self._is_bare = head.startswith(("{", "```"))
        return [] if self._is_bare else self._feed_tagged()

    def finish(self) -> list:
        """Everything still held back, at the end of the reply."""
        items: list = []
        if self._is_bare is not False:
            self._is_bare = False
            call = _parse_bare_call(self._pending, self.tool_names)
            if call is not None:
                self.calls.append(call)
                self._pending = ""
                return [call]
            items = self._feed_tagged()
        if self._is_in_call:
            self._is_in_call = False
            self._end_call(self._pending, items, is_closed=False)
        else:
            self._content(self._pending, items)
        if not self.calls and self._blank:  # a reply without calls keeps its whitespace
            items.append(self._blank)
        self._pending = self._blank = ""
        return items

    def _feed_tagged(self) -> list:
        items: list = []
        while True:
            if self._is_in_call:
                end = self._pending.find(CLOSE_TAG)
                if end < 0:
                    return items
                self._end_call(self._pending[:end], items)
                self._pending, self._is_in_call = self._pending[end + len(CLOSE_TAG):], False
                continue
            start = self._pending.find(OPEN_TAG)
            if start < 0:
                cut = len(self._pending) - _partial_tag_len(self._pending)
                self._content(self._pending[:cut], items)
                self._pending = self._pending[cut:]
                return items
            self._content(self._pending[:start], items)
            self._pending, self._is_in_call = self._pending[start + len(OPEN_TAG):], True

    def _end_call(self, body: str, items: list, is_closed: bool = True) -> None:
        call = parse_call(body)
        if call is None:
            self._content(OPEN_TAG + body + (CLOSE_TAG if is_closed else ""), items)
        elif self.max_calls is None or len(self.calls) < self.max_calls:
            self.calls.append(call)
            items.append(call)

    def _content(self, text: str, items: list) -> None:
        text, self._blank = self._blank + text, ""
        stripped = text.rstrip()
        if stripped:
            items.append(stripped)
        self._blank = text[len(stripped):]


_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)


def _parse_bare_call(text: str, tool_names: tuple[str, ...]) -> ToolCall | None:
    """`{"name": ..., "arguments": ...}` alone, or alone in a ``` / ```json fence, naming one of
    tool_names -> the call; anything else None (a JSON answer that is not a call stays content)."""
    text = text.strip()
    fenced = _FENCE.fullmatch(text)
    call = parse_call(fenced.group(1) if fenced else text) if text else None
    return call if call is not None and call.name in tool_names else None


def _partial_tag_len(text: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of OPEN_TAG."""
    return next((n for n in range(min(len(text), len(OPEN_TAG) - 1), 0, -1) if text.endswith(OPEN_TAG[:n])), 0)


def split_reply(text: str, max_calls: int | None = None,
                tool_names: tuple[str, ...] = ()) -> tuple[str, list[ToolCall]]:
    """A whole reply -> (content, calls); content is the text outside the calls."""
    parser = ToolCallParser(max_calls, tool_names)
    items = parser.feed(text) + parser.finish()
    return "".join(i for i in items if isinstance(i, str)), parser.calls
