"""Scheduler: waiting and running queues; picks each step's work under a token budget.

Iteration-level continuous batching: every step, running decodes go first (1 token, plus
k reserved lookahead slots when speculating), then running prefill chunks, then waiting
requests are admitted while blocks and the budget last. When the pool runs dry, the
youngest running request is preempted (blocks freed, recomputed later from its tokens).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from itertools import islice

from chatserve.block_manager import BlockManager
from chatserve.request import Request, Status


@dataclass
class ScheduledSeq:
    req: Request
    num_new_tokens: int  # tokens fed to the target: a prefill chunk, or 1 when decoding
    num_lookahead_tokens: int = 0  # slots reserved for drafts past the last token (decode only)

    @property
    def is_decode(self) -> bool:
        return self.req.num_computed_tokens + self.num_new_tokens == len(self.req.token_ids)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        decodes = [r for r in self.running if not r.is_prefilling]
        prefills = [r for r in self.running if r.is_prefilling]
        for req in decodes + prefills:
            if req.status != Status.RUNNING or budget <= 0:
                continue  # preempted earlier in this loop, or out of budget
            remaining = len(req.token_ids) - req.num_computed_tokens
            n = min(remaining, budget)
            k = min(req.num_lookahead_tokens, budget - n) if n == remaining == 1 else 0
            if not self._allocate_or_preempt(req, req.num_computed_tokens + n + k, scheduled):
                continue
            scheduled.append(ScheduledSeq(req, n, k))
            budget -= n + k
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not req.table.block_ids:
                cached = self.bm.match_prefix(req.table, req.token_ids)
                req.num_computed_tokens = cached
                req.num_draft_computed_tokens = self.bm.draft_kv_prefix(req.table)
                if req.stats.first_scheduled_time is None:
                    req.stats.cached_tokens = cached
            n = min(len(req.token_ids) - req.num_computed_tokens, budget)
            if not self.bm.allocate(req.table, req.num_computed_tokens + n):
                break  # admission waits for blocks; the cached prefix stays attached
            self.waiting.popleft()
            req.status = Status.RUNNING
            if req.stats.first_scheduled_time is None:
                req.stats.first_scheduled_time = time.perf_counter()
            self.running.append(req)
            scheduled.append(ScheduledSeq(req, n, 0))
            budget -= n
        return scheduled

    def prefill_tokens_next_step(self) -> int:
        """About how many prompt tokens the next schedule() feeds next to the decodes: running
        prefill chunks, then waiting requests while sequence slots last (prefix-cache hits not
        subtracted), within the token budget. Speculation prices drafts by it (SpecRunner.plan)."""
        num_decodes = sum(1 for r in self.running if not r.is_prefilling)
        pending = sum(len(r.token_ids) - r.num_computed_tokens for r in self.running if r.is_prefilling)
        free_slots = max(self.max_num_seqs - len(self.running), 0)
        pending += sum(len(r.token_ids) - r.num_computed_tokens for r in islice(self.waiting, free_slots))
        return min(pending, max(self.max_num_batched_tokens - num_decodes, 0))

    def _allocate_or_preempt(self, req: Request, num_tokens: int, scheduled: list[ScheduledSeq]) -> bool:
        """Grow req's table to num_tokens, preempting the youngest running requests if needed.
        False if req itself had to be preempted."""
        while not self.bm.allocate(req.table, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            scheduled[:] = [s for s in scheduled if s.req is not victim]
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Free req's blocks and requeue it at the front; it recomputes from its tokens."""
        self.running.remove(req)
        self.bm.free(req.table)
        req.num_computed_tokens = req.num_draft_computed_tokens = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request, reason: str) -> None:
        """Release everything req holds, whichever queue it is in."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self.bm.free(req.table)
        req.status = Status.FINISHED
        req.finish_reason = reason
