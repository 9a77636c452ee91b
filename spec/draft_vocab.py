"""Draft over part of the vocabulary: a smaller LM head for the draft model (FR-Spec's idea).

A 0.5B draft with a 151,936-row head spends ~27% of its weight reads on that head. Drafting
over the most frequent tokens only keeps nearly all proposals the same and stays lossless: the
target still scores the full vocabulary, a token the draft cannot propose simply has draft
probability 0, and rejection sampling is exact for any draft distribution. Byte-level BPE ids
are merge ranks, so the lowest ids are the most frequent merges; special tokens (end of turn)
sit at the top of the vocabulary and are added back explicitly.
"""

from __future__ import annotations

import torch
from torch import nn


class SubsetHead(nn.Module):
    """Logits for `keep_ids` only, laid into a full-width row that is -inf elsewhere."""

    def __init__(self, head: nn.Linear, keep_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        assert head.bias is None and keep_ids.dim() == 1
        self.vocab_size = vocab_size
        self.register_buffer("keep_ids", keep_ids.long())  # [num_kept]
        if not isinstance(head, nn.Linear):  # a chatserve.models.loader.StreamedLinear: rows still in the file, read when quantized
            self.linear = head.select(self.keep_ids)
            return
        self.linear = nn.Linear(head.in_features, len(keep_ids), bias=False, dtype=head.weight.dtype)
        with torch.no_grad():
            self.linear.weight.copy_(head.weight[keep_ids])  # [num_kept, hidden]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        kept = self.linear(hidden)  # [N, num_kept]
        logits = kept.new_full((hidden.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.keep_ids] = kept
        return logits


def frequent_token_ids(vocab_size: int, num_kept: int, always: list[int]) -> torch.Tensor:
    """The first `num_kept` ids (most frequent BPE merges) plus `always` (special tokens)."""
    keep = set(range(min(num_kept, vocab_size))) | {t for t in always if 0 <= t < vocab_size}
    return torch.tensor(sorted(keep), dtype=torch.long)


def restrict_head(model: nn.Module, num_kept: int, always: list[int]) -> bool:
    """Swap model.lm_head for a SubsetHead when that saves anything; returns whether it did."""
    head = subset_head(model.lm_head, num_kept, always)
    model.lm_head = head
    return isinstance(head, SubsetHead)


def subset_head(head: nn.Linear, num_kept: int, always: list[int]) -> nn.Module:
    """A SubsetHead over the `num_kept` most frequent ids, or `head` itself when that saves nothing."""
    vocab = head.out_features
    if num_kept <= 0 or num_kept >= vocab:
        return head
    return SubsetHead(head, frequent_token_ids(vocab, num_kept, always), vocab)
