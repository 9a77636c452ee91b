"""The Proposer interface: what any drafter (draft model, n-gram, later EAGLE heads) returns.

Proposers see token ids only; the engine owns requests, caches and scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass
class Draft:
    """Draft tokens for one batch.

    token_ids[b] holds at most the k requested for sequence b (possibly none).
    probs is the draft distribution of each draft token, [batch, k, vocab_size] with
    k >= max len(token_ids[b]); None means one-hot at the drafted tokens (n-gram drafts).
    """

    token_ids: list[list[int]]
    probs: torch.Tensor | None = None  # [batch, k, vocab_size] or None

    def to_tensors(
        self, num_cols: int | None = None, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch, num_cols] long, -1 padded; [batch] long)
        """(draft_token_ids, num_draft_tokens) as `verify_greedy` / `rejection_sample` take them.

        num_cols defaults to probs.shape[1], else the longest draft.
        """
        if num_cols is None and self.probs is not None:
            num_cols = self.probs.shape[1]
        elif num_cols is None:
            num_cols = max(map(len, self.token_ids), default=0)
        padded = [t + [-1] * (num_cols - len(t)) for t in self.token_ids]
        draft_token_ids = torch.tensor(padded, dtype=torch.long).reshape(len(padded), num_cols)
        num_draft_tokens = torch.tensor([len(t) for t in self.token_ids], dtype=torch.long)
        return draft_token_ids.to(device), num_draft_tokens.to(device)


class Proposer(Protocol):
    """Anything that drafts tokens from token-id contexts."""

    def propose(self, contexts: list[list[int]], num_draft_tokens: list[int]) -> Draft:
        """Draft up to num_draft_tokens[b] tokens to follow contexts[b] (prompt + output)."""
        ...


def one_hot_draft_probs(
    draft_token_ids: torch.Tensor,  # [batch, k] long, -1 padded
    vocab_size: int,
) -> torch.Tensor:  # [batch, k, vocab_size] float32; padded slots are all zero
    """Draft probs of a deterministic drafter: 1.0 at each draft token."""
    is_drafted = draft_token_ids >= 0  # [batch, k]
    probs = torch.zeros(*draft_token_ids.shape, vocab_size, device=draft_token_ids.device)
    probs.scatter_(2, draft_token_ids.clamp_min(0).unsqueeze(-1), is_drafted.unsqueeze(-1).float())
    return probs


class TokenArray:
    """An int64 copy of an append-only list of token ids (a request's token_ids), brought up to date
    by what was appended since the last call instead of converting the whole list each step
    (np.fromiter: ~25 us at 1,500 tokens, ~65 at 4,000, hot). A list that got shorter is copied again."""

    def __init__(self):
        self._buf = np.empty(0, np.int64)
        self._len = 0

    def of(self, token_ids: list[int]) -> np.ndarray:
        """[len(token_ids)] int64: a view of the copy (appending leaves it as it is)."""
        n = len(token_ids)
        if n < self._len:
            self._len = 0
        if n > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), n + 256), np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        if n > self._len:
            self._buf[self._len : n] = token_ids[self._len : n]
            self._len = n
        return self._buf[:n]
