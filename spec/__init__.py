"""Speculative decoding: proposers, verification, sampling, adaptive k and stats.

Knows token ids, probabilities and costs; never imports chatserve.
"""

from spec.adaptive import AdaptiveDraftLength
from spec.ngram import NgramProposer
from spec.proposer import Draft, Proposer, one_hot_draft_probs
from spec.sampling import (
    apply_repetition_penalty,
    logits_to_probs,
    sample_from_probs,
    uniform_noise,
)
from spec.stats import SpecStats
from spec.verify import rejection_sample, verify_greedy

__all__ = [
    "AdaptiveDraftLength",
    "Draft",
    "NgramProposer",
    "Proposer",
    "SpecStats",
    "apply_repetition_penalty",
    "logits_to_probs",
    "one_hot_draft_probs",
    "rejection_sample",
    "sample_from_probs",
    "uniform_noise",
    "verify_greedy",
]
