"""An EAGLE head as a speculation method (chatserve/models/eagle_head.py): one decoder layer
on the target's features drafts k tokens in a chain, each step a forward of that one layer.

Its KV follows the target's, so it has nothing to catch up on and needs no draft-KV marks:

    head row i = fc([f_{i-1}; embed(t_i)])   written once the target has computed position i - 1

    [0, num_computed_tokens)        head KV valid: observe() writes, after every target forward
                                    (of every request, whatever its method), the rows of the
                                    positions the target just computed, from their features
    [num_computed_tokens, +k)       written by propose() from its own predicted features and
                                    drafts; the next observe() overwrites them with true rows

So a committed block has valid head KV too (it is a function of the block's tokens and prefix,
like the target's), and rollback is the target's integer: nothing of the head to undo.
Design choices, the simplest correct ones (no measurement settled them yet):
- observe() runs after the step's tokens are appended, because row i needs t_i: the last row of
  a step is the token just sampled. The blocks of a request that finished in that step were
  released already; the engine hands over the block ids as scheduled, and nothing allocates
  before observe() writes them (a committed block among them must get its head rows before any
  request can attach it).
- Row i needs f_{i-1}, a feature of the previous step: each request keeps its last one
  (req.last_feature). A request that starts from the prefix cache at position p (a block
  boundary) reads f_{p-1} from the pool's per-block feature (HeadRunner.block_features),
  written for every block's last position.
- Drafts run in a chain, k forwards for k drafts over all drafting requests (no tree: issue
  #14 asks for one only if it measurably pays on 2 cores). The first feeds the request's last
  token with its last feature, each next one the draft just made with the head's predicted
  feature. At T > 0 a draft is sampled from the head's distribution (the request's temperature
  / top-k / top-p, over the head's trimmed vocabulary: 0 elsewhere), which rejection sampling
  is given: lossless for any draft distribution.
- Priced like a free proposal (keeps_kv False): the head's steps are not in the measured costs
  yet (spec_costs.py), so adaptive k does not weigh them.
"""

from __future__ import annotations

import torch

from chatserve.batch import BatchItem
from chatserve.config import SpecConfig
from chatserve.request import Request
from chatserve.scheduler import ScheduledSeq
from chatserve.spec_methods.base import Offer, sample_draft
from spec.adaptive import AcceptanceEMA, geometric_gains


class EagleMethod:
    name = "eagle"
    label = "EAGLE head"
    keeps_kv = False  # its KV follows the target's: no catch-up, no marks
    reads_features = True
    mixable = False

    def __init__(self, runner, sampler):
        self.runner = runner  # chatserve.model_runner.HeadRunner
        self.sampler = sampler
        self.accept_rate = AcceptanceEMA(ema=0.05, prior=0.7)

    @classmethod
    def create(cls, config: SpecConfig, models, sampler) -> EagleMethod | None:
        return cls(models.eagle_runner, sampler) if models.eagle_runner is not None else None

    def offer(self, req: Request, cap: int, accept_rate: float) -> Offer | None:
        if cap == 0 or not self._has_last_feature(req):
            return None
        return Offer(self, geometric_gains(accept_rate, cap))

    def _has_last_feature(self, req: Request) -> bool:
        return req.last_feature is not None and req.last_feature[0] == req.num_computed_tokens - 1

    def observe(self, scheduled: list[ScheduledSeq], items: list[BatchItem], features: torch.Tensor) -> None:
        """Write the head's rows for the positions the target computed this step: request r fed
        positions [start, start + q_len) and now has num_computed_tokens = end (rejected drafts
        excluded), so its rows [start, end) take f_{start-1} (kept from before), then the
        features of positions [start, end - 1), and tokens t_start .. t_{end-1}. One head
        forward over all requests, no logits."""
        head_items, inputs, row = [], [], 0
        block_size = self.runner.block_size
        for s, item in zip(scheduled, items):
            req, start, end = s.req, item.start_pos, s.req.num_computed_tokens
            fed = features[row : row + len(item.token_ids)]  # [q_len, hidden]: f_start, f_start+1, ...
            row += len(item.token_ids)
            inputs += [self._feature_before(req, start, item.block_ids), fed[: end - start - 1]]
            head_items.append(BatchItem(req.token_ids[start:end], start, item.block_ids, 0))
            req.last_feature = (end - 1, fed[end - start - 1].clone())
            for pos in range(start + block_size - 1 - start % block_size, end, block_size):  # blocks' last rows
                self.runner.block_features[item.block_ids[pos // block_size]] = fed[pos - start]
        self.runner.run(head_items, torch.cat(inputs))

    def _feature_before(self, req: Request, start: int, block_ids: list[int]) -> torch.Tensor:
        """f_{start-1} as [1, hidden]: zeros at position 0, the request's own last feature, or,
        starting from the prefix cache at a block boundary, the cached block's last feature."""
        features = self.runner.block_features
        if start == 0:
            return features.new_zeros(1, features.shape[1])
        if req.last_feature is not None and req.last_feature[0] == start - 1:
            return req.last_feature[1][None]
        assert start % self.runner.block_size == 0, "no feature for the position before a step"
        return features[block_ids[start // self.runner.block_size - 1]][None]

    def propose(self, reqs: list[Request], ks: list[int]) -> None:
        """Draft ks[i] tokens for reqs[i] in a chain: forward s feeds each still-drafting request's
        newest token at its position with the feature before it (the target's last one, then the
        head's own prediction) and drafts from the head's logits for the next position."""
        items, inputs = [], []
        for req in reqs:
            assert self._has_last_feature(req), "offer() checked it"
            pos = req.num_computed_tokens  # the last token's position: not fed to the target yet
            items.append(BatchItem([req.token_ids[pos]], pos, req.table.block_ids, 1))
            inputs.append(req.last_feature[1])
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        active, features = list(range(len(reqs))), torch.stack(inputs)  # [drafting, hidden]
        while active:
            predicted = self.runner.head.norm(self.runner.run(items, features))  # [drafting, hidden]
            logits = self.runner.head.compute_logits(predicted)  # [drafting, vocab]
            next_active, next_items, next_rows = [], [], []
            for row, i in enumerate(active):
                req = reqs[i]
                token, token_probs = sample_draft(self.sampler, req, logits[row : row + 1])
                req.draft_token_ids.append(token)
                if token_probs is not None:
                    probs[i].append(token_probs)
                if len(req.draft_token_ids) < ks[i]:
                    next_active.append(i)
                    next_items.append(BatchItem([token], items[row].start_pos + 1, req.table.block_ids, 1))
                    next_rows.append(row)
            active, items, features = next_active, next_items, predicted[next_rows]
        for req, rows in zip(reqs, probs):
            req.draft_probs = torch.cat(rows) if rows else None  # [k, vocab]

    def finish(self, req: Request) -> None:
        pass
