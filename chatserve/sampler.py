"""Sampler: one request's logits rows -> emitted token ids, plain or by verifying drafts.

All probability maths lives in spec/; this file only gathers a request's settings, randomness
(its seeded generator) and grammar masks (req.grammar: row j is masked by the grammar's state
after the first j drafts) and calls it.
"""

from __future__ import annotations

import torch

from chatserve.request import Request
from spec.proposer import one_hot_draft_probs
from spec.sampling import (apply_logit_bias, apply_presence_frequency_penalties, apply_repetition_penalty,
                           argmax_rows, logits_to_probs, mask_logits, row_probs, RowDistribution, sample_from_probs,
                           token_logprobs, uniform_noise)
from spec.verify import rejection_sample, rejection_sample_rows, verify_greedy_row


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = eos_token_ids

    def sample(self, req: Request, rows: torch.Tensor) -> list[int]:
        """rows: [1, vocab] logits of the last position -> one token."""
        logits = self._constrain(req, self._penalize(req, rows, []), [])
        if req.params.is_greedy:
            out = [int(argmax_rows(logits[0]))]
            self._keep_logprobs(req, logits, None, out)
            return out
        if _by_row(req, logits):
            return [self.row_probs(req, logits[0]).draw(self._uniforms(req, 1)[0])]
        probs = self.probs(req, logits)  # [1, vocab]
        out = [self.draw(req, probs)]
        self._keep_logprobs(req, logits, probs, out)
        return out

    def verify(
        self, req: Request, rows: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None
    ) -> tuple[list[int], int]:
        """rows: [k + 1, vocab] target logits after the last token and after each draft.
        draft_probs: [k, vocab] or None (one-hot). -> (emitted tokens, num accepted)."""
        k = len(drafts)
        logits = self._constrain(req, self._penalize(req, rows, drafts), drafts)
        if req.params.is_greedy:
            emitted = verify_greedy_row(drafts, argmax_rows(logits).tolist())
            self._keep_logprobs(req, logits, None, emitted)
            return emitted, len(emitted) - 1
        if _by_row(req, logits):
            if draft_probs is not None:
                draft_probs = _fit_vocab(draft_probs, logits.shape[1])
            return rejection_sample_rows(drafts, lambda i: self.row_probs(req, logits[i]), draft_probs,
                                         self._uniforms(req, k + 1))
        draft_ids = torch.tensor([drafts], dtype=torch.long)  # [1, k]
        target_probs = self.probs(req, logits).unsqueeze(0)  # [1, k + 1, vocab]
        vocab = target_probs.shape[-1]
        if draft_probs is None:
            draft_probs = one_hot_draft_probs(draft_ids, vocab)[0]
        draft_probs = _fit_vocab(draft_probs, vocab).unsqueeze(0)  # [1, k, vocab]
        uniform = uniform_noise(1, k + 1, [req.generator])  # k acceptance tests, then the sampled token
        out, num_accepted = rejection_sample(draft_ids, torch.tensor([k]), draft_probs, target_probs, uniform[:, :k],
                                             uniform[:, k])
        n = int(num_accepted[0])
        emitted = out[0, : n + 1].tolist()
        self._keep_logprobs(req, logits, target_probs[0], emitted)
        return emitted, n

    def draw(self, req: Request, probs: torch.Tensor) -> int:
        """One token from probs [1, n] (need not be normalized), at a uniform from req's generator."""
        return int(sample_from_probs(probs, uniform_noise(1, 1, [req.generator])[:, 0])[0])

    def draw_row(self, req: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """A sampled draft from logits [1, n] under req's settings, and the distribution it was drawn
        from [1, n] for rejection sampling: by row_probs on the CPU, else by probs and draw."""
        if logits.device.type != "cpu":
            probs = self.probs(req, logits)
            return self.draw(req, probs), probs
        dist = self.row_probs(req, logits[0])
        return dist.draw(self._uniforms(req, 1)[0]), dist.dense(logits.shape[1]).unsqueeze(0)

    def row_probs(self, req: Request, logits: torch.Tensor) -> RowDistribution:
        """[vocab] logits -> the distribution req's settings draw from, over the tokens they can draw."""
        p = req.params
        return row_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)

    def _uniforms(self, req: Request, n: int) -> list[float]:
        """n uniforms in [0, 1) from req's generator (the global one if unseeded)."""
        return torch.rand(n, generator=req.generator).tolist()

    def probs(self, req: Request, logits: torch.Tensor) -> torch.Tensor:
        """[n, vocab] logits -> [n, vocab] probabilities under req's temperature/top-k/top-p/min-p."""
        p, n = req.params, logits.shape[0]
        return logits_to_probs(
            logits,
            torch.full((n,), p.temperature),
            torch.full((n,), p.top_k, dtype=torch.long),
            torch.full((n,), p.top_p),
            torch.full((n,), p.min_p),
        )

    def _constrain(self, req: Request, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """[k + 1, vocab] -> the same with what req's grammar forbids after drafts[:j] at -inf in row j."""
        if req.grammar is None:
            return logits
        return mask_logits(logits, req.grammar.masks_along(logits.shape[1], drafts))

    def _penalize(self, req: Request, rows: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """[k + 1, vocab] -> the same after req's penalties and logit bias; row j sees drafts[:j]
        as generated (a copy when anything applies)."""
        p = req.params
        if p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty and not p.logit_bias:
            return rows
        rows = rows.clone()
        if p.repetition_penalty != 1.0:
            seen = [req.token_ids + drafts[:j] for j in range(rows.shape[0])]
            apply_repetition_penalty(rows, seen, [p.repetition_penalty] * rows.shape[0])
        if p.presence_penalty or p.frequency_penalty:
            generated = [req.output_token_ids + drafts[:j] for j in range(rows.shape[0])]
            apply_presence_frequency_penalties(rows, generated, p.presence_penalty, p.frequency_penalty)
        if p.logit_bias:
            apply_logit_bias(rows, p.logit_bias)
        return rows

    def _keep_logprobs(self, req: Request, logits: torch.Tensor, probs: torch.Tensor | None, emitted: list[int]) -> None:
        """With params.logprobs set, leave on req the logprobs of the emitted tokens (row j for the
        j-th), from probs (sampled) or from the processed logits (greedy)."""
        if req.params.logprobs is None:
            return
        rows = len(emitted)
        logprobs = torch.log_softmax(logits[:rows].float(), -1) if probs is None else probs[:rows].log()
        req.new_logprobs = [(tok, lp, top) for tok, (lp, top)
                            in zip(emitted, token_logprobs(logprobs, emitted, req.params.logprobs))]


def _by_row(req: Request, logits: torch.Tensor) -> bool:
    """Whether a sampled request's rows go one at a time over only the tokens they can draw
    (spec.sampling.row_probs): on the CPU, without logprobs (which want the [vocab] rows)."""
    return not req.params.is_greedy and req.params.logprobs is None and logits.device.type == "cpu"


def _fit_vocab(probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft head may have a few padding rows more or fewer than the target's."""
    if probs.shape[-1] == vocab:
        return probs
    if probs.shape[-1] > vocab:
        return probs[..., :vocab]
    return torch.nn.functional.pad(probs, (0, vocab - probs.shape[-1]))
