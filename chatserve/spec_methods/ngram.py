"""N-gram prompt lookup as a speculation method: free proposals from the request's own tokens."""

from __future__ import annotations

from chatserve.config import SpecConfig
from chatserve.request import Request
from chatserve.spec_methods.base import Offer
from spec.adaptive import ACCEPT_EMA, PROBE_EVERY, AcceptanceEMA, geometric_gains
from spec.ngram import NgramProposer


class NgramMethod:
    name = "ngram"
    label = "n-gram"
    mixable = False
    keeps_kv = False
    step_cost = None
    probe_every = PROBE_EVERY
    accept_ema = ACCEPT_EMA
    reads_features = False

    def __init__(self, config: SpecConfig):
        self.lookup = NgramProposer(config.ngram_min, config.ngram_max, config.max_draft_tokens)
        # n-gram drafts on chat are mostly rejected: a lower prior than a draft model's
        self.accept_rate = AcceptanceEMA(ema=0.05, prior=0.5)

    @classmethod
    def create(cls, config: SpecConfig, models, sampler) -> NgramMethod:
        return cls(config)

    def offer(self, req: Request, cap: int, accept_rate: float) -> Offer | None:
        tokens = self.lookup.propose_one(req.spec.tokens.of(req.token_ids), cap)
        return Offer(self, geometric_gains(accept_rate, len(tokens)), tokens) if tokens else None

    def propose(self, reqs: list[Request], ks: list[int]) -> None:
        for req, k in zip(reqs, ks):
            req.draft_token_ids = req.spec.offer.token_ids[:k]

    def finish(self, req: Request) -> None:
        pass
