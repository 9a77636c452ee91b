"""Grammar-constrained decoding: one request's llguidance matcher and the token masks it allows,
and the engine's llguidance tokenizer they share (built once, off the engine thread when served).

The matcher advances with emitted tokens only. Drafts are consumed tentatively, to get the
mask after each of them, and rolled back before returning. No model, no scheduler.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

# At most this many whitespace characters between two JSON tokens: a small model that starts to
# pad with whitespace never ends otherwise (the failure xgrammar's max_whitespace_cnt and vLLM's
# disable-any-whitespace answer).
MAX_WHITESPACE = 16
JSON_OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{1,{MAX_WHITESPACE}}}"}


def json_schema_grammar(schema: dict) -> str:
    """A JSON schema -> an llguidance grammar (text). Raises ValueError naming what is wrong;
    checks the schema without a tokenizer, so the server can refuse it before queueing."""
    if not isinstance(schema, dict):
        raise ValueError(f"the schema must be a JSON object, got {type(schema).__name__}")
    grammar = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid JSON schema: {error}")
    return grammar


def lark_grammar(lark: str) -> str:
    """A grammar in llguidance's Lark dialect (`%json {schema}` embeds a JSON schema) -> an
    llguidance grammar (text). Raises ValueError; `<name>` special tokens are checked only
    against a tokenizer, by GrammarMatcher."""
    if not isinstance(lark, str):
        raise ValueError(f"a Lark grammar must be text, got {type(lark).__name__}")
    grammar = LLMatcher.grammar_from_lark(lark)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid grammar: {error}")
    return grammar


def grammar_tokenizer(hf_tokenizer, eos_token_ids: Sequence[int]) -> LLTokenizer:
    """llguidance's view of a (fast) transformers tokenizer; its masks cover len(hf_tokenizer)
    ids. About a second for a 150k-token vocabulary: build it once per engine."""
    from llguidance.hf import from_tokenizer

    return from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer), eos_token=list(eos_token_ids))


class GrammarTokenizer:
    """An engine's one llguidance tokenizer, built once: by start() on a thread of its own (the
    server starts it with the engine, so the ~1.4 s build for Qwen's 150k vocabulary never runs
    inside an engine step while other streams wait), or else by the first get()."""

    THREAD_NAME = "chatserve-grammar-tokenizer"

    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int]):
        self._hf_tokenizer, self._eos_token_ids = hf_tokenizer, tuple(eos_token_ids)
        self._lock = threading.Lock()  # held by whichever thread builds; get() waits on it
        self._tokenizer: LLTokenizer | None = None
        self._error: ValueError | None = None
        self.built_on: str | None = None  # the name of the thread that built it; None: not built yet

    def start(self) -> None:
        """Build in the background; a get() meanwhile waits for that build, not a second one."""
        if self.built_on is None:
            threading.Thread(target=self._build, name=self.THREAD_NAME, daemon=True).start()

    def get(self) -> LLTokenizer:
        """The tokenizer; ValueError when it cannot be built ("Only fast tokenizers are supported")."""
        self._build()
        if self._error is not None:
            raise self._error
        return self._tokenizer

    def _build(self) -> None:
        with self._lock:
            if self.built_on is not None:
                return
            try:
                self._tokenizer = grammar_tokenizer(self._hf_tokenizer, self._eos_token_ids)
            except ValueError as e:
                self._error = e
            self.built_on = threading.current_thread().name


class GrammarMatcher:
    """The grammar state of one request's emitted tokens.

    mask(): the tokens allowed next; EOS is among them only where the grammar may end.
    is_stopped: the grammar is complete and nothing but EOS may follow, so the request ends.
    """

    def __init__(self, tokenizer: LLTokenizer, grammar: str):
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        self.eos_token_ids = frozenset(tokenizer.eos_tokens)
        self.vocab_size = tokenizer.vocab_size
        self._bitmask = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)  # [num_words], reused
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())

    def consume(self, token_id: int) -> None:
        """Advance past an emitted token; it must be one the last mask allowed."""
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(f"grammar refused emitted token {token_id}: {self.matcher.get_error()}")

    @property
    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many of token_ids, from the start, the grammar allows next (state unchanged). Checked
        up to the first id past the tokenizer's vocabulary (a padding row of the LM head, never
        allowed): llguidance's validate_tokens given one counts wrong (an EOS the grammar refuses
        passed as valid) and leaves the matcher stopped, and a reply then ended mid-object; a
        draft model samples such ids after an EOS draft, where its mask allows everything."""
        token_ids = list(token_ids)
        end = next((j for j, t in enumerate(token_ids) if not 0 <= t < self.vocab_size), len(token_ids))
        return self.matcher.validate_tokens(token_ids[:end])

    def mask(self, vocab_size: int, drafts: Sequence[int] = ()) -> torch.Tensor:  # [vocab_size] bool
        """The tokens allowed after the emitted tokens and then `drafts` (each drawn from the mask
        before it). Ids past the tokenizer's vocabulary (padding rows of an LM head) are never
        allowed. After an EOS draft everything is: the request ends there if it is accepted."""
        num_consumed = self._num_consumable(drafts)
        if num_consumed < len(drafts):
            return torch.ones(vocab_size, dtype=torch.bool)
        self.matcher.consume_tokens(list(drafts))
        allowed = self._current_mask(vocab_size)
        self.matcher.rollback(num_consumed)
        return allowed

    def masks_along(self, vocab_size: int, drafts: Sequence[int]) -> torch.Tensor:  # [k + 1, vocab_size] bool
        """Row j: the tokens allowed after drafts[:j], j = 0..k (verification's k + 1 rows).
        Rows after a draft the grammar refuses allow everything: verification rejects that
        draft (its masked target probability is 0), so they are never read; nor are rows after
        an EOS draft (the request ends there if it is accepted)."""
        num_consumed = self._num_consumable(drafts)
        masks = torch.ones(len(drafts) + 1, vocab_size, dtype=torch.bool)  # [k + 1, vocab_size]
        for j in range(num_consumed + 1):
            masks[j] = self._current_mask(vocab_size)
            if j < num_consumed:
                self.matcher.consume_token(drafts[j])
        self.matcher.rollback(num_consumed)
        return masks

    def _num_consumable(self, drafts: Sequence[int]) -> int:
        """How many leading drafts to consume tentatively: those the grammar allows, up to the
        first EOS (llguidance's rollback does not count a consumed EOS)."""
        num_valid = self.num_valid(drafts)
        return next((j for j, t in enumerate(drafts[:num_valid]) if t in self.eos_token_ids), num_valid)

    def _current_mask(self, vocab_size: int) -> torch.Tensor:  # [vocab_size] bool
        """llguidance's bitmask (bit i of word w: token 32 * w + i), unpacked; ~10x faster than
        its byte-per-token compute_logit_bias (benchmarks/grammar_mask.py)."""
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")  # [num_words * 32]
        if allowed.shape[0] >= vocab_size:
            return torch.from_numpy(allowed[:vocab_size]).bool()
        return torch.nn.functional.pad(torch.from_numpy(allowed).bool(), (0, vocab_size - allowed.shape[0]))
