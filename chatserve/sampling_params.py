"""SamplingParams: what a caller may ask of one generation, validated on construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from spec.stats import SpecStats


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping settings (vLLM's names and meanings).

    temperature 0 means greedy. top_k 0 (or -1) disables top-k; top_p 1.0 and min_p 0.0
    disable theirs. Every invalid value raises ValueError naming the field.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's: minus this from every generated token's logit
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to its logit
    # None: no logprobs; n >= 0: each generated token's logprob and the n most likely (0-20), from
    # the target's distribution after every setting above (greedy: after penalties and bias)
    logprobs: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Speculation per request: None = engine default; 0 disables drafting for this request.
    num_draft_tokens: int | None = None
    # Who drafts: a name in chatserve.spec_methods.SPEC_METHODS ("draft": the draft model, if
    # the engine loaded one; "ngram": prompt lookup; ...); None = the engine's own method.
    spec_method: str | None = None
    # The reply must be JSON matching this schema (a JSON-encoded schema object; '{"type":"object"}'
    # for any object), enforced token by token (chatserve/grammar.py); None = free text.
    json_schema: str | None = None
    # Or the reply must match this grammar, in llguidance's Lark dialect (tool calls forced by
    # tool_choice, chatserve/tool_calls.py); at most one of json_schema and grammar.
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in self.logit_bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=0)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, high=100.0, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        for t, b in self.logit_bias:
            _check_int("logit_bias", t, low=0)
            _check_float("logit_bias", b, low=-100.0, high=100.0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: every stop string must be a non-empty string, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a boolean, got {self.ignore_eos!r}")
        if self.num_draft_tokens is not None:
            _check_int("num_draft_tokens", self.num_draft_tokens, low=0, high=16)
        if self.json_schema is not None and not _is_json_object(self.json_schema):
            raise ValueError(f"json_schema: must be a JSON-encoded object, got {self.json_schema!r:.80}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or self.json_schema is not None):
            raise ValueError("grammar: must be a string, and not given with json_schema (response_format)")
        if self.spec_method is not None:
            from chatserve.spec_methods import SPEC_METHODS  # the registry imports this module

            if self.spec_method not in SPEC_METHODS:
                raise ValueError(f"spec_method: must be one of {', '.join(map(repr, SPEC_METHODS))} (or null for "
                                 f"the engine's default), got {self.spec_method!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _is_json_object(text) -> bool:
    try:
        return isinstance(text, str) and isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _check_int(name: str, value, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name}: must be <= {high}, got {value}")


def _check_float(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name}: must be in {bracket}{low}, {high}], got {value}")


@dataclass
class RequestStats:
    """Per-request numbers reported when a request finishes (and summed into global metrics)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_generated: int = 0
    spec: SpecStats = field(default_factory=SpecStats)  # this request's drafts and acceptance
    spec_method: str | None = None  # the method as resolved by the engine; None = no speculation
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_time is None:
            return None
        return (self.first_token_time - self.arrival_time) * 1000.0

    @property
    def queue_ms(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return (self.first_scheduled_time - self.arrival_time) * 1000.0

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first one."""
        if self.first_token_time is None or self.finish_time is None or self.num_generated < 2:
            return None
        return (self.finish_time - self.first_token_time) * 1000.0 / (self.num_generated - 1)

    @property
    def num_drafted(self) -> int:
        return self.spec.num_draft_tokens

    @property
    def num_accepted(self) -> int:
        return self.spec.num_accepted_tokens

    @property
    def num_spec_steps(self) -> int:
        """Verification steps that had at least one draft token."""
        return self.spec.num_spec_steps

    @property
    def accepted_by_position(self) -> list[int]:
        """[k]: steps in which the draft at position i was accepted."""
        return self.spec.accepted_by_position

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted / self.num_drafted if self.num_drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Mean tokens emitted per verification step (accepted drafts + 1)."""
        if not self.num_spec_steps:
            return None
        return (self.num_accepted + self.num_spec_steps) / self.num_spec_steps

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "num_generated": self.num_generated,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_by_position": list(self.accepted_by_position),
            "spec_method": self.spec_method,
            "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms,
            "queue_ms": self.queue_ms,
        }


# How a token came: a draft the target accepted, the target's own token after a rejected draft
# (recovered) or after all drafts were accepted (bonus), or a plain target step with no drafts.
TOKEN_ORIGINS = ("accepted", "recovered", "bonus", "target")


@dataclass
class Delta:
    """What one engine step produced for one request: new text and token ids, maybe the end.

    finish_reason is None while running, else "stop" (EOS / stop string / stop token),
    "length" (max_tokens or context limit), "abort" or "error" (with `error` set).
    `stats` is set on the final delta.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: RequestStats | None = None
    error: str | None = None
    # with params.logprobs: per token of token_ids, (id, logprob, [(id, logprob)] most likely first)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # per token of token_ids: how it came (TOKEN_ORIGINS), and the text it released ("" while a
    # character is incomplete or a stop string may follow); the pieces join to `text`
    origins: list[str] | None = None
    pieces: list[str] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
