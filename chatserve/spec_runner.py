"""SpecRunner: the engine's side of speculation. Picks k per request, runs the proposers
(n-gram, and the draft model on the shared pool when one is loaded), and keeps the statistics.

The draft model writes its KV into the same block ids as the target (its own tensors), in
slots the scheduler reserved as lookahead, so drafting never allocates.

The method is per request (SamplingParams.spec_method, default: the engine's): with a draft
model loaded, a request may still ask for n-gram drafts, and then the draft model never sees
its tokens. Such a request has no draft KV, so it commits blocks without the draft-KV mark
and draft requests never attach them (BlockManager's module docstring has the rule).
"""

from __future__ import annotations

import time

import torch

from chatserve.batch import BatchItem
from chatserve.config import SpecConfig
from chatserve.request import Request
from chatserve.sampler import Sampler
from chatserve.spec_costs import MAX_ROWS, assumed_spec_costs, measure_spec_costs
from chatserve.scheduler import ScheduledSeq
from spec.adaptive import AcceptanceEMA, AdaptiveDraftLength, allocate_drafts
from spec.ngram import NgramProposer
from spec.sampling import exponential_noise, sample_from_probs
from spec.stats import SpecStats


class SpecRunner:
    def __init__(self, config: SpecConfig, models, sampler: Sampler, max_num_seqs: int = 16):
        self.config = config
        self.models = models
        self.sampler = sampler
        self.has_draft_model = config.method == "draft"
        self.ngram = NgramProposer(config.ngram_min, config.ngram_max, 16)  # any request may ask for it
        self.stats = SpecStats()
        self._draft_probs: dict[str, torch.Tensor] = {}
        self.draft_seconds = 0.0
        self.costs = None
        self._ngram_drafts: dict[str, list[int]] = {}  # request id -> the n-gram proposal plan() made
        # Acceptance over all requests, per method: the prior of a new request's estimate and of
        # its probes. (n-gram drafts on chat are mostly rejected; a fixed optimistic prior made
        # every new or probing request pay for drafts at batch sizes where only likely ones pay.)
        self.method_accept_rate = {"draft": AcceptanceEMA(ema=0.05, prior=0.8), "ngram": AcceptanceEMA(ema=0.05, prior=0.5)}
        if config.adaptive:
            self.costs = measure_spec_costs(models, config.num_draft_tokens, max_num_seqs, self.has_draft_model)
            if self.costs is None:  # no scratch room in the pool: a linear model instead
                self.costs = assumed_spec_costs(MAX_ROWS, self.has_draft_model)

    @classmethod
    def create(cls, config: SpecConfig, models, max_num_seqs: int = 16) -> "SpecRunner":
        return cls(config, models, Sampler(models.tokenizer.eos_token_ids), max_num_seqs)

    @property
    def methods(self) -> tuple[str, ...]:
        """The spec_method values requests may ask for; the first is the default."""
        return ("draft", "ngram") if self.has_draft_model else ("ngram",)

    def init_request(self, req: Request) -> None:
        """Resolve req's method (Engine.check_params has checked it) and its controller. A
        request with num_draft_tokens=0 never drafts, so it never runs the draft model."""
        method = req.params.spec_method or self.config.method
        assert method in self.methods, method
        req.stats.spec_method = method if req.params.num_draft_tokens != 0 else None
        req.use_draft_model = method == "draft" and req.params.num_draft_tokens != 0
        if not self.config.adaptive:
            return
        # The controller keeps this request's acceptance estimate; plan() prices the batch.
        prior = self.method_accept_rate[method].rate
        req.spec_controller = AdaptiveDraftLength(self.config.num_draft_tokens, initial_accept_rate=prior)

    def plan(self, running: list[Request], prefill_rows: int = 0) -> None:
        """Set req.num_draft_tokens (k) for every running request that will decode next step.

        The adaptive requests' k are chosen together (allocate_drafts): each offers its
        acceptance estimate and a cap (an n-gram request: the proposal it actually has, made
        here since lookup is free), and the batch gets the drafts that maximize expected tokens
        per second of the whole step. A request that fixed num_draft_tokens, or any request
        when adaptive speculation is off, drafts its fixed k.

        prefill_rows (prompt tokens this step also feeds the target) change what draft rows
        cost: the rows past them, not past the decodes alone (SpecCosts.step_target).
        A draft-model request whose draft has not seen its prompt yet (new, or every earlier
        step priced it out) must first catch up on all of it: that forward is a setup cost,
        amortized over the steps the request may still take (_catch_up_seconds). Otherwise
        short replies at batch sizes where drafting rarely pays would each buy a whole draft
        prefill for one probe.
        """
        self._ngram_drafts = {}
        offers: list[tuple[Request, int, float]] = []
        for req in running:
            req.num_draft_tokens = 0
            if req.is_prefilling or req.num_output_tokens == 0:
                continue
            # Never overshoot max_tokens or the context: k drafts emit up to k + 1 tokens.
            room = max(min(req.params.max_tokens - req.num_output_tokens - 1,
                           self.models.max_model_len - len(req.token_ids) - 1), 0)
            if req.spec_controller is None or req.params.num_draft_tokens is not None:
                asked = req.params.num_draft_tokens
                k = self.config.num_draft_tokens if asked is None else min(asked, self.config.num_draft_tokens)
                req.num_draft_tokens = min(k, room)
                continue
            cap, accept_rate = req.spec_controller.offer(probe_accept_rate=self.method_accept_rate[req.stats.spec_method].rate)
            cap = min(cap, room)
            if not req.use_draft_model and cap > 0:
                tokens = self.ngram.propose_one(req.token_ids, cap)
                self._ngram_drafts[req.request_id] = tokens
                cap = len(tokens)
            offers.append((req, cap, accept_rate))
        if not offers:
            return
        setup = [self._catch_up_seconds(r, cap, a) for r, cap, a in offers] if self.has_draft_model else None
        target = self.costs.step_target(len(offers), prefill_rows)
        ks = allocate_drafts([a for _, _, a in offers], [c for _, c, _ in offers], target,
                             self.costs.draft if self.has_draft_model else None,
                             [r.use_draft_model for r, _, _ in offers], setup)
        for (req, _, _), k in zip(offers, ks):
            req.num_draft_tokens = k
            req.spec_controller.allocated(k)

    def _catch_up_seconds(self, req: Request, cap: int, accept_rate: float) -> float:
        """The extra draft time of req's first drafting step (the tokens its draft has not
        seen, past the 1-2 a caught-up draft feeds), per step it may still take: its room in
        max_tokens over the tokens a step emits at this acceptance and cap."""
        unseen = len(req.token_ids) - req.num_draft_computed_tokens
        if not req.use_draft_model or unseen <= 2 or cap == 0:
            return 0.0
        room = max(req.params.max_tokens - req.num_output_tokens, 1)
        tokens_per_step = sum(accept_rate ** j for j in range(cap + 1))
        steps = max(room / tokens_per_step, 1.0)
        return (self.costs.draft(unseen) - self.costs.draft(1)) / steps

    def propose(self, seqs: list[ScheduledSeq]) -> None:
        """Fill req.draft_token_ids (<= num_draft_tokens each) for the scheduled decodes."""
        by_ngram = [s for s in seqs if not s.req.use_draft_model]
        by_draft = [s for s in seqs if s.req.use_draft_model]
        planned = [s for s in by_ngram if s.req.request_id in self._ngram_drafts]
        for s in planned:
            s.req.draft_token_ids = self._ngram_drafts[s.req.request_id][: s.num_draft_tokens]
        unplanned = [s for s in by_ngram if s.req.request_id not in self._ngram_drafts]
        if unplanned:
            draft = self.ngram.propose([s.req.token_ids for s in unplanned], [s.num_draft_tokens for s in unplanned])
            for s, tokens in zip(unplanned, draft.token_ids):
                s.req.draft_token_ids = list(tokens)
        if by_draft:
            start = time.perf_counter()
            self._propose_with_draft_model([s.req for s in by_draft], [s.num_draft_tokens for s in by_draft])
            self.draft_seconds += time.perf_counter() - start

    def _propose_with_draft_model(self, reqs: list[Request], ks: list[int]) -> None:
        """Catch the draft up on the tokens it has not seen, then draft k tokens one by one."""
        runner = self.models.draft_runner
        items = [BatchItem(r.token_ids[r.num_draft_computed_tokens :], r.num_draft_computed_tokens, r.table.block_ids, 1) for r in reqs]
        probs_per_req: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
        active = list(range(len(reqs)))
        while active:
            logits, _ = runner.run(items)  # [len(active), vocab]
            next_active, next_items = [], []
            for row, i in enumerate(active):
                req = reqs[i]
                req.num_draft_computed_tokens = items[row].start_pos + len(items[row].token_ids)
                token, probs = self._draft_one(req, logits[row : row + 1])
                req.draft_token_ids.append(token)
                if probs is not None:
                    probs_per_req[req.request_id].append(probs)
                if len(req.draft_token_ids) < ks[i]:
                    pos = len(req.token_ids) + len(req.draft_token_ids) - 1
                    next_active.append(i)
                    next_items.append(BatchItem([token], pos, req.table.block_ids, 1))
            active, items = next_active, next_items
        for r in reqs:
            rows = probs_per_req[r.request_id]
            self._draft_probs[r.request_id] = torch.cat(rows) if rows else None

    def _draft_one(self, req: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """logits [1, vocab] -> (draft token, its distribution [1, vocab] or None if greedy)."""
        if req.params.is_greedy:
            return int(logits[0].argmax()), None
        probs = self.sampler.probs(req, logits)
        noise = exponential_noise(1, probs.shape[1], [req.generator])
        return int(sample_from_probs(probs, noise)[0]), probs

    def draft_probs(self, req: Request) -> torch.Tensor | None:
        return self._draft_probs.pop(req.request_id, None)

    def record(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        st = req.stats
        st.num_drafted += num_drafted
        st.num_accepted += num_accepted
        st.num_spec_steps += 1
        if len(st.accepted_by_position) < num_drafted:
            st.accepted_by_position += [0] * (num_drafted - len(st.accepted_by_position))
        for i in range(num_accepted):
            st.accepted_by_position[i] += 1
        self.stats.update(num_drafted, num_accepted)
        if req.stats.spec_method in self.method_accept_rate:
            self.method_accept_rate[req.stats.spec_method].update(num_drafted, num_accepted)
        if req.spec_controller is not None:
            req.spec_controller.update(num_drafted, num_accepted)
