"""Suffix decoding as a speculation method: free proposals from the longest earlier match of a
request's suffix, in its own tokens (the conversation) or in recent replies of all requests."""

from __future__ import annotations

from chatserve.config import SpecConfig
from chatserve.request import Request
from chatserve.spec_methods.base import Offer
from spec.adaptive import ACCEPT_EMA, PROBE_EVERY, AcceptanceEMA
from spec.suffix import SuffixCorpus, SuffixProposer

# A draft's acceptance by its depth, the tokens of context it continues (the match's length plus the drafts
# before it): depths 1-7 from 1,251 + 1,112 greedy first-turn replies' positions of Qwen2.5-Coder-1.5B to
# head_prompts.json's code and chat prompts, drafts where every earlier occurrence agreed (count = total;
# benchmarks/suffix_calibration.py --prompts train; 3-6 pooled); deeper, where a reply copies its context, from
# prompts.json's edit prompts (the 1.5B, 0.90 at 8-11, 0.98 from 12) and SmolLM2's train replies (0.82-0.94).
# A one-token match is accepted 0.28 of the time, and the depth tells more than the counts: (count + rate) /
# (total + 1), the price until session 50, gave ~0.8 to a token that followed its context once, and such drafts
# were accepted 0.44.
DEPTH_PRICES = (0.28, 0.43, 0.56, 0.56, 0.56, 0.56, 0.69) + (0.75,) * 4 + (0.9,) * 4 + (0.95,)  # depth 1..16+
RATE_WEIGHT = 0.4  # of the measured acceptance rate against the table: a request whose drafts hold earns more
PRIOR_RATE = 0.6  # the engine-wide rate before any draft


def position_price(depth: int, count: int, total: int, accept_rate: float, depth_prices=DEPTH_PRICES,
                   rate_weight: float = RATE_WEIGHT) -> float:
    """A draft's chance of acceptance given the ones before it held: its depth's price pulled toward the
    measured rate, times the share of earlier occurrences its token followed."""
    table = depth_prices[min(depth, len(depth_prices)) - 1]
    return count / total * ((1 - rate_weight) * table + rate_weight * accept_rate)


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
        self.accept_rate = AcceptanceEMA(ema=0.05, prior=PRIOR_RATE)
        self.depth_prices, self.rate_weight = DEPTH_PRICES, RATE_WEIGHT  # attributes: a benchmark's variant sets them

    @classmethod
    def create(cls, config: SpecConfig, models, sampler) -> SuffixMethod:
        return cls(config)

    def offer(self, req: Request, cap: int, accept_rate: float) -> Offer | None:
        """The proposal with its confidence, position by position (position_price): a draft that
        continues a long match is likelier than one after a single matched token."""
        draft = self.proposer.propose(req.spec.tokens.of(req.token_ids), cap, self.corpus)
        if not draft.token_ids:
            return None
        gains, gain = [], 1.0  # a few positions: plain floats (numpy's small calls cost more here)
        for j, (count, total) in enumerate(zip(draft.counts, draft.totals)):
            gain *= position_price(draft.match_len + j, count, total, accept_rate, self.depth_prices,
                                   self.rate_weight)
            gains.append(gain)
        return Offer(self, gains, draft.token_ids)

    def propose(self, reqs: list[Request], ks: list[int]) -> None:
        for req, k in zip(reqs, ks):
            req.draft_token_ids = req.spec.offer.token_ids[:k]

    def finish(self, req: Request) -> None:
        """A finished reply joins the corpus other requests match against."""
        if self.corpus is not None:
            self.corpus.add(req.output_token_ids)
