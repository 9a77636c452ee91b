"""SpecRunner: the engine's side of speculation. Each step it collects an offer per decoding
request from that request's methods (chatserve/spec_methods), splits the step's drafts over
the batch by measured costs (spec/adaptive.allocate_drafts), has the methods propose, and
records what verification accepted.

The method is per request (SamplingParams.spec_method, default: the engine's). Per-request
state lives on the request (req.spec, req.draft_token_ids, req.draft_probs), never here.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import torch

from chatserve.batch import BatchItem
from chatserve.config import SpecConfig
from chatserve.request import Request
from chatserve.sampler import Sampler
from chatserve.scheduler import ScheduledSeq
from chatserve.spec_costs import MAX_ROWS, ObservedForwards, SpecCosts, assumed_spec_costs, cached_spec_costs
from chatserve.spec_methods import SPEC_METHODS, Offer, SpecMethod, SpecState
from spec.adaptive import AdaptiveDraftLength, allocate_drafts, chain_stop_gains, step_seconds
from spec.stats import SpecStats

# With draft_catch_up "decode": a catch-up chunk may add this share to the time of a step
# (docs/benchmarks.md, "Long conversations"), and without measured costs it is this many tokens.
CATCH_UP_SHARE = 0.5
CATCH_UP_CHUNK = 64
# A step that drafts may cost at most this many times the typical step of each stream in it (the
# median price of its latest steps, or a plain step's before it has 3): a long free draft (up to
# num_free_draft_tokens rows) on a turn of short steps would otherwise hold one delta back for
# 4x its usual gap. Streams whose steps are long (edit sessions) grow into long drafts. Prices,
# not wall times: the cost table may be in units of a forward (assumed costs, tests).
GAP_LIMIT = 2.5
MIN_GAP_SAMPLES = 3
MIN_MADE_DRAFTS = 32  # drafts made before their acceptance prices how far a confident chain goes on


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
        self.stats_by_method = {name: SpecStats() for name in self.methods}  # engine-wide, per method
        self.gap_limit = GAP_LIMIT  # 0: a step's length is priced by tokens per second alone
        # True: a confident chain keeps a draft already computed at a row's price and goes on at a row
        # and a step over the made drafts' acceptance (chain_stop_gains). False, the default: one price
        # for both, session 44's rule; served on SmolLM2 code the two prices read 3-5% slower (requests in
        # turn, docs/benchmarks.md session 45), 1.00-1.03x with steps interleaved (session 47): one price
        # stays, the simpler rule; to be measured where rows are cheap (eagle_head.py --variant)
        self.keeps_computed_drafts = False
        self.costs = None
        self.costs_source = "none (fixed k)"  # where the cost table came from, for the start-up log
        if config.adaptive:
            measured, self.costs_source = cached_spec_costs(models, config.num_draft_tokens, max_num_seqs,
                                                            config.max_draft_tokens, config.costs_cache_dir)
            if measured is None:  # no scratch room in the pool: a linear model instead
                self.costs_source = "assumed (no scratch room in the KV pool to measure)"
                self.costs = assumed_spec_costs(MAX_ROWS, models.draft_runner is not None,
                                                models.eagle_runner is not None)
            else:
                self.costs = measured
                self._measured_costs = measured  # service's forwards correct it (observe_forward)

    @property
    def costs(self) -> SpecCosts | None:
        """What allocate_drafts prices a step with: None (adaptive k off), the start-up table as
        service's forwards correct it, the assumed linear model, or costs set by hand (a test, a
        replay), which are used as they are."""
        return self._costs

    @costs.setter
    def costs(self, costs: SpecCosts | None) -> None:
        self._costs, self._measured_costs, self._observed = costs, None, ObservedForwards(reshape=False, recent=True)
        # a draft position's forward as the methods whose drafts cost one time it (step_cost -> observer): two
        # engines of one 0.5B draft model timed its step at 16 and 27 ms at start-up (session 50)
        self.step_observers = {"head": ObservedForwards(table="head_seconds"),
                               "draft": ObservedForwards(table="draft_seconds")}

    def set_measured_costs(self, costs: SpecCosts) -> None:
        """Price with a start-up table measured elsewhere (a benchmark pairing engines on one table),
        which service's forwards then correct as they would this engine's own."""
        self.costs = costs
        self._measured_costs = costs

    @property
    def reshapes_table(self) -> bool:
        """False, the default: the target's start-up table keeps its shape, scaled by one ratio, the
        median of service's latest forwards over it (ObservedForwards without reshape; with
        prices_recent_rows the row counts among those forwards at their own median). True: each
        row count service saw costs the median of its own latest forwards (sessions 47-53); a count
        the allocation seldom buys then kept an old, dear price (SmolLM2 at batch 2: four rows in 36
        of 826 forwards, their newest a median 28 forwards old, priced +3.0-3.5 ms over three where
        the steps say ~+1.3). With the one ratio SmolLM2's EAGLE engine ran 1.001-1.041x, 8 of 8
        cells of two lockstep runs (docs/benchmarks.md session 54). A switch for such pairings."""
        return self._observed.reshape

    @reshapes_table.setter
    def reshapes_table(self, reshape: bool) -> None:
        self._observed.reshape = reshape

    @property
    def prices_recent_rows(self) -> bool:
        """With the one ratio: whether a row count seen at least 3 times among service's latest 27
        forwards costs their median instead of the start-up shape's price at the ratio (True, the
        default: the start-up shape is noise at ±0.5-1 ms a row here; on SmolLM2's EAGLE engine,
        both on one start-up table, 0.996-1.022x the one ratio alone on a clean table and
        1.009-1.024x on one that priced 3 rows as 2: docs/benchmarks.md session 55)."""
        return self._observed.recent

    @prices_recent_rows.setter
    def prices_recent_rows(self, recent: bool) -> None:
        self._observed.recent = recent

    @property
    def stats(self) -> SpecStats:
        """Engine-wide counts, all methods together."""
        total = SpecStats()
        for stats in self.stats_by_method.values():
            total.merge(stats)
        return total

    @classmethod
    def create(cls, config: SpecConfig, models, max_num_seqs: int = 16) -> "SpecRunner":
        return cls(config, models, Sampler(models.tokenizer.eos_token_ids), max_num_seqs)

    def init_request(self, req: Request) -> None:
        """Resolve req's method (Engine.check_params has checked it). A request with
        num_draft_tokens=0 never drafts: it gets no speculation state at all. A request whose
        drafts cost model steps (draft model, EAGLE head: a step_cost) may also take the free
        proposals of mixable methods (suffix decoding) when they promise more than its own."""
        if req.params.num_draft_tokens == 0:
            return
        method = self.methods[req.params.spec_method or self.config.method]
        mixed = tuple(m for m in self.methods.values() if method.step_cost and m.mixable and m is not method)
        req.spec = SpecState((method, *mixed))
        req.stats.spec_method = method.name

    def plan(self, running: list[Request], prefill_rows: int = 0, num_streams: int = 0) -> None:
        """Set req.num_lookahead_tokens (this step's k) for every running request that will
        decode next step, req.spec.offer (the method that drafts for it) and
        req.spec.num_catch_up_tokens (its draft model's catch-up this step, if any).

        The adaptive requests' k are chosen together (allocate_drafts): each offers what its
        best method can draft with that method's acceptance estimate, and the batch gets the
        drafts that maximize expected tokens per second of the whole step. A request that fixed
        num_draft_tokens, or any request when adaptive speculation is off, drafts its fixed k.

        With SpecConfig.confidence_stop, req.spec.keep_gain and least_gain are what keeping a draft
        and computing one more cost in tokens (spec.adaptive.chain_stop_gains; one price for both
        unless keeps_computed_drafts): an EAGLE chain keeps its drafts and goes on while the head's
        own probability of it stays above them, up to the priced k. (Given the whole cap instead
        whenever the pricing drafts at all, SmolLM2's chains drafted more and ran slower: session 44.)

        prefill_rows (prompt tokens this step also feeds the target) change what draft rows
        cost: the rows past them, not past the decodes alone (SpecCosts.step_target).
        A draft model drafts only once it has seen all but a step's worth of a request's tokens
        (_catch_up_budget); until then it catches up in chunks that keep the step short, when
        the drafts it will make are worth the catch-up (_is_worth_catching_up) at a batch of
        num_streams (at least every running request; the engine adds the waiting ones about to
        be admitted): a request still prefilling decodes beside it in a few steps (priced at the
        decodes alone, a request caught up while its neighbour's prompt went in, then the two
        never drafted: session 51), and the request drafts by its other methods meanwhile.
        """
        for req in running:
            req.num_lookahead_tokens = 0
            if req.spec is not None:
                req.spec.offer, req.spec.num_catch_up_tokens = None, 0
                req.spec.keep_gain = req.spec.least_gain = 0.0
        decodes = [r for r in running if r.spec is not None and not r.is_prefilling]
        budget = self._catch_up_budget(len(decodes))
        priced: list[tuple[Request, list[Offer | None]]] = []
        for req in decodes:
            if req.num_output_tokens == 0:
                continue
            # a fixed k gets fixed chunks too, so its drafts do not depend on timings either
            req_budget = budget if self._is_adaptive(req) or budget >= 1 << 30 else CATCH_UP_CHUNK
            offers = self._offers(req, req_budget)
            self._plan_catch_up(req, req_budget, max(num_streams, len(running)))
            if self._is_adaptive(req):
                priced.append((req, offers))
            else:
                req.spec.offer = _best(offers)
                req.num_lookahead_tokens = req.spec.offer.cap if req.spec.offer else 0
        if priced:
            self._allocate(priced, prefill_rows)

    def _is_adaptive(self, req: Request) -> bool:
        """Whether req's k is priced from measured costs. Not for a request that fixed
        num_draft_tokens, nor for a seeded one: every draft draws from the request's generator, so
        k chosen from timings would make the same seed give different text on every run."""
        return self.costs is not None and req.params.num_draft_tokens is None and req.params.seed is None

    def _offers(self, req: Request, budget: int) -> list[Offer | None]:
        """One offer per method of req (None: nothing to offer, or a draft model still behind
        by more than `budget` tokens), capped by each method's controller when adaptive."""
        # Never overshoot max_tokens or the context: k drafts emit up to k + 1 tokens.
        room = max(min(req.params.max_tokens - req.num_output_tokens - 1,
                       self.max_model_len - len(req.token_ids) - 1), 0)
        asked = req.params.num_draft_tokens
        max_k = self.config.num_draft_tokens if asked is None else min(asked, self.config.num_draft_tokens)
        offers = []
        for method in req.spec.methods:
            if method.keeps_kv and len(req.token_ids) - req.num_draft_computed_tokens > budget:
                offers.append(None)
                continue
            cap, accept_rate = min(max_k, room), method.accept_rate.rate
            if self._is_adaptive(req):
                cap, accept_rate = self._controller(req, method).offer(probe_accept_rate=accept_rate)
                cap = min(cap, room)
            offers.append(_within_grammar(req, method.offer(req, cap, accept_rate)) if cap else None)
        return offers

    def _controller(self, req: Request, method: SpecMethod) -> AdaptiveDraftLength:
        """req's adaptive state for `method`; its cap is num_free_draft_tokens for a method whose
        proposals run no model (their extra drafts cost verification rows, which the allocation
        prices), else num_draft_tokens."""
        controllers = req.spec.controllers
        if method.name not in controllers:  # a new request starts from the engine-wide estimate
            max_k = self.config.num_draft_tokens if method.step_cost else self.config.num_free_draft_tokens
            controllers[method.name] = AdaptiveDraftLength(max_k, method.accept_ema, probe_every=method.probe_every,
                                                           initial_accept_rate=method.accept_rate.rate)
        return controllers[method.name]

    def _allocate(self, priced: list[tuple[Request, list[Offer | None]]], prefill_rows: int) -> None:
        offers = [_best(o) for _, o in priced]
        runs_model = [o is not None and o.method.step_cost is not None for o in offers]
        has_catch_up = any(o is not None and o.method.keeps_kv for o in offers)
        setup = [self._catch_up_seconds(r, o) for (r, _), o in zip(priced, offers)] if has_catch_up else None
        target = self.costs.step_target(len(priced), prefill_rows)
        draft = self._draft_step_seconds(offers)
        ks = allocate_drafts([o.gains if o else [] for o in offers], target, draft, runs_model, setup,
                             self._max_step_seconds([r for r, _ in priced], target(len(priced))))
        ks = [self._probe_k(req, offer, k) for (req, _), offer, k in zip(priced, offers, ks)]
        price = step_seconds(ks, target, draft, runs_model, setup)
        for req, _ in priced:
            req.spec.recent_steps.append(price)
        stop_gains = self._stop_gains(offers, ks, target, draft, len(priced))
        for (req, _), offer, k in zip(priced, offers, ks):
            req.spec.offer = offer if k else None
            req.spec.keep_gain, req.spec.least_gain = stop_gains[offer.method] if k and stop_gains else (0.0, 0.0)
            req.num_lookahead_tokens = k
            for method in req.spec.methods:
                self._controller(req, method).allocated(k if offer is not None and offer.method is method else 0)

    def _stop_gains(self, offers: list[Offer | None], ks: list[int], target, draft,
                    num_seqs: int) -> dict[SpecMethod, tuple[float, float]]:
        """(keep_gain, least_gain) of this step's chains, once per drafting method (every request
        of the step shares the prices; only the made drafts' acceptance is the method's own): {}
        without SpecConfig.confidence_stop. Without keeps_computed_drafts both are one price, the
        go-on price of a chain whose next draft is sure to hold."""
        if not self.config.confidence_stop:
            return {}
        gains = {}
        for offer, k in zip(offers, ks):
            if k and offer.method not in gains:
                if self.keeps_computed_drafts:
                    gains[offer.method] = chain_stop_gains(target, draft, num_seqs, sum(ks),
                                                           self._made_accept_rate(offer.method))
                else:  # a chain stops before a draft worth less than a row and a step
                    least = chain_stop_gains(target, draft, num_seqs, sum(ks), 1.0)[1]
                    gains[offer.method] = (least, least)
        return gains

    def _made_accept_rate(self, method: SpecMethod) -> float:
        """The share of `method`'s drafts accepted so far, engine-wide (1.0 before MIN_MADE_DRAFTS):
        the chance that a draft made after a kept one is accepted, as chain_stop_gains asks."""
        stats = self.stats_by_method[method.name]
        if stats.num_draft_tokens < MIN_MADE_DRAFTS:
            return 1.0
        return stats.num_accepted_tokens / stats.num_draft_tokens

    def _max_step_seconds(self, reqs: list[Request], plain_seconds: float) -> float | None:
        """The dearest step these streams may take: gap_limit x the cheapest typical step among
        them (the median price of a stream's latest steps, or plain_seconds until it has
        MIN_GAP_SAMPLES)."""
        if not self.gap_limit:
            return None
        gaps = [statistics.median(r.spec.recent_steps) if len(r.spec.recent_steps) >= MIN_GAP_SAMPLES
                else plain_seconds for r in reqs]
        return self.gap_limit * min(gaps)

    def _draft_step_seconds(self, offers: list[Offer | None]):
        """rows -> seconds of one draft position's forward over that many sequences, for the
        methods whose drafts cost a forward each (a draft model, an EAGLE head); None when every
        offer is free. A batch drafting with both is priced at the dearer (a rare mix)."""
        kinds = {o.method.step_cost for o in offers if o is not None} - {None}
        if not kinds:
            return None
        if len(kinds) == 1:
            return functools.partial(self.costs.draft_step, kinds.pop())
        return lambda rows: max(self.costs.draft_step(kind, rows) for kind in kinds)

    def _probe_k(self, req: Request, offer: Offer | None, k: int) -> int:
        """k, or 1 for a free proposal whose controller probes and that the costs priced out.

        A probe is priced at the method's engine-wide rate, which the same requests' rejections
        keep low: priced out, it never ran, and a request whose first n-gram draft was rejected
        never drafted again (its estimate parked at 0.4 on the paste workload). One free draft
        every probe_every steps (n-gram, suffix; an EAGLE head's adds one head step) costs one
        verify row then, and lets the estimate move. A draft model's probe stays priced: it costs
        a draft forward, and its catch-up."""
        if k or offer is None or offer.method.keeps_kv or not self._controller(req, offer.method).probing:
            return k
        return 1

    def _catch_up_seconds(self, req: Request, offer: Offer | None) -> float:
        """The extra draft time of req's first drafting step (the tokens its draft has not
        seen, past the 1-2 a caught-up draft feeds), per step it may still take: its room in
        max_tokens over the tokens a step emits at this acceptance and cap."""
        if offer is None or offer.num_catch_up_tokens <= 2:
            return 0.0
        room = max(req.params.max_tokens - req.num_output_tokens, 1)
        steps = max(room / (1 + sum(offer.gains)), 1.0)
        return (self.costs.catch_up(offer.num_catch_up_tokens) - self.costs.draft(1)) / steps

    # -- the draft model's catch-up -------------------------------------------------------
    def _catch_up_budget(self, num_decodes: int) -> int:
        """Tokens a draft model may catch up on in one step: all of them for "whole"; else the
        largest measured chunk that adds at most CATCH_UP_SHARE to a step of these decodes, or
        when even the smallest chunk adds more, the largest that costs about what it does (a
        small draft's forward reads its weights whatever the rows: on the 0.5B, 32 and 64 rows
        both take 92 ms, so 64-token chunks catch up twice as fast for the same stall)."""
        if self.config.draft_catch_up == "whole":
            return 1 << 30
        if self.costs is None or not self.costs.catch_up_seconds:
            return CATCH_UP_CHUNK
        smallest = min(self.costs.catch_up_seconds)
        seconds = max(CATCH_UP_SHARE * self.costs.target(max(num_decodes, 1)), 1.1 * self.costs.catch_up(smallest))
        return self.costs.max_catch_up_rows(seconds)

    def _plan_catch_up(self, req: Request, budget: int, num_decodes: int) -> None:
        method, unseen = req.spec.kv_method, len(req.token_ids) - req.num_draft_computed_tokens
        if method and unseen > budget and self._is_worth_catching_up(req, method, unseen, budget, num_decodes):
            req.spec.num_catch_up_tokens = budget

    def _is_worth_catching_up(self, req: Request, method: SpecMethod, unseen: int, chunk: int,
                              num_decodes: int) -> bool:
        """Whether the drafts req may still make save more than catching up on `unseen` tokens
        in chunks costs. A step of b decodes takes T0 = target(b); drafting k more rows for req
        takes T = target(b + k) + k draft steps and adds sum(alpha^j) tokens, worth that many
        tokens at the plain rate T0 / b; over the steps left in max_tokens (room / tokens per
        step). Without measured costs (fixed k) a draft request always catches up."""
        if not self._is_adaptive(req):
            return True
        alpha = self._controller(req, method).accept_rate
        b, plain = max(num_decodes, 1), self.costs.target(max(num_decodes, 1))
        room = max(req.params.max_tokens - req.num_output_tokens, 1)
        saved = 0.0
        for k in range(1, self.config.num_draft_tokens + 1):
            extra = sum(alpha ** j for j in range(1, k + 1))
            per_step = extra * plain / b - (self.costs.target(b + k) + k * self.costs.draft(1) - plain)
            saved = max(saved, per_step * room / (1 + extra))
        return saved > -(-unseen // chunk) * self.costs.catch_up(chunk)

    def propose(self, scheduled: list[ScheduledSeq]) -> None:
        """Fill req.draft_token_ids (<= the lookahead slots reserved) for the scheduled decodes,
        one propose() call per method; draft-model catch-ups ride along with k = 0 (beside
        prefill chunks too, with draft_catch_up "prefill")."""
        work: dict[str, tuple[list[Request], list[int]]] = {}
        for s in scheduled:
            spec = s.req.spec
            if spec is None:
                continue
            if s.num_lookahead_tokens:
                reqs, ks = work.setdefault(spec.offer.method.name, ([], []))
                reqs.append(s.req)
                ks.append(s.num_lookahead_tokens)
            if not s.is_decode and self.config.draft_catch_up == "prefill":
                spec.num_catch_up_tokens = s.req.num_computed_tokens + s.num_new_tokens - s.req.num_draft_computed_tokens
            method = spec.kv_method
            if spec.num_catch_up_tokens > 0 and method and not (spec.offer and spec.offer.method is method):
                reqs, ks = work.setdefault(method.name, ([], []))
                reqs.append(s.req)
                ks.append(0)
        for name, (reqs, ks) in work.items():
            method = self.methods[name]
            timed = method.propose(reqs, ks)
            observer = self.step_observers.get(method.step_cost)
            if timed and observer is not None and self._measured_costs is not None:
                if any([observer.observe(rows, seconds) for rows, seconds in timed]):  # a list: each one observed
                    self._costs = self._corrected(observer)

    def observe_forward(self, rows: int, seconds: float) -> None:
        """A decode-only step's target forward over `rows` rows, with the verification and sampling
        of its rows, took `seconds`: measured costs follow what service's steps cost
        (spec_costs.ObservedForwards); assumed ones, in units of a forward rather than seconds,
        stay as they are."""
        if self._measured_costs is not None and self._observed.observe(rows, seconds):
            self._costs = self._corrected(self._observed)

    def _corrected(self, observer: ObservedForwards) -> SpecCosts:
        """The costs in use with observer's table corrected afresh from the start-up one (the
        other tables as their own observers left them), after an observation that moved a median
        (about half of them), or after each of the target's without reshapes_table, where the
        observer gives back the table in use until its ratio or recent medians move (RATIO_STEP):
        right after a forward a rebuild's few us of Python run on cold caches, ~60 us on SmolLM2's
        2-core VM."""
        table = observer.corrected_table(getattr(self._measured_costs, observer.table))
        if table is None or table is getattr(self._costs, observer.table):
            return self._costs
        return dataclasses.replace(self._costs, **{observer.table: table})

    @property
    def reads_features(self) -> bool:
        """Whether some method needs the target's features after every forward (observe)."""
        return any(m.reads_features for m in self.methods.values())

    def observe(self, scheduled: list[ScheduledSeq], items: list[BatchItem], features: torch.Tensor) -> None:
        """The step's target features (and items as fed) for the methods that read them: every
        scheduled request, whatever its own method, so that every block a request commits has
        what any method needs for it."""
        for method in self.methods.values():
            if method.reads_features:
                method.observe(scheduled, items, features)

    def finish(self, req: Request) -> None:
        for method in self.methods.values():
            method.finish(req)

    def abort(self, req: Request) -> None:
        """req is aborted and still holds its blocks: methods that read features write what they
        deferred for them."""
        for method in self.methods.values():
            if method.reads_features:
                method.release(req)

    def record(self, req: Request, num_drafted: int, num_accepted: int, num_offered: int | None = None) -> None:
        """A verification's outcome: the first num_accepted of num_drafted drafts were accepted, of
        num_offered positions the step priced (default num_drafted). The stats count drafts; the
        acceptance rates that price the next steps count positions, so a chain that stopped on
        its confidence (num_drafted < num_offered) counts as rejected where it stopped: the rate
        keeps meaning what the pricing assumes, the chance that a priced position is accepted
        (counted on the kept drafts alone it rose, the pricing gave more drafts, and the stopped
        chains ran more head steps for the same rows: session 44)."""
        method = req.spec.offer.method
        req.stats.spec.update(num_drafted, num_accepted)
        self.stats_by_method[method.name].update(num_drafted, num_accepted)
        num_offered = max(num_offered or 0, num_drafted)
        method.accept_rate.update(num_offered, num_accepted)
        if method.name in req.spec.controllers:
            req.spec.controllers[method.name].update(num_offered, num_accepted)


def _within_grammar(req: Request, offer: Offer | None) -> Offer | None:
    """A free proposal cut before the first token req's grammar refuses: that token's masked
    target probability is 0, so it would be rejected anyway, and the cut is a function of the
    context, so verification stays exact. Model drafts are masked as they are sampled instead."""
    if offer is None or offer.token_ids is None or req.grammar is None:
        return offer
    n = req.grammar.num_valid(offer.token_ids)
    return dataclasses.replace(offer, gains=offer.gains[:n], token_ids=offer.token_ids[:n]) if n else None


def _best(offers: list[Offer | None]) -> Offer | None:
    """The offer to price: a free proposal when it is expected to yield at least as much as the
    draft model's (same verification rows, no draft steps), else the draft model's. Between free
    ones (an EAGLE head's and a suffix proposal) the one that promises more, the first on a tie."""
    free = [o for o in offers if o is not None and not o.method.keeps_kv]
    model = [o for o in offers if o is not None and o.method.keeps_kv]
    best_free = max(free, key=lambda o: sum(o.gains), default=None)
    if model and (best_free is None or sum(best_free.gains) < sum(model[0].gains)):
        return model[0]
    return best_free
