"""The speculation seam: each method (draft model, n-gram, ...) is one class behind SpecMethod.

SpecRunner asks a request's methods for an Offer each step, prices every offer of the batch
together (spec/adaptive.allocate_drafts), and calls propose() for the sequences that got
drafts. A method never sees the scheduler, the target model or other methods; one that
reads_features (an EAGLE head) is shown the target's features after every forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from spec.adaptive import AcceptanceEMA
from spec.proposer import TokenArray
from spec.sampling import argmax_rows, mask_logits

if TYPE_CHECKING:
    from chatserve.batch import BatchItem
    from chatserve.config import SpecConfig
    from chatserve.request import Request
    from chatserve.scheduler import ScheduledSeq


@dataclass
class Offer:
    """What one method can draft for one request this step.

    gains[j - 1]: the probability that the first j drafts are all accepted (so the cap is
    len(gains)); token_ids: the proposal itself when it was free to make now (n-gram), None
    when propose() must run a model; num_catch_up_tokens: tokens the method's model must see
    before its first draft (SpecRunner prices them from the measured costs).
    """

    method: SpecMethod
    gains: list[float]
    token_ids: list[int] | None = None
    num_catch_up_tokens: int = 0

    @property
    def cap(self) -> int:
        return len(self.gains)


RECENT_STEPS = 8  # steps kept per request for its typical gap (SpecRunner.GAP_LIMIT)


@dataclass(eq=False)
class SpecState:
    """One request's speculation, kept on the request between the calls of a step: its
    methods (its own first, then the free ones it may mix in), one acceptance controller per
    method it drafted with (adaptive only), the offer plan() chose this step, and how many
    unseen tokens its draft model catches up on this step without drafting."""

    methods: tuple[SpecMethod, ...]
    controllers: dict[str, object] = field(default_factory=dict)  # name -> spec.adaptive.AdaptiveDraftLength
    offer: Offer | None = None
    num_catch_up_tokens: int = 0
    # the prices (SpecCosts) of its latest steps: what its client waits between deltas
    recent_steps: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    tokens: TokenArray = field(default_factory=TokenArray)  # its token_ids as int64, for the lookup methods
    # a chain drafted by a method that knows its confidence (spec.adaptive.chain_stop_gains; 0: never,
    # set by plan for adaptive requests): a draft computed is kept while the probability P that all
    # the chain's drafts so far are accepted is >= keep_gain, the next is computed while P >= least_gain
    keep_gain: float = 0.0
    least_gain: float = 0.0

    @property
    def method(self) -> SpecMethod:
        return self.methods[0]

    @property
    def kv_method(self) -> SpecMethod | None:
        """Its method that runs the draft model, if any."""
        return next((m for m in self.methods if m.keeps_kv), None)


class SpecMethod(Protocol):
    """One way of drafting. Registered by `name` in chatserve/spec_methods/__init__.py."""

    name: ClassVar[str]  # the SamplingParams.spec_method value
    label: ClassVar[str]  # how a UI names it
    keeps_kv: ClassVar[bool]  # runs the draft model, which keeps KV in the pool (blocks carry its mark)
    step_cost: ClassVar[str | None]  # each draft position costs a forward: "draft" (model) or "head" (SpecCosts)
    reads_features: ClassVar[bool]  # observe()s the target's features after every step (an EAGLE head)
    mixable: ClassVar[bool]  # free proposals that a request whose drafts cost steps (step_cost) may take instead
    probe_every: ClassVar[int]  # a request priced out of drafting probes after this many steps (AdaptiveDraftLength)
    accept_ema: ClassVar[float]  # the weight of a step's outcome in a request's acceptance estimate (likewise)
    accept_rate: AcceptanceEMA  # engine-wide, per method: the prior of new requests and probes

    @classmethod
    def create(cls, config: SpecConfig, models, sampler) -> SpecMethod | None:
        """The method for this engine, or None when it cannot run with these models."""
        ...

    def offer(self, req: Request, cap: int, accept_rate: float) -> Offer | None:
        """Up to `cap` drafts for req, priced at `accept_rate` per position unless the method
        knows better; None when it has nothing to offer."""
        ...

    def propose(self, reqs: list[Request], ks: list[int]) -> list[tuple[int, float]] | None:
        """Set req.draft_token_ids (at most ks[i]) and req.draft_probs ([k, vocab], or None for
        one-hot drafts) for the requests this step drafts with this method. A method whose drafts
        cost a step (step_cost) may return each draft position's (sequences drafting, seconds):
        SpecRunner rescales that step's start-up cost table by them."""
        ...

    def finish(self, req: Request) -> None:
        """req finished (not aborted): a method that learns from replies may keep its output."""
        ...

    def observe(self, scheduled: list[ScheduledSeq], items: list[BatchItem], features: torch.Tensor) -> None:
        """Called after every target forward on methods with reads_features only (the others
        need not define it), once the step's tokens are appended: items as fed (block ids as
        scheduled), features [num_tokens, hidden] for their rows."""
        ...

    def release(self, req: Request) -> None:
        """reads_features methods only: req is aborted, its blocks still held; write what was
        deferred for them."""
        ...


def sample_draft(sampler, req: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """logits [1, vocab] -> (draft token, its distribution [1, vocab] or None if greedy). A
    sampled draft comes with the distribution it was drawn from: rejection sampling needs it.
    Under a grammar (req.grammar) that is the draft's distribution masked by the grammar's state
    after the drafts so far and renormalized, as the target's is: verification stays exact."""
    if req.grammar is not None:
        allowed = req.grammar.mask(logits.shape[1], req.draft_token_ids).unsqueeze(0)  # [1, vocab]
        logits = mask_logits(logits, allowed)
        if not bool(logits.isfinite().any()):
            # the draft's vocabulary (an EAGLE head's subset) holds no allowed token: draw from all
            # of them evenly; any proper draft distribution keeps verification exact
            logits = mask_logits(torch.zeros_like(logits), allowed)
    if req.params.is_greedy:
        return int(argmax_rows(logits[0])), None
    return sampler.draw_row(req, logits)
