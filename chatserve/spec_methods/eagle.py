"""An EAGLE head as a speculation method (chatserve/models/eagle_head.py): one decoder layer
on the target's features drafts k tokens in a chain, each step a forward of that one layer.

Its KV follows the target's, so it has nothing to catch up on and needs no draft-KV marks:

    head row i = fc([f_{i-1}; embed(t_i)])   computable once the target has computed position i - 1

    [0, num_computed_tokens)        head KV valid, or deferred: observe() takes, after every target
                                    forward (of every request, whatever its method), the rows of the
                                    positions the target just computed, from their features
    [num_computed_tokens, +k)       written by propose() from its own predicted features and
                                    drafts; the next rows written there overwrite them with true ones

So a committed block has valid head KV too (it is a function of the block's tokens and prefix,
like the target's), and rollback is the target's integer: nothing of the head to undo.
Design choices:
- observe() runs after the step's tokens are appended, because row i needs t_i: the last row of
  a step is the token just sampled. The blocks of a request that finished in that step were
  released already; the engine hands over the block ids as scheduled, and nothing allocates
  before observe() writes them (a committed block among them must get its head rows before any
  request can attach it).
- A decode step's rows are deferred (req.head_pending), not written at once: they join the first
  forward of the request's next drafting step (propose feeds them before its newest token, one
  forward where there were two: on SmolLM2 a head forward costs about as much for 1 row as for
  16), or are written with the step's other rows once FLUSH_ROWS wait or the request
  finishes, or by release() when it is aborted. Prompt chunks are written at once: a block of a shared
  system prompt may be attached by another request in the next step. A block committed with
  deferred rows that another request attaches before they are written (the same reply prefix
  in two requests at once; a preempted request) gives that request's head stale rows there:
  fewer accepted drafts, never other output (verification decides).
- Row i needs f_{i-1}, a feature of the previous step: each request keeps its last one
  (req.last_feature). A request that starts from the prefix cache at position p (a block
  boundary) reads f_{p-1} from the pool's per-block feature (HeadRunner.block_features),
  written for every block's last position.
- Drafts run in a chain, k forwards for k drafts over all drafting requests (no tree: issue
  #14 asks for one only if it measurably pays on 2 cores). The first feeds the request's
  deferred rows and last token with its last feature, each next one the draft just made with
  the head's predicted feature. At T > 0 a draft is sampled from the head's distribution (the
  request's temperature / top-k / top-p, over the head's trimmed vocabulary: 0 elsewhere),
  which rejection sampling is given: lossless for any draft distribution. An adaptive chain
  keeps its drafts and goes on while the head's own probability of it pays for them
  (SpecState.keep_gain, least_gain): k is then a cap, and a sure stretch drafts to it while a
  guess stops.
- No catch-up (keeps_kv False), but each draft position costs a head step: measured at start
  with the target's forwards (SpecCosts.head), corrected by the steps propose times, and priced
  by adaptive k as a draft model's are.
"""

from __future__ import annotations

import time

import torch

from chatserve.batch import BatchItem
from chatserve.config import SpecConfig
from chatserve.request import Request, Status
from chatserve.scheduler import ScheduledSeq
from chatserve.spec_methods.base import Offer, sample_draft
from spec.adaptive import PROBE_EVERY, AcceptanceEMA, geometric_gains, stop_probability
from spec.sampling import argmax_rows

FLUSH_ROWS = 16  # deferred head rows of a request that does not draft are written at this many


class EagleMethod:
    name = "eagle"
    label = "EAGLE head"
    keeps_kv = False  # its KV follows the target's: no catch-up, no marks
    step_cost = "head"
    probe_every = PROBE_EVERY
    # A request's estimate weighs a step's outcome at 0.05, not the default 0.2: a head's acceptance is a
    # request's level more than a streak (SmolLM2's head, k = 1 on 16 held-out replies: a draft after an
    # accepted one 0.54, after a rejected one 0.37, and the same 16 steps apart), so the faster average
    # over-reacts (its estimates' slope against outcomes 0.55, 0.86 at 0.05; Brier 0.242 against 0.230) and
    # prices requests out on a rejection or two. Served, two runs did not agree (0.05 over 0.2: +0.5-4% on
    # code and chat, then -2.4-+1.5%; -2-+2% on pasted files): the calibration decided (docs/benchmarks.md,
    # session 48).
    accept_ema = 0.05
    reads_features = True
    mixable = False

    def __init__(self, runner, sampler):
        self.runner = runner  # chatserve.model_runner.HeadRunner
        self.kept_ids: list[int] = runner.head.head_token_ids.tolist()  # a kept_logits column's token id
        self.sampler = sampler
        self.accept_rate = AcceptanceEMA(ema=0.05, prior=0.7)
        self.chain_in_cpp = True  # greedy chains in one C++ call where the head has the path (False: the modules)
        self.flush_rows = FLUSH_ROWS  # a benchmark variant may change it (eagle.flush_rows=64)
        # a greedy chain's probability P is read as P ** power: 1.0, or with SpecConfig.calibrated_stop the head's
        # fit at T = 0 (train_head.fit_stop_power; a head trained on soft targets is underconfident there)
        self.greedy_stop_power = 1.0

    @classmethod
    def create(cls, config: SpecConfig, models, sampler) -> EagleMethod | None:
        if models.eagle_runner is None:
            return None
        method = cls(models.eagle_runner, sampler)
        if config.calibrated_stop:
            info = getattr(models.eagle_runner.head, "info", None) or {}
            method.greedy_stop_power = float(info.get("greedy_stop_power", 1.0))
        return method

    def offer(self, req: Request, cap: int, accept_rate: float) -> Offer | None:
        if cap == 0 or not self._has_last_feature(req):
            return None
        return Offer(self, geometric_gains(accept_rate, cap))

    def _has_last_feature(self, req: Request) -> bool:
        return req.last_feature is not None and req.last_feature[0] == req.num_computed_tokens - 1

    def observe(self, scheduled: list[ScheduledSeq], items: list[BatchItem], features: torch.Tensor) -> None:
        """Take the head's rows for the positions the target computed this step: request r fed
        positions [start, start + q_len) and now has num_computed_tokens = end (rejected drafts
        excluded), so its rows [start, end) take f_{start-1} (kept from before), then the
        features of positions [start, end - 1), and tokens t_start .. t_{end-1}. A running
        decode's rows wait for its next drafting step (req.head_pending); the rest are written now, in
        one head forward over all requests, no logits. features: the target runner's raw ones.

        The head's input f of a raw feature (its input_features(): an EAGLE-3 head's fuse, whose
        weights a step reads cold, ~0.17 ms of a SmolLM2 step) is made where it is read: here for the
        rows written now and the blocks' last rows (the prefix cache's), in one call; a decode's
        deferred rows and its last feature stay raw until it drafts (propose) or its rows are written.
        A step in which nothing is written, drafted or completes a block makes none."""
        raw_rows, made_first, head_items, block_ids, block_rows, row = [], [], [], [], [], 0
        block_size = self.runner.block_size
        for s, item in zip(scheduled, items):
            req, start, end = s.req, item.start_pos, s.req.num_computed_tokens
            fed = features[row : row + len(item.token_ids)]  # [q_len, width]: raw f_start, f_start+1, ...
            row += len(item.token_ids)
            own = req.last_feature is not None and req.last_feature[0] == start - 1
            # rows' inputs: raw when f_{start-1} is the request's own (kept raw), else it comes made
            # (zeros at position 0, a cached block's) and this request's rows are made and written now
            before = req.last_feature[1] if own else None  # [1, width]
            req.last_feature = (end - 1, fed[end - start - 1 : end - start].clone())
            for pos in range(start + block_size - 1 - start % block_size, end, block_size):  # blocks' last rows
                block_ids.append(item.block_ids[pos // block_size])
                block_rows.append(fed[pos - start : pos - start + 1])
            if own:
                # a plain decode step's one row is f_{start-1} itself: a chunk kept as it is, joined
                # when written (a step of ~4 fewer small tensor ops, ~10 us each on cold caches); the
                # step's features are copied, as the next forward's may reuse their memory
                start, n, chunks = self._with_pending(req, start, [before] if end - start == 1 else
                                                      [before, fed[: end - start - 1].clone()], end - start)
                if s.is_decode and req.status is Status.RUNNING and n < self.flush_rows:
                    req.head_pending = (start, n, chunks)
                    continue
                rows = _joined(chunks)
            else:
                req.head_pending = None  # rows that do not end here are dropped unwritten (_take_pending)
                rows = fed[: end - start - 1]
                made_first.append((len(head_items), self._made_before(start, item.block_ids)))
            head_items.append(BatchItem(req.token_ids[start:end], start, item.block_ids, 0))
            raw_rows.append(rows)
        every = block_rows + raw_rows
        if not every:
            return
        made = self.runner.input_features(torch.cat(every)).split([len(r) for r in every])
        for block_id, f in zip(block_ids, made):
            self.runner.block_features[block_id] = f[0]
        inputs = list(made[len(block_ids) :])
        for i, before in made_first:  # a made f_{start-1} first
            inputs[i] = torch.cat([before, inputs[i]])
        if head_items:
            self.runner.run(head_items, torch.cat(inputs))

    def _take_pending(self, req: Request, end: int) -> tuple[int, int, list[torch.Tensor]] | None:
        """req's deferred rows (start, n, raw feature chunks), taken off the request, when they end at
        `end`; None when there are none or they do not (the request was preempted and starts over: they
        are dropped unwritten)."""
        pending, req.head_pending = req.head_pending, None
        return pending if pending is not None and pending[0] + pending[1] == end else None

    def _with_pending(self, req: Request, start: int, chunks: list[torch.Tensor],
                      n: int) -> tuple[int, int, list[torch.Tensor]]:
        """(start, n, chunks): n rows from `start` in `chunks`, with req's deferred rows before them
        when those end at `start`."""
        pending = self._take_pending(req, start)
        return (start, n, chunks) if pending is None else (pending[0], pending[1] + n, pending[2] + chunks)

    def release(self, req: Request) -> None:
        """req is aborted while it still holds its blocks: write its deferred rows (a finishing
        request's are written by the step's observe())."""
        pending = self._take_pending(req, req.num_computed_tokens)
        if pending is not None:
            start, n, chunks = pending
            self.runner.run([BatchItem(req.token_ids[start : start + n], start, req.table.block_ids, 0)],
                            self.runner.input_features(_joined(chunks)))

    def _made_before(self, start: int, block_ids: list[int]) -> torch.Tensor:
        """The head's input f_{start-1} as [1, hidden] where it is not the request's own (observe
        takes that raw): zeros at position 0, or, starting from the prefix cache at a block
        boundary, the cached block's last feature."""
        features = self.runner.block_features
        if start == 0:
            return features.new_zeros(1, features.shape[1])
        assert start % self.runner.block_size == 0, "no feature for the position before a step"
        return features[block_ids[start // self.runner.block_size - 1]][None]

    def propose(self, reqs: list[Request], ks: list[int]) -> list[tuple[int, float]]:
        """Draft up to ks[i] tokens for reqs[i] in a chain: forward s feeds each still-drafting
        request's newest token at its position with the feature before it (the target's last one,
        then the head's own prediction) and drafts from the head's logits for the next position.
        A chain keeps each draft computed while the head's probability of the whole chain (the
        product of each position's softmax probability of the head's argmax) is at least
        req.spec.keep_gain, and computes the next one while it is at least req.spec.least_gain
        (SpecRunner prices both as what one more draft costs in tokens, a row and a head step, or
        with keeps_computed_drafts a row alone to keep: spec.adaptive.chain_stop_gains). SmolLM2's head was
        well calibrated (docs/benchmarks.md session 44: greedy drafts it gives ~0.3 are accepted
        ~0.3 of the time, ~0.96 ~0.95; at T = 0.7 the same probability predicts a sampled draft's
        acceptance sum_x min(p, q)); Qwen's is underconfident at T = 0, and a greedy chain's stop
        may read P through the head's fitted power (_stop_below). So this keeps the sure drafts of a
        long chain and drops the guesses. The stop reads the head alone, never the target: any
        number of drafts so chosen keeps verification lossless.

        Returns each draft position's (requests drafting, seconds): the head's forward, norm and
        kept logits with the drafting glue of its rows, what SpecRunner prices a position at."""
        items, inputs = [], []
        for req in reqs:
            assert self._has_last_feature(req), "offer() checked it"
            pos = req.num_computed_tokens  # the last token's position: not fed to the target yet
            start, _, chunks = self._with_pending(req, pos, [req.last_feature[1]], 1)  # deferred rows first
            items.append(BatchItem(req.token_ids[start : pos + 1], start, req.table.block_ids, 1))
            inputs += chunks
        keep_below = [self._stop_below(req, req.spec.keep_gain) for req in reqs]
        go_on_below = [self._stop_below(req, req.spec.least_gain) for req in reqs]
        features = self.runner.input_features(torch.cat(inputs))  # [rows, hidden]: the rows' f, made here
        if self.chain_in_cpp and all(req.params.is_greedy and req.grammar is None for req in reqs):
            chained = self.runner.greedy_chain(items, features, ks, keep_below, go_on_below)
            if chained is not None:  # the loop below in one C++ call (this loop is its reference)
                drafts, timed = chained
                for req, tokens in zip(reqs, drafts):
                    req.draft_token_ids.extend(tokens)
                    req.draft_probs = None
                return timed
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        chain_probs = [1.0] * len(reqs)
        active = list(range(len(reqs)))
        last_rows = torch.tensor([len(it.token_ids) for it in items]).cumsum(0) - 1  # each item's newest row
        head, timed = self.runner.head, []
        while active:
            start = time.perf_counter()
            out = self.runner.run(items, features)
            predicted = head.norm(out if last_rows is None else out[last_rows])  # [drafting, hidden]
            last_rows = None
            kept = head.kept_logits(predicted).cpu()  # [drafting, num_kept], on the host as the target's
            best = argmax_rows(kept).tolist()
            sure = _top_probs(kept) if any(keep_below[i] or go_on_below[i] for i in active) else None
            next_active, next_items, next_rows = [], [], []
            for row, i in enumerate(active):
                req = reqs[i]
                if sure is not None:
                    chain_probs[i] *= sure[row]
                    if chain_probs[i] < keep_below[i]:
                        continue
                if req.grammar is None:  # over the head's vocabulary: no [vocab] row of logits to build
                    token, token_probs = self._draft_over_kept(req, kept[row : row + 1], best[row])
                else:
                    token, token_probs = sample_draft(self.sampler, req, head.over_vocab(kept[row : row + 1]))
                req.draft_token_ids.append(token)
                if token_probs is not None:
                    probs[i].append(token_probs)
                if len(req.draft_token_ids) < ks[i] and chain_probs[i] >= go_on_below[i]:
                    next_active.append(i)
                    position = items[row].start_pos + len(items[row].token_ids)
                    next_items.append(BatchItem([token], position, req.table.block_ids, 1))
                    next_rows.append(row)
            timed.append((len(active), time.perf_counter() - start))
            active, items, features = next_active, next_items, predicted[next_rows]
        for req, rows in zip(reqs, probs):
            req.draft_probs = torch.cat(rows) if rows else None  # [k, vocab]
        return timed

    def _stop_below(self, req: Request, gain: float) -> float:
        """The chain probability P below which req's chain stops, for a stop priced at `gain`
        tokens (SpecState.keep_gain or least_gain): the gain itself, or at T = 0 gain ** (1 /
        greedy_stop_power), where the head's P ** power is what a chain's acceptance was fitted to
        on held-out replies (SpecConfig.calibrated_stop; Qwen's session-75 head: P 0.45 was accepted
        0.57, P ** 0.73 overall). 0, never
        stopping early, for a request with a grammar (its mask changes what the head offers)."""
        if req.grammar is not None:
            return 0.0
        return stop_probability(gain, self.greedy_stop_power if req.params.is_greedy else 1.0)

    def _draft_over_kept(self, req: Request, kept: torch.Tensor, best: int) -> tuple[int, torch.Tensor | None]:
        """sample_draft for a request without a grammar, over the head's kept logits [1, num_kept]
        (best: their argmax): the same draft distribution, since every other token's logit is -inf
        (probability 0 under any temperature, top-k, top-p or min-p), at the cost of num_kept
        columns: at T > 0 the request's filters over SmolLM2's 49,152 mostly -inf columns were
        ~17% of an EAGLE step (py-spy). The distribution it was drawn from goes to rejection
        sampling as [1, vocab]."""
        if req.params.is_greedy:
            return self.kept_ids[best], None
        i, probs = self.sampler.draw_row(req, kept)  # probs [1, num_kept]
        head = self.runner.head
        over_vocab = probs.new_zeros(1, head.vocab_size)
        over_vocab[:, head.head_token_ids] = probs
        return self.kept_ids[i], over_vocab

    def finish(self, req: Request) -> None:
        pass


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    """Rows kept in chunks as one [rows, width] tensor (a lone chunk as it is)."""
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def _top_probs(logits: torch.Tensor) -> list[float]:
    """[rows, n] logits -> each row's softmax probability of its argmax (the largest probability:
    two ops, ~30 us on SmolLM2's 4,111 kept ids where gathering the argmax's logit and summing the
    exponentials took ~100)."""
    return logits.softmax(-1).max(-1).values.tolist()
