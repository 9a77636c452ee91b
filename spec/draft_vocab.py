"""Draft over part of the vocabulary: a smaller LM head for the draft model (FR-Spec's idea).

A 0.5B draft with a 151,936-row head spends ~27% of its weight reads on that head. Drafting
over the most frequent tokens only keeps nearly all proposals the same and stays lossless: the
target still scores the full vocabulary, a token the draft cannot propose simply has draft
probability 0, and rejection sampling is exact for any draft distribution.

Which ids: those the target itself says most often. spec/data/ ships token counts over a target's
own greedy replies (written by benchmarks/draft_vocab.py from the replies `chatserve train-head`
collects), one file per tokenizer, found by a fingerprint of the vocabulary; ids never counted
follow in id order (byte-level BPE ids are merge ranks, so the lowest ids are the most frequent
merges), which is also the whole order for a tokenizer with no counts. Special tokens (end of
turn) sit at the top of the vocabulary and are added back explicitly. Measured on Qwen2.5-Coder
(docs/benchmarks.md, session 24): at 65,536 ids the draft's top token is the target's next one in
80.4% of held-out reply positions by counts, 79.9% by lowest ids, 81.2% over all 151,936.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

COUNTS_DIR = Path(__file__).parent / "data"  # {"tokenizer": fingerprint, "counts": [[id, count], ...], ...}


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


def vocab_fingerprint(vocab: dict[str, int]) -> str:
    """A tokenizer's identity for the shipped counts: a hash of its token -> id map."""
    return hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()[:16]


def reply_counts(fingerprint: str, directory: Path | None = None) -> dict[int, int]:
    """How often a target said each token in its replies, for the tokenizer with this
    fingerprint; {} when no file in `directory` (COUNTS_DIR) is for it."""
    for path in sorted((directory or COUNTS_DIR).glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("tokenizer") == fingerprint:
            return {int(t): int(c) for t, c in record["counts"]}
    return {}


def frequent_token_ids(vocab_size: int, num_kept: int, always: list[int],
                       counts: dict[int, int] | None = None) -> torch.Tensor:
    """`num_kept` ids, the most counted first (ties and ids never counted in id order: the
    most frequent BPE merges), plus `always` (special tokens); sorted."""
    counted = sorted((t for t in counts or {} if 0 <= t < vocab_size), key=lambda t: (-counts[t], t))
    keep = set(counted[:num_kept])
    for t in range(vocab_size):
        if len(keep) >= num_kept:
            break
        keep.add(t)
    keep |= {t for t in always if 0 <= t < vocab_size}
    return torch.tensor(sorted(keep), dtype=torch.long)


def restrict_head(model: nn.Module, num_kept: int, always: list[int]) -> bool:
    """Swap model.lm_head for a SubsetHead when that saves anything; returns whether it did."""
    head = subset_head(model.lm_head, num_kept, always)
    model.lm_head = head
    return isinstance(head, SubsetHead)


def subset_head(head: nn.Linear, num_kept: int, always: list[int], counts: dict[int, int] | None = None) -> nn.Module:
    """A SubsetHead over the `num_kept` most frequent ids, or `head` itself when that saves nothing."""
    vocab = head.out_features
    if num_kept <= 0 or num_kept >= vocab:
        return head
    return SubsetHead(head, frequent_token_ids(vocab, num_kept, always, counts), vocab)
