"""SpecRunner: the engine's side of speculation. Each step it collects an offer per decoding
request from that request's methods (chatserve/spec_methods), splits the step's drafts over
the batch by measured costs (spec/adaptive.allocate_drafts), has the methods propose, and
records what verification accepted.

The method is per request (SamplingParams.spec_method, default: the engine's). Per-request
state lives on the request (req.spec, req.draft_token_ids, req.draft_probs), never here.
"""

from __future__ import annotations

from chatserve.config import SpecConfig
from chatserve.request import Request
from chatserve.sampler import Sampler
from chatserve.scheduler import ScheduledSeq
from chatserve.spec_costs import MAX_ROWS, assumed_spec_costs, measure_spec_costs
from chatserve.spec_methods import SPEC_METHODS, Offer, SpecMethod, SpecState
from spec.adaptive import AdaptiveDraftLength, allocate_drafts
from spec.stats import SpecStats


class SpecRunner:
    def __init__(self, config: SpecConfig, models, sampler: Sampler, max_num_seqs: int = 16):
        self.config = config
        self.max_model_len = models.max_model_len
        # name -> method, the engine's default first; methods that cannot run here are left out
        self.methods: dict[str, SpecMethod] = {}
        for cls in sorted(SPEC_METHODS.values(), key=lambda c: c.name != config.method):
            method = cls.create(config, models, sampler)
            if method is not None:
                self.methods[cls.name] = method
        if config.method not in self.methods:
            raise ValueError(f"spec.method: {config.method!r} cannot run with the loaded models")
        self.stats = SpecStats()
        self.costs = None
        if config.adaptive:
            self.costs = measure_spec_costs(models, config.num_draft_tokens, max_num_seqs)
            if self.costs is None:  # no scratch room in the pool: a linear model instead
                self.costs = assumed_spec_costs(MAX_ROWS, models.draft_runner is not None)

    @classmethod
    def create(cls, config: SpecConfig, models, max_num_seqs: int = 16) -> "SpecRunner":
        return cls(config, models, Sampler(models.tokenizer.eos_token_ids), max_num_seqs)

    def init_request(self, req: Request) -> None:
        """Resolve req's method (Engine.check_params has checked it). A request with
        num_draft_tokens=0 never drafts: it gets no speculation state at all."""
        if req.params.num_draft_tokens == 0:
            return
        method = self.methods[req.params.spec_method or self.config.method]
        req.spec = SpecState((method,))
        req.stats.spec_method = method.name

    def plan(self, running: list[Request], prefill_rows: int = 0) -> None:
        """Set req.num_lookahead_tokens (this step's k) for every running request that will
        decode next step, and req.spec.offer (the method that drafts for it).

        The adaptive requests' k are chosen together (allocate_drafts): each offers what its
        method can draft with its acceptance estimate, and the batch gets the drafts that
        maximize expected tokens per second of the whole step. A request that fixed
        num_draft_tokens, or any request when adaptive speculation is off, drafts its fixed k.

        prefill_rows (prompt tokens this step also feeds the target) change what draft rows
        cost: the rows past them, not past the decodes alone (SpecCosts.step_target).
        A draft model that has not seen a request's latest tokens must catch up on them first:
        that forward is a setup cost, amortized over the steps the request may still take
        (_catch_up_seconds), so short replies do not each buy a whole draft prefill for a probe.
        """
        priced: list[tuple[Request, Offer | None]] = []
        for req in running:
            req.num_lookahead_tokens = 0
            if req.spec is None:
                continue
            req.spec.offer = None
            if req.is_prefilling or req.num_output_tokens == 0:
                continue
            # Never overshoot max_tokens or the context: k drafts emit up to k + 1 tokens.
            room = max(min(req.params.max_tokens - req.num_output_tokens - 1,
                           self.max_model_len - len(req.token_ids) - 1), 0)
            asked = req.params.num_draft_tokens
            if self.costs is None or asked is not None:
                k = self.config.num_draft_tokens if asked is None else min(asked, self.config.num_draft_tokens)
                offer = self._offer(req, min(k, room))
                req.spec.offer = offer
                req.num_lookahead_tokens = offer.cap if offer else 0
                continue
            priced.append((req, self._offer(req, room)))
        if priced:
            self._allocate(priced, prefill_rows)

    def _offer(self, req: Request, room: int) -> Offer | None:
        """The offer of req's method, capped by its controller when adaptive."""
        method = req.spec.method
        if self.costs is None or req.params.num_draft_tokens is not None:
            return method.offer(req, room, method.accept_rate.rate)
        cap, accept_rate = self._controller(req, method).offer(probe_accept_rate=method.accept_rate.rate)
        return method.offer(req, min(cap, room), accept_rate)

    def _controller(self, req: Request, method: SpecMethod) -> AdaptiveDraftLength:
        controllers = req.spec.controllers
        if method.name not in controllers:  # a new request starts from the engine-wide estimate
            controllers[method.name] = AdaptiveDraftLength(self.config.num_draft_tokens,
                                                           initial_accept_rate=method.accept_rate.rate)
        return controllers[method.name]

    def _allocate(self, priced: list[tuple[Request, Offer | None]], prefill_rows: int) -> None:
        offers = [o for _, o in priced]
        runs_model = [o is not None and o.method.keeps_kv for o in offers]
        setup = [self._catch_up_seconds(r, o) for r, o in priced] if any(runs_model) else None
        target = self.costs.step_target(len(priced), prefill_rows)
        ks = allocate_drafts([o.gains if o else [] for o in offers], target,
                             self.costs.draft if any(runs_model) else None, runs_model, setup)
        for (req, offer), k in zip(priced, ks):
            req.spec.offer = offer if k else None
            req.num_lookahead_tokens = k
            self._controller(req, req.spec.method).allocated(k)

    def _catch_up_seconds(self, req: Request, offer: Offer | None) -> float:
        """The extra draft time of req's first drafting step (the tokens its draft has not
        seen, past the 1-2 a caught-up draft feeds), per step it may still take: its room in
        max_tokens over the tokens a step emits at this acceptance and cap."""
        if offer is None or offer.num_catch_up_tokens <= 2:
            return 0.0
        room = max(req.params.max_tokens - req.num_output_tokens, 1)
        steps = max(room / (1 + sum(offer.gains)), 1.0)
        return (self.costs.draft(offer.num_catch_up_tokens) - self.costs.draft(1)) / steps

    def propose(self, scheduled: list[ScheduledSeq]) -> None:
        """Fill req.draft_token_ids (<= the lookahead slots reserved) for the scheduled decodes,
        one propose() call per method."""
        by_method: dict[str, list[ScheduledSeq]] = {}
        for s in scheduled:
            if s.num_lookahead_tokens:
                by_method.setdefault(s.req.spec.offer.method.name, []).append(s)
        for name, seqs in by_method.items():
            self.methods[name].propose([s.req for s in seqs], [s.num_lookahead_tokens for s in seqs])

    def record(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """A verification's outcome: the first num_accepted of num_drafted drafts were accepted."""
        method = req.spec.offer.method
        req.stats.spec.update(num_drafted, num_accepted)
        self.stats.update(num_drafted, num_accepted)
        method.accept_rate.update(num_drafted, num_accepted)
        if method.name in req.spec.controllers:
            req.spec.controllers[method.name].update(num_drafted, num_accepted)
