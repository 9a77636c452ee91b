"""Prompt-lookup drafting: propose what followed the last n-gram earlier in the context.

No model and no torch: numpy over token ids. Drafts are one-hot (Draft.probs is None).
"""

from __future__ import annotations

import numpy as np

from spec.proposer import Draft


class NgramProposer:
    """Prompt lookup (as in vLLM's `NgramProposer`, transformers' `prompt_lookup_num_tokens`).

    For each context, for n from max_n down to min_n: find the most recent earlier
    occurrence of the last n tokens and propose up to k tokens that followed it. The first
    n that matches wins, so longer matches are preferred. No match -> no draft tokens.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4, max_draft_tokens: int = 8):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_draft_tokens = max_draft_tokens

    def propose(self, contexts: list[list[int]], num_draft_tokens: list[int]) -> Draft:
        token_ids = [
            self.propose_one(context, min(k, self.max_draft_tokens))
            for context, k in zip(contexts, num_draft_tokens, strict=True)
        ]
        return Draft(token_ids=token_ids, probs=None)

    def propose_one(self, context: list[int] | np.ndarray, num_draft_tokens: int) -> list[int]:
        """Up to num_draft_tokens tokens for one context ([] if no n-gram recurs).

        Pass an int ndarray to skip the list conversion (~0.1 ms at 4k tokens).
        """
        if num_draft_tokens <= 0 or len(context) < 2:
            return []
        tokens = context if isinstance(context, np.ndarray) else np.fromiter(context, np.int64, len(context))
        last_idx = len(tokens) - 1
        # A match of length n ends at e and equals the suffix (the last n tokens):
        #   tokens: [ ... [e-n+1 .. e] e+1 ... [last_idx-n+1 .. last_idx] ]
        #                  match       ^ proposal starts here    suffix
        # e ranges over [0, last_idx - 1], so at least one token follows every match.
        match_ends = np.flatnonzero(tokens[:-1] == tokens[last_idx])  # [num_candidates]
        match_lens = np.ones(len(match_ends), dtype=np.int64)  # [num_candidates]
        for j in range(1, min(self.max_n, last_idx)):  # e >= j needs j <= last_idx - 1
            # Extend the matches that reached length j by one token to the left.
            is_extended = (match_lens == j) & (match_ends >= j)
            is_extended[is_extended] = tokens[match_ends[is_extended] - j] == tokens[last_idx - j]
            match_lens += is_extended
        for n in range(self.max_n, self.min_n - 1, -1):
            ends = match_ends[match_lens >= n]
            if len(ends):
                follow = ends[-1] + 1  # most recent occurrence
                return tokens[follow : follow + num_draft_tokens].tolist()
        return []


if __name__ == "__main__":
    import time

    rng = np.random.default_rng(0)
    context = rng.integers(0, 32_000, size=4_000).tolist()
    context += context[1000:1003]  # a 3-gram that recurs
    proposer = NgramProposer()
    for as_array in (False, True):
        ctx = np.asarray(context) if as_array else context
        start = time.perf_counter()
        for _ in range(100):
            draft = proposer.propose_one(ctx, 8)
        per_call_ms = (time.perf_counter() - start) * 10
        kind = "ndarray" if as_array else "list"
        print(f"{len(context)}-token context ({kind}): {per_call_ms:.3f} ms/call -> {draft}")
