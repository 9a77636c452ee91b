"""Suffix decoding (SuffixDecoding, Oliaro et al., arXiv:2411.04975): propose what followed the
longest earlier occurrence of the context's suffix, in the request's own tokens or in recent
replies of other requests, scored by how often each continuation followed.

No model: numpy over token ids (the reference), and one C++ call where the CPU kernels are built
(kernels/suffix_ops.py: the same drafts; ~30 small numpy calls a query cost ~0.3 ms in the
engine, each paying cold caches after a forward). Where the paper keeps suffix trees, this scans
the token arrays (a few thousand candidates at most per query): the node of the longest match
is the set of its occurrences, and walking down the tree is narrowing that set token by token.
Drafts are one-hot; the counts only say how much to trust them.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from kernels import suffix_ops

SEPARATOR = -1  # between replies in a corpus: no continuation crosses it


@dataclass
class SuffixDraft:
    """token_ids[j] followed counts[j] of the totals[j] occurrences still matching at depth j
    (the longest match plus the drafts before j); match_len: tokens of the context matched."""

    token_ids: list[int]
    counts: list[int]
    totals: list[int]
    match_len: int

    @property
    def score(self) -> float:
        """Expected accepted tokens if the frequencies were the acceptance probabilities."""
        score, prob = 0.0, 1.0  # a few positions: plain floats, not numpy's small calls
        for count, total in zip(self.counts, self.totals):
            prob *= count / total
            score += prob
        return score


class SuffixCorpus:
    """Recent replies (token ids), oldest dropped past max_tokens, as one array with separators."""

    def __init__(self, max_tokens: int = 1 << 16):
        self.max_tokens = max_tokens
        self._replies: deque[np.ndarray] = deque()
        self._num_tokens = 0
        self._tokens: np.ndarray | None = np.full(1, SEPARATOR, dtype=np.int64)

    def add(self, token_ids: list[int]) -> None:
        if not token_ids:
            return
        reply = np.fromiter(token_ids[-self.max_tokens :], np.int64)
        self._replies.append(reply)
        self._num_tokens += len(reply)
        while self._num_tokens > self.max_tokens:
            self._num_tokens -= len(self._replies.popleft())
        self._tokens = None  # rebuilt on the next query

    @property
    def tokens(self) -> np.ndarray:
        """[SEP, reply, SEP, reply, ..., SEP] (int64)."""
        if self._tokens is None:
            sep = np.full(1, SEPARATOR, dtype=np.int64)
            self._tokens = np.concatenate([sep, *(x for r in self._replies for x in (r, sep))])
        return self._tokens


class SuffixProposer:
    """Longest-match proposals with frequency counts, from a request's own tokens and a corpus.

    max_depth bounds the match length looked for; a match of length L proposes at most
    ceil(max_spec_factor * L) tokens (a one-token match is weak evidence); the walk stops
    when the product of the frequencies falls below min_prob; max_candidates bounds the
    occurrences of the last token examined (the most recent ones).
    """

    def __init__(self, max_depth: int = 32, max_spec_factor: float = 1.0, min_prob: float = 0.1,
                 max_candidates: int = 4096):
        if max_depth < 1 or max_spec_factor <= 0 or not 0 <= min_prob <= 1 or max_candidates < 1:
            raise ValueError("need max_depth >= 1, max_spec_factor > 0, 0 <= min_prob <= 1, max_candidates >= 1")
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_prob = min_prob
        self.max_candidates = max_candidates

    def propose(self, context: list[int] | np.ndarray, max_tokens: int, corpus: SuffixCorpus | None = None) -> SuffixDraft:
        """The better-scored draft of the context's own tokens and the corpus (up to max_tokens)."""
        ctx = (np.ascontiguousarray(context, np.int64) if isinstance(context, np.ndarray)
               else np.fromiter(context, np.int64, len(context)))
        own = self._draft(ctx, ctx, max_tokens, is_self=True)
        if corpus is None:
            return own
        other = self._draft(corpus.tokens, ctx, max_tokens, is_self=False)
        return other if other.score > own.score else own

    def _draft(self, haystack: np.ndarray, ctx: np.ndarray, max_tokens: int, is_self: bool) -> SuffixDraft:
        fast = suffix_ops.suffix_draft(haystack, ctx, is_self, max_tokens, self.max_depth, self.max_spec_factor,
                                       self.min_prob, self.max_candidates)
        return SuffixDraft(*fast) if fast is not None else self._draft_ref(haystack, ctx, max_tokens, is_self)

    def _draft_ref(self, haystack: np.ndarray, ctx: np.ndarray, max_tokens: int, is_self: bool) -> SuffixDraft:
        ends, match_len = self._longest_matches(haystack, ctx, is_self)
        if match_len == 0 or max_tokens <= 0:
            return SuffixDraft([], [], [], 0)
        limit = min(max_tokens, int(np.ceil(self.max_spec_factor * match_len)))
        tokens, counts, totals = [], [], []
        positions = ends + 1  # [num_occurrences]: where each occurrence continues
        prob = 1.0
        for _ in range(limit):
            total = len(positions)  # the occurrences still matching, one at the haystack's end included
            positions = positions[positions < len(haystack)]
            # The most frequent next token, the smallest id among ties: a Counter over the occurrences,
            # mostly a few (np.unique cost ~35 us a call, up to max_tokens calls a step).
            freq = Counter(t for t in haystack[positions].tolist() if t != SEPARATOR)
            if not freq:
                break
            token = min(freq, key=lambda t: (-freq[t], t))
            prob *= freq[token] / total
            if prob < self.min_prob:
                break
            tokens.append(token)
            counts.append(freq[token])
            totals.append(total)
            positions = positions[haystack[positions] == token] + 1
        return SuffixDraft(tokens, counts, totals, match_len)

    def _longest_matches(self, haystack: np.ndarray, ctx: np.ndarray, is_self: bool) -> tuple[np.ndarray, int]:
        """(ends of the occurrences of the longest suffix of ctx found in haystack, its length).

        An occurrence ends at e and equals ctx's last L tokens:
            haystack: [ ... [e-L+1 .. e] e+1 ... ]      ctx: [ ... [n-L .. n-1] ]
        In the context itself the occurrence must end before its last token (e < n - 1), so
        at least one token follows it.
        """
        n = len(ctx)
        search_end = n - 1 if is_self else len(haystack) - 1
        if n == 0 or search_end <= 0:
            return np.empty(0, np.int64), 0
        ends = np.flatnonzero(haystack[:search_end] == ctx[-1])[-self.max_candidates :]  # [num_candidates]
        if not len(ends):
            return ends, 0
        # Token j to the left of each end against ctx's, all depths at once (a loop over depths was
        # ~4 numpy calls a depth, up to max_depth of them a step): a match's length is its run of
        # equal tokens from the end.
        back = np.arange(min(self.max_depth, n))  # [depth]
        at = ends[:, None] - back  # [num_candidates, depth]
        is_equal = (haystack[np.maximum(at, 0)] == ctx[n - 1 - back]) & (at >= 0)
        lens = np.cumprod(is_equal, axis=1).sum(axis=1)  # [num_candidates], each >= 1
        longest = int(lens.max())
        return ends[lens == longest], longest
