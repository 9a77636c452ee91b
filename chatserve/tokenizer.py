"""Chat template, EOS ids and incremental detokenization (stop strings included)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence


class Tokenizer:
    """A thin wrapper over a transformers tokenizer loaded from a local directory. `chat_template`:
    a Jinja file that replaces the tokenizer's own template (vLLM's --chat-template)."""

    def __init__(self, model_dir: str | Path, chat_template: str | Path | None = None):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        if chat_template is not None:
            self._replace_chat_template(Path(chat_template))
        self.eos_token_ids = _eos_ids(Path(model_dir), self.hf)
        self.vocab_size = len(self.hf)
        # Added / special tokens (end of turn, tool tags...): ids a draft head must keep.
        self.special_token_ids = sorted(set(self.hf.all_special_ids) | set(self.hf.added_tokens_decoder)
                                        | set(self.eos_token_ids))
        self.are_tool_tags_tokens = {"<tool_call>", "</tool_call>"} <= set(self.hf.added_tokens_encoder)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False) -> list[int]:
        """`tools`: OpenAI's function tools, which the template offers the model (transformers'
        `tools=`); a template that does not read them ignores them. continue_final_message: the
        prompt ends inside the last message (to continue it), with no end-of-turn. Messages as
        protocol.parse_chat_messages normalizes them: `tool` results and assistant `tool_calls`."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: must be an object with a string 'content'")
            if m.get("role") not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"messages[{i}].role: must be system, user, assistant or tool, got {m.get('role')!r}")
        ids = self.hf.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)

    def _replace_chat_template(self, path: Path) -> None:
        """Rendered once on a one-message chat, so a broken template fails at start, not per request."""
        self.hf.chat_template = path.read_text()  # FileNotFoundError names the path
        try:
            self.apply_chat_template([{"role": "user", "content": "hi"}])
        except Exception as e:
            raise ValueError(f"chat template {path}: {type(e).__name__}: {e}") from None


def _eos_ids(model_dir: Path, hf) -> tuple[int, ...]:
    ids: set[int] = set()
    if hf.eos_token_id is not None:
        ids.add(int(hf.eos_token_id))
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return tuple(sorted(ids))


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Never emits half of a multi-byte character (a trailing U+FFFD is held back), and never
    emits any part of a stop string: the last (longest stop - 1) characters wait until they
    cannot begin a stop string.
    """

    def __init__(self, decode, stop: Sequence[str] = ()):
        self._decode = decode
        self.stop = tuple(stop)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # all text decoded so far (may run past a stop string until it is cut)
        self._num_sent = 0

    def add(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Append tokens; return (text safe to send now, whether a stop string was hit).

        On a stop hit the text is cut before the stop string and everything left is sent.
        """
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
        if self.stop:
            search_from = max(0, self._num_sent - self._holdback)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self._take(len(self.text)), True
        return self._take(len(self.text) - self._holdback if self.stop else len(self.text)), False

    def flush(self) -> str:
        """At the end of generation: everything not yet sent (the held-back tail)."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        upto = max(upto, self._num_sent)
        out = self.text[self._num_sent : upto]
        self._num_sent = upto
        return out
