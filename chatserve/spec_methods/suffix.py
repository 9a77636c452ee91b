"""Suffix decoding as a speculation method: free proposals from the longest earlier match of a
request's suffix, in its own tokens (the conversation) or in recent replies of all requests."""

from __future__ import annotations

from chatserve.config import SpecConfig
from chatserve.request import Request
from chatserve.spec_methods.base import Offer
from spec.adaptive import ACCEPT_EMA, PROBE_EVERY, AcceptanceEMA
from spec.suffix import SuffixCorpus, SuffixProposer

# Weight of the method's measured acceptance rate against the counts: one pseudo-occurrence.
PRIOR_WEIGHT = 1.0


class SuffixMethod:
    name = "suffix"
    label = "suffix decoding"
    keeps_kv = False
    step_cost = None
    probe_every = PROBE_EVERY
    accept_ema = ACCEPT_EMA
    reads_features = False
    mixable = True  # a draft-model or EAGLE request takes a suffix proposal when it promises more

    def __init__(self, config: SpecConfig):
        self.proposer = SuffixProposer()
        self.corpus = SuffixCorpus(config.suffix_corpus_tokens) if config.suffix_corpus_tokens else None
        self.accept_rate = AcceptanceEMA(ema=0.05, prior=0.6)

    @classmethod
    def create(cls, config: SpecConfig, models, sampler) -> SuffixMethod:
        return cls(config)

    def offer(self, req: Request, cap: int, accept_rate: float) -> Offer | None:
        """The proposal with its confidence: position j's acceptance is estimated from how often
        its token followed (counts / totals), pulled toward the measured accept_rate by one
        pseudo-occurrence, so one lone match is not taken for a certainty."""
        draft = self.proposer.propose(req.spec.tokens.of(req.token_ids), cap, self.corpus)
        if not draft.token_ids:
            return None
        gains, gain = [], 1.0  # a few positions: plain floats (numpy's small calls cost more here)
        for count, total in zip(draft.counts, draft.totals):
            gain *= (count + PRIOR_WEIGHT * accept_rate) / (total + PRIOR_WEIGHT)
            gains.append(gain)
        return Offer(self, gains, draft.token_ids)

    def propose(self, reqs: list[Request], ks: list[int]) -> None:
        for req, k in zip(reqs, ks):
            req.draft_token_ids = req.spec.offer.token_ids[:k]

    def finish(self, req: Request) -> None:
        """A finished reply joins the corpus other requests match against."""
        if self.corpus is not None:
            self.corpus.add(req.output_token_ids)
