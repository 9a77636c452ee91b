"""Suffix decoding's draft in one C++ call (kernels/suffix_cpu.cpp). spec/suffix.py holds the numpy
reference (SuffixProposer._draft_ref), which it takes where the extension is not built; tests hold
the two equal (tests/spec/test_suffix.py)."""

from __future__ import annotations

import numpy as np
import torch

from kernels import cpu_ext


def suffix_draft(haystack: np.ndarray, ctx: np.ndarray, is_self: bool, max_tokens: int, max_depth: int,
                 max_spec_factor: float, min_prob: float,
                 max_candidates: int) -> tuple[list[int], list[int], list[int], int] | None:
    """(token ids, counts, totals, match length) as SuffixProposer._draft_ref computes them, from
    contiguous int64 arrays; None without the extension."""
    ext = cpu_ext.extension()
    if ext is None:
        return None
    return ext.suffix_draft(torch.from_numpy(haystack), torch.from_numpy(ctx), is_self, max_tokens, max_depth,
                            max_spec_factor, min_prob, max_candidates)
