"""A small draft model as a speculation method. It shares the target's paged pool: its KV
lives in the same block ids (its own tensors), in slots the scheduler reserved as lookahead,
so drafting never allocates. Before its first draft for a request it must see every token
it has not seen yet (the catch-up); req.num_draft_computed_tokens counts what it has seen.
SpecRunner decides when and in what chunks it catches up (SpecConfig.draft_catch_up).
"""

from __future__ import annotations

import time

import torch

from chatserve.batch import BatchItem
from chatserve.config import SpecConfig
from chatserve.request import Request
from chatserve.spec_methods.base import Offer, sample_draft
from spec.adaptive import PROBE_EVERY, AcceptanceEMA, geometric_gains


class DraftModelMethod:
    name = "draft"
    label = "draft model"
    mixable = False
    keeps_kv = True
    step_cost = "draft"
    probe_every = PROBE_EVERY
    # A request's acceptance of the draft model is a level, as the EAGLE head's (chatserve/spec_methods/
    # eagle.py): Qwen 1.5B verifying the 0.5B at k = 4, 2.92 / 1.93 accepted after a full / a poor step,
    # 2.86 / 2.03 sixteen steps later; the estimate's Brier 0.1382 at 0.05 against 0.1411 at 0.2 (slope
    # 0.94 against 0.66). Served, 0.05 over 0.2: 0.996 / 1.026 / 1.030 / 1.001 (code b1, b2, chat b1,
    # b2; docs/benchmarks.md, session 49).
    accept_ema = 0.05
    reads_features = False

    def __init__(self, runner, sampler):
        self.runner = runner
        self.sampler = sampler
        self.accept_rate = AcceptanceEMA(ema=0.05, prior=0.8)

    @classmethod
    def create(cls, config: SpecConfig, models, sampler) -> DraftModelMethod | None:
        return cls(models.draft_runner, sampler) if models.draft_runner is not None else None

    def offer(self, req: Request, cap: int, accept_rate: float) -> Offer | None:
        if cap == 0:
            return None
        unseen = len(req.token_ids) - req.num_draft_computed_tokens
        return Offer(self, geometric_gains(accept_rate, cap), num_catch_up_tokens=unseen)

    def propose(self, reqs: list[Request], ks: list[int]) -> list[tuple[int, float]]:
        """Catch the draft up on the tokens it has not seen, then draft k tokens one by one;
        every request's step s is one forward over the requests still drafting. A request
        with k = 0 only catches up, on its next req.spec.num_catch_up_tokens tokens, in the
        first of those forwards (one pass over the weights for both kinds).

        Returns (sequences drafting, seconds) of each forward that only drafts (every row draws a
        draft and feeds at most two tokens, as a caught-up draft does), sampling included: what
        one draft position costs as served, which the start-up table's draft_seconds follow."""
        items = []
        for req, k in zip(reqs, ks):
            start = req.num_draft_computed_tokens
            end = len(req.token_ids) if k else start + req.spec.num_catch_up_tokens
            items.append(BatchItem(req.token_ids[start:end], start, req.table.block_ids, 1 if k else 0))
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        active, timed = list(range(len(reqs))), []
        while active:
            start = time.perf_counter()
            is_plain = all(ks[i] for i in active) and all(len(item.token_ids) <= 2 for item in items)
            logits, cu_logits = self.runner.run(items)  # [drafting rows, vocab]
            next_active, next_items = [], []
            for row, i in enumerate(active):
                req = reqs[i]
                req.num_draft_computed_tokens = items[row].start_pos + len(items[row].token_ids)
                if not ks[i]:
                    continue
                token, token_probs = sample_draft(self.sampler, req, logits[cu_logits[row] : cu_logits[row] + 1])
                req.draft_token_ids.append(token)
                if token_probs is not None:
                    probs[i].append(token_probs)
                if len(req.draft_token_ids) < ks[i]:
                    pos = len(req.token_ids) + len(req.draft_token_ids) - 1
                    next_active.append(i)
                    next_items.append(BatchItem([token], pos, req.table.block_ids, 1))
            if is_plain:
                timed.append((len(active), time.perf_counter() - start))
            active, items = next_active, next_items
        for req, rows in zip(reqs, probs):
            req.draft_probs = torch.cat(rows) if rows else None  # [k, vocab]
        return timed

    def finish(self, req: Request) -> None:
        pass
