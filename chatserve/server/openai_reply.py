"""One OpenAI request's reply: its choices as their deltas arrive (text, logprobs, tool calls),
shaped into streamed chunks or a whole response, and the usage they add up to. No I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from chatserve import openai_protocol as OP
from chatserve.sampling_params import Delta
from chatserve.tool_calls import ToolCall, ToolCallParser


def reply_pieces(parser: ToolCallParser | None, text: str, is_last: bool) -> list:
    """A delta's text -> what to send now: content strings and ToolCalls (without tools: the text)."""
    if parser is None:
        return [text] if text else []
    return parser.feed(text) + (parser.finish() if is_last else [])


@dataclass
class Choice:
    """One choice's reply as its deltas arrive."""

    index: int
    parser: ToolCallParser | None  # None: the reply is not parsed for tool calls
    parts: list[str] = field(default_factory=list)
    token_logprobs: list = field(default_factory=list)
    num_tokens: int = 0
    text_offset: int = 0  # streaming: where the next delta's text starts
    last: Delta | None = None  # the latest delta (the finished one at the end)

    def add(self, delta: Delta) -> None:
        self.parts.append(delta.text)
        self.token_logprobs += delta.logprobs or []
        self.num_tokens += len(delta.token_ids)
        self.last = delta


@dataclass(frozen=True)
class Shape:
    """Shapes chunks and responses for one OpenAI request (chat or text completion)."""

    is_chat: bool
    id: str
    model: str
    created: int
    include_usage: bool
    token_text: Callable[[int], str] | None = None  # set when logprobs were asked for
    tool_names: tuple[str, ...] | None = None  # the tools offered; None: the reply is not parsed for calls
    max_tool_calls: int | None = None  # parallel_tool_calls false: 1
    is_legacy_functions: bool = False  # a call is `function_call`, not `tool_calls` (OpenAIRequest's)

    def tool_call_parser(self) -> ToolCallParser | None:
        return None if self.tool_names is None else ToolCallParser(self.max_tool_calls, self.tool_names)

    def finish_reason(self, reason: str, parser: ToolCallParser | None) -> str:
        """OpenAI's "tool_calls" ("function_call") when the model stopped after calling (not when
        cut by max_tokens)."""
        if reason != "stop" or parser is None or not parser.calls:
            return reason
        return "function_call" if self.is_legacy_functions else "tool_calls"

    def piece_chunk(self, choice: Choice, piece: str | ToolCall, logprobs: dict | None) -> dict:
        """A streamed content piece, or a whole tool call (`delta.tool_calls`, index = its place
        among the reply's calls: id, type, name and arguments in one chunk; or `delta.function_call`)."""
        if isinstance(piece, str):
            return self.chunk(choice.index, piece, None, logprobs=logprobs)
        entry = piece.to_dict(index=choice.parser.calls.index(piece))
        delta = {"function_call": entry["function"]} if self.is_legacy_functions else {"tool_calls": [entry]}
        return OP.chat_completion_chunk(self.id, self.model, self.created, delta, None, self.include_usage, logprobs,
                                        choice.index)

    def logprobs(self, tokens: list | None, text_offset: int) -> dict | None:
        """Delta.logprobs entries -> the choice's `logprobs` (None when not asked for or none)."""
        if self.token_text is None or not tokens:
            return None
        text = self.token_text
        shaped = [(text(t), lp, [(text(alt), alp) for alt, alp in top]) for t, lp, top in tokens]
        return OP.chat_logprobs(shaped) if self.is_chat else OP.completion_logprobs(shaped, text_offset)

    def chunk(self, index: int, text: str, finish_reason: str | None, role: bool = False,
              logprobs: dict | None = None) -> dict:
        if not self.is_chat:
            return OP.completion_response(self.id, self.model, self.created,
                                          [OP.completion_choice(index, text, finish_reason, logprobs)],
                                          with_usage=self.include_usage)
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        return OP.chat_completion_chunk(self.id, self.model, self.created, delta, finish_reason, self.include_usage,
                                        logprobs, index)

    def usage_chunk(self, usage: dict) -> dict:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        return OP.usage_chunk(kind, self.id, self.model, self.created, usage)

    def whole(self, choices: list[Choice], usage: dict) -> dict:
        shaped = [self._whole_choice(c) for c in choices]
        if self.is_chat:
            return OP.chat_completion_response(self.id, self.model, self.created, shaped, usage)
        return OP.completion_response(self.id, self.model, self.created, shaped, usage)

    def _whole_choice(self, choice: Choice) -> dict:
        """A finished choice: its text (tool calls taken out), finish reason and logprobs."""
        text, parser = "".join(choice.parts), choice.parser
        if parser is not None:
            text = "".join(p for p in reply_pieces(parser, text, is_last=True) if isinstance(p, str))
        reason = self.finish_reason(choice.last.finish_reason or "abort", parser)
        logprobs = self.logprobs(choice.token_logprobs, 0)
        if self.is_chat:
            calls = [c.to_dict() for c in parser.calls] if parser else None
            return OP.chat_choice(choice.index, text, reason, logprobs, calls, self.is_legacy_functions)
        return OP.completion_choice(choice.index, text, reason, logprobs)


def total_usage(choices: list[Choice], num_prompt_tokens: int) -> dict:
    """The prompt once (it was computed once), the completion tokens of every choice; cached
    tokens as choice 0 found them (the others attach the blocks it computed)."""
    stats = [c.last.stats if c.last is not None else None for c in choices]
    completion_tokens = sum(st.num_generated if st is not None else c.num_tokens for c, st in zip(choices, stats))
    if stats[0] is None:
        return OP.usage_dict(num_prompt_tokens, completion_tokens, None)
    return OP.usage_dict(stats[0].prompt_tokens or num_prompt_tokens, completion_tokens, stats[0].cached_tokens)
