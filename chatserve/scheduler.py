"""Scheduler: waiting and running queues; picks each step's work under a token budget.

Iteration-level continuous batching: every step, running decodes go first (1 token, plus
k reserved lookahead slots when speculating), then prompt chunks, shortest remaining prompt
first, of running requests and of waiting ones admitted while slots, blocks and the budget last. When the pool runs dry, the
youngest running request is preempted (blocks freed, recomputed later from its tokens).

Prompt tokens fed beside running decodes have their own budget (Sarathi-Serve's stall-free
batching): from the measured cost of a decode-only step and of one prompt token, a step that
carries both is sized to take at most `stall_limit` decode steps, so a long prompt arriving
mid-stream slows the other streams instead of freezing them for a 512-token chunk.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from itertools import islice

from chatserve.block_manager import BlockManager
from chatserve.request import Request, Status


class StepCosts:
    """What a step costs, measured by the engine: an EMA of the seconds of a step that feeds
    only decodes, and of the seconds each prompt token adds beside them. A decode-only estimate
    older than REFRESH mixed steps is stale (contexts and batches grow): the scheduler then runs
    one decode-only step to measure it again."""

    REFRESH = 16

    def __init__(self, alpha: float = 0.25):
        self.alpha = alpha
        self.decode_s: float | None = None
        self.prompt_token_s: float | None = None
        self.mixed_steps = 0  # steps with decodes and prompt tokens since the last decode-only one

    @property
    def decode_stale(self) -> bool:
        return self.decode_s is None or self.mixed_steps >= self.REFRESH

    def observe(self, seconds: float, num_prompt_tokens: int, num_decodes: int) -> None:
        if num_prompt_tokens == 0:
            if num_decodes:
                self.decode_s = self._ema(self.decode_s, seconds)
                self.mixed_steps = 0
            return
        if num_decodes:
            self.mixed_steps += 1
            if self.decode_s is None:
                return  # cannot split this step's time between its decodes and its prompt tokens
        base = self.decode_s if num_decodes else 0.0
        self.prompt_token_s = self._ema(self.prompt_token_s, max(seconds - base, 0.0) / num_prompt_tokens)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)


@dataclass
class ScheduledSeq:
    req: Request
    num_new_tokens: int  # tokens fed to the target: a prefill chunk, or 1 when decoding
    num_lookahead_tokens: int = 0  # slots reserved for drafts past the last token (decode only)

    @property
    def is_decode(self) -> bool:
        return self.req.num_computed_tokens + self.num_new_tokens == len(self.req.token_ids)


class Scheduler:
    MIN_PROMPT_CHUNK = 8  # beside decodes a prompt still advances this much per step

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 stall_limit: float = 0.0):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stall_limit = stall_limit  # 0: prompt tokens take whatever the token budget leaves
        self.costs = StepCosts()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def prompt_budget(self, has_decodes: bool) -> int:
        """Prompt tokens one step may feed: the token budget, or beside running decodes as many
        as fit in (stall_limit - 1) decode steps at the measured cost per prompt token; none
        while the decode-only cost is unmeasured or stale (that step measures it)."""
        c = self.costs
        if not has_decodes or self.stall_limit <= 0:
            return self.max_num_batched_tokens
        if c.decode_stale:
            return 0
        if not c.prompt_token_s:
            return self.MIN_PROMPT_CHUNK
        n = int((self.stall_limit - 1.0) * c.decode_s / c.prompt_token_s)
        return max(self.MIN_PROMPT_CHUNK, min(n, self.max_num_batched_tokens))

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        decodes = [r for r in self.running if not r.is_prefilling]
        for req in decodes:
            if req.status != Status.RUNNING or budget <= 0:
                continue  # preempted earlier in this loop, or out of budget
            n = req.num_uncomputed_tokens  # 1
            k = min(req.num_lookahead_tokens, budget - n)
            if self._allocate_or_preempt(req, req.num_computed_tokens + n + k, scheduled):
                scheduled.append(ScheduledSeq(req, n, k))
                budget -= n + k
        # Prompt work, shortest first, running chunks and admissions alike: a follow-up turn over
        # a cached prefix answers in a step or two instead of queueing behind another's long paste.
        prompt_budget = min(budget, self.prompt_budget(bool(decodes)))
        stream_budget = self.prompt_budget(True)
        prefills = [r for r in self.running if r.is_prefilling]
        arrivals = [self._attach_cached_prefix(r) for r in self._admissible()]
        admitting = True
        for req in sorted(prefills + arrivals, key=lambda r: r.num_uncomputed_tokens):
            if prompt_budget <= 0:
                break
            n = min(req.num_uncomputed_tokens, prompt_budget)
            if req in prefills:
                if req.status != Status.RUNNING:  # preempted by a chunk scheduled before it
                    continue
                if not self._allocate_or_preempt(req, req.num_computed_tokens + n, scheduled):
                    continue
            else:
                if not admitting or len(self.running) >= self.max_num_seqs:
                    continue
                if not self.bm.allocate(req.table, req.num_computed_tokens + n):
                    admitting = False  # admission waits for blocks; the cached prefix stays attached
                    continue
                self._admit(req)
            scheduled.append(ScheduledSeq(req, n, 0))
            prompt_budget -= n
            if n == req.num_uncomputed_tokens and not decodes:
                # its first token ends this step: the prompts after it must not hold it up either
                prompt_budget = min(prompt_budget, stream_budget)
        return scheduled

    def _admissible(self) -> list[Request]:
        """The first waiting requests that wait for no sibling's prompt, as many as sequence slots are free."""
        free_slots = max(self.max_num_seqs - len(self.running), 0)
        return list(islice((r for r in self.waiting if not _waits_for_prompt_source(r)), free_slots))

    def _attach_cached_prefix(self, req: Request) -> Request:
        """A waiting request's first look at the prefix cache (again after a preemption)."""
        if not req.table.block_ids:
            cached = self.bm.match_prefix(req.table, req.token_ids)
            req.num_computed_tokens = cached
            req.num_draft_computed_tokens = self.bm.draft_kv_prefix(req.table)
            if req.stats.first_scheduled_time is None:
                req.stats.cached_tokens = cached
        return req

    def _admit(self, req: Request) -> None:
        self.waiting.remove(req)
        req.status = Status.RUNNING
        if req.stats.first_scheduled_time is None:
            req.stats.first_scheduled_time = time.perf_counter()
        self.running.append(req)

    def num_streams_next_step(self) -> int:
        """The running requests and the waiting ones admissible while sequence slots last: the
        batch that the running decodes will share once the new prompts are in."""
        return len(self.running) + len(self._admissible())

    def prefill_tokens_next_step(self) -> int:
        """About how many prompt tokens the next schedule() feeds next to the decodes: running
        prefill chunks, then waiting requests while sequence slots last (prefix-cache hits not
        subtracted), within the token and prompt budgets. Speculation prices drafts by it
        (SpecRunner.plan)."""
        num_decodes = sum(1 for r in self.running if not r.is_prefilling)
        pending = sum(r.num_uncomputed_tokens for r in self.running if r.is_prefilling)
        pending += sum(r.num_uncomputed_tokens for r in self._admissible())
        return min(pending, max(self.max_num_batched_tokens - num_decodes, 0), self.prompt_budget(num_decodes > 0))

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


def _waits_for_prompt_source(req: Request) -> bool:
    """True while req.prompt_source is queued or still computing the prompt; then the link is
    dropped, so a source preempted later (or finished) holds nobody up."""
    source = req.prompt_source
    if source is not None and (source.status == Status.WAITING or
                               (source.status == Status.RUNNING and source.is_prefilling)):
        return True
    req.prompt_source = None
    return False
