"""Logits -> probabilities -> token ids, shared by the draft and the target.

Pure torch on whatever device the inputs live on; no model, no request objects.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kernels import sampling_ops


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [..., n] -> [...] long
    """x.argmax(-1): the first index of a row's largest value (a NaN counts as the largest, as
    torch has it). A float32 / float64 CPU tensor goes through numpy, whose argmax is vectorized
    where torch's CPU one is a scalar loop: SmolLM2's 49,152 logits took 55 us a row against
    numpy's 5 on a Zen 3 (151,936 for Qwen: 167 against 15), several times in a speculative step.
    Elsewhere (CUDA: no sync) torch's."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.shape[-1] > 0:
        return torch.from_numpy(np.asarray(x.detach().numpy().argmax(-1)))
    return x.argmax(-1)


def apply_repetition_penalty(
    logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
    seen_token_ids: Sequence[torch.Tensor | Sequence[int]],  # per row: token ids seen so far
    penalties: Sequence[float],  # [num_rows]
) -> torch.Tensor:
    """Penalize every token a row has seen (HF / vLLM semantics) and return `logits`.

    For a seen token: logit > 0 -> logit / penalty, else logit * penalty. A token seen
    several times is penalized once. Rows with penalty 1.0 are untouched. One scatter over a
    padded index tensor; no Python loop over tokens.
    """
    penalized_rows = [i for i, penalty in enumerate(penalties) if penalty != 1.0]
    if not penalized_rows:
        return logits
    vocab_size = logits.shape[1]
    device = logits.device
    # Pad with vocab_size: scatters into an extra column that is then dropped.
    seen = torch.nn.utils.rnn.pad_sequence(
        [torch.as_tensor(seen_token_ids[i], dtype=torch.long).reshape(-1) for i in penalized_rows],
        batch_first=True,
        padding_value=vocab_size,
    ).to(device)  # [num_penalized, max_seen]
    is_seen = torch.zeros(len(penalized_rows), vocab_size + 1, dtype=torch.bool, device=device)
    is_seen.scatter_(1, seen, True)
    is_seen = is_seen[:, :vocab_size]  # [num_penalized, vocab_size]

    row_indices = torch.tensor(penalized_rows, device=device)  # [num_penalized]
    row_logits = logits[row_indices]  # [num_penalized, vocab_size] (a copy)
    row_penalties = torch.tensor([penalties[i] for i in penalized_rows], dtype=logits.dtype, device=device)
    row_penalties = row_penalties.unsqueeze(1)  # [num_penalized, 1]
    penalized = torch.where(row_logits > 0, row_logits / row_penalties, row_logits * row_penalties)
    logits[row_indices] = torch.where(is_seen, penalized, row_logits)
    return logits


def apply_presence_frequency_penalties(
    logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
    output_token_ids: Sequence[Sequence[int]],  # per row: the tokens generated so far
    presence: float,
    frequency: float,
) -> torch.Tensor:
    """OpenAI's penalties and return `logits`: a token generated c times loses
    c * frequency + (c > 0) * presence from its logit. Prompt tokens do not count."""
    vocab_size = logits.shape[1]
    counts = torch.zeros(len(output_token_ids), vocab_size + 1, dtype=logits.dtype, device=logits.device)
    ids = torch.nn.utils.rnn.pad_sequence(
        [torch.as_tensor(list(row), dtype=torch.long).reshape(-1) for row in output_token_ids],
        batch_first=True, padding_value=vocab_size,
    ).to(logits.device)  # [num_rows, max_generated]; padding counts in the dropped column
    if ids.numel():
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
    counts = counts[:, :vocab_size]  # [num_rows, vocab_size]
    logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(
    logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
    bias: Sequence[tuple[int, float]],  # (token id, added to its logit in every row)
) -> torch.Tensor:
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
    values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
    logits[:, ids] += values
    return logits


def token_logprobs(
    logprobs: torch.Tensor,  # [num_rows, vocab_size] log-probabilities
    token_ids: Sequence[int],  # [num_rows] the token chosen in each row
    num_top: int,
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row: (logprob of its chosen token, the num_top most likely (id, logprob), best first)."""
    rows = torch.arange(len(token_ids))
    chosen = logprobs[rows, torch.tensor(list(token_ids), dtype=torch.long)].tolist()
    if num_top == 0:
        return [(lp, []) for lp in chosen]
    values, ids = logprobs.topk(num_top, dim=-1)
    return [(lp, list(zip(i, v))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]


def mask_logits(
    logits: torch.Tensor,  # [num_rows, vocab_size], not modified
    allowed: torch.Tensor,  # [num_rows, vocab_size] bool
) -> torch.Tensor:  # [num_rows, vocab_size]
    """-inf where a token is not allowed (a grammar's mask), before temperature and the filters:
    the softmax renormalizes over the allowed tokens and greedy takes the allowed argmax. Each
    row must allow at least one token."""
    return logits.masked_fill(~allowed, float("-inf"))


def logits_to_probs(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, not modified
    temperature: torch.Tensor,  # [num_rows] float; 0 = greedy
    top_k: torch.Tensor,  # [num_rows] long; 0 = off
    top_p: torch.Tensor,  # [num_rows] float; 1.0 = off
    min_p: torch.Tensor,  # [num_rows] float; 0.0 = off
) -> torch.Tensor:  # [num_rows, vocab_size] float32
    """Temperature, then top-k, top-p and min-p masks (vLLM's order), then softmax.

    Greedy rows (temperature 0) get a one-hot at the argmax of `logits`. A filter that no
    row uses costs nothing; top-k and top-p share one partial sort. Used for both draft and
    target, so both see one transform.
    """
    is_greedy = temperature == 0  # [num_rows]
    safe_temperature = torch.where(is_greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() / safe_temperature.unsqueeze(1).float()  # [num_rows, vocab_size]

    if bool((top_k > 0).any() | (top_p < 1.0).any()):
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    if bool((min_p > 0).any()):
        scaled = _apply_min_p(scaled, min_p)
    probs = torch.softmax(scaled, dim=-1)  # [num_rows, vocab_size]

    if bool(is_greedy.any()):
        one_hots = torch.zeros_like(probs)
        one_hots.scatter_(1, argmax_rows(logits).unsqueeze(1), 1.0)
        probs = torch.where(is_greedy.unsqueeze(1), one_hots, probs)
    return probs


# Top-p rows without top-k first look for their nucleus among this many tokens.
NUCLEUS_GUESS = 1024


def _apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
    top_k: torch.Tensor,  # [num_rows] long; 0 = off
    top_p: torch.Tensor,  # [num_rows] float; 1.0 = off
) -> torch.Tensor:
    """Keep the top-k, then the top-p nucleus of what is left, with one partial sort.

    Both filters keep a prefix of the row in descending order, so each row needs one
    threshold; a token tied with the last kept one is kept too.
    """
    has_top_k = top_k > 0  # [num_rows]
    has_top_p = top_p < 1.0  # [num_rows]
    full_lse = logits.logsumexp(dim=-1) if bool(has_top_p.any()) else None  # [num_rows]
    values = _top_values(logits, top_k, top_p, full_lse)  # [num_rows, num_cols], descending
    num_cols = values.shape[1]
    k = torch.where(has_top_k, top_k.clamp_max(num_cols), num_cols)  # [num_rows]
    thresholds = values.gather(1, (k - 1).unsqueeze(1))  # [num_rows, 1]
    thresholds.masked_fill_(~has_top_k.unsqueeze(1), float("-inf"))
    if full_lse is not None:
        # Normalize over the top-k (rows with top-k) or over the whole row (rows without).
        is_in_k = torch.arange(num_cols, device=logits.device) < k.unsqueeze(1)  # [num_rows, num_cols]
        values_in_k = values.masked_fill(~is_in_k, float("-inf"))
        lse = torch.where(has_top_k, values_in_k.logsumexp(dim=-1), full_lse)  # [num_rows]
        cum_probs = (values_in_k - lse.unsqueeze(1)).exp().cumsum(dim=-1)  # [num_rows, num_cols]
        mass_before = torch.nn.functional.pad(cum_probs[:, :-1], (1, 0))  # exclusive cumsum
        # Keep while the larger tokens hold < top_p (vLLM: drop the smallest tokens whose
        # total is <= 1 - top_p); the largest token is always kept.
        num_kept = ((mass_before < top_p.float().unsqueeze(1)) & is_in_k).sum(dim=-1).clamp_min(1)
        top_p_thresholds = values.gather(1, (num_kept - 1).unsqueeze(1))  # [num_rows, 1]
        thresholds = torch.where(has_top_p.unsqueeze(1), top_p_thresholds, thresholds)
    return logits.masked_fill_(logits < thresholds, float("-inf"))


def _top_values(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    top_k: torch.Tensor,  # [num_rows] long; 0 = off
    top_p: torch.Tensor,  # [num_rows] float; 1.0 = off
    full_lse: torch.Tensor | None,  # [num_rows] logsumexp of logits; None if no row uses top-p
) -> torch.Tensor:  # [num_rows, num_cols] descending
    """The largest values, as many columns as any row's filter can keep.

    That is the largest k, and for top-p rows without top-k the first NUCLEUS_GUESS tokens,
    or the whole row (a full sort, ~17 ms per 152k-token row on our CPU) only if those hold
    less than top_p of the row's mass.
    """
    values = _candidate_values(logits, top_k, top_p, full_lse)
    if values is not None:
        return values
    vocab_size = logits.shape[1]
    needs_nucleus = (top_p < 1.0) & (top_k == 0)  # [num_rows]
    num_cols = int(top_k.max().clamp(1, vocab_size))
    if bool(needs_nucleus.any()):
        num_cols = max(num_cols, min(vocab_size, NUCLEUS_GUESS))
    values = logits.topk(num_cols, dim=-1).values  # [num_rows, num_cols]
    if num_cols < vocab_size and bool(needs_nucleus.any()):
        guessed_mass = (values.logsumexp(dim=-1) - full_lse).exp()  # [num_rows]
        if bool((needs_nucleus & (guessed_mass < top_p)).any()):
            values = logits.sort(dim=-1, descending=True).values  # [num_rows, vocab_size]
    return values


# A row's candidates: its logits (after temperature) at most this far below its largest, i.e. tokens
# at least e^-16 ~ 1e-7 as likely as its top token, up to this many.
CANDIDATE_MARGIN = 16.0
MAX_CANDIDATES = 4096
# A top-p row's candidates must hold this much more than top_p (float32 sums may differ by ~1e-6).
CANDIDATE_MASS_SLACK = 1e-4


def _candidate_values(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    top_k: torch.Tensor,  # [num_rows] long; 0 = off
    top_p: torch.Tensor,  # [num_rows] float; 1.0 = off
    full_lse: torch.Tensor | None,  # [num_rows]
) -> torch.Tensor | None:  # [num_rows, num_cols] descending, -inf padded
    """_top_values from each row's candidates (CANDIDATE_MARGIN), sorted, when they hold what the row's
    filter keeps: at least top_k of them, or (top-p alone) top_p of the row's mass; else None. What a
    filter keeps is a prefix of the row's descending order, so it is a prefix of the candidates' order:
    the same values as a top-k over the whole row, whose partial sort of 152k logits cost 1-3 ms a row
    on a Zen 3 (top-k 40 or the 1,024 of a nucleus guess) where this costs ~0.2. CPU rows only (the
    boolean selection would sync a device)."""
    if logits.is_cuda or logits.shape[0] > 16:
        return None
    rows = []
    for i, row in enumerate(logits):
        candidates = row[row >= row.max() - CANDIDATE_MARGIN]
        k, p = int(top_k[i]), float(top_p[i])
        if not 0 < len(candidates) <= MAX_CANDIDATES or len(candidates) < k:  # none: a NaN row
            return None
        if k == 0 and p < 1.0 and float((candidates.logsumexp(0) - full_lse[i]).exp()) < p + CANDIDATE_MASS_SLACK:
            return None
        rows.append(candidates.sort(descending=True).values)
    width = max(len(r) for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=float("-inf")) for r in rows])


def _apply_min_p(
    logits: torch.Tensor,  # [num_rows, vocab_size], modified in place
    min_p: torch.Tensor,  # [num_rows] float; 0.0 = off
) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    thresholds = logits.amax(dim=-1, keepdim=True) + min_p.float().log().unsqueeze(1)  # [num_rows, 1]
    return logits.masked_fill_(logits < thresholds, float("-inf"))


def sample_from_probs(
    probs: torch.Tensor,  # [num_rows, vocab_size], need not be normalized
    uniform: torch.Tensor,  # [num_rows] U[0, 1), one per row
) -> torch.Tensor:  # [num_rows] long
    """One token per row from probs / probs.sum() by inverse CDF: the first token whose float64
    cumulative sum exceeds uniform x the row's total (a token of probability 0 never is: its sum
    equals the one before it). One uniform a row, and no device sync (searchsorted on the
    device). It was the exponential race argmax(probs / Exp(1) noise), exact too, but that noise
    is one exponential a vocabulary entry: 3.8 ms for Qwen's 151,936 on a Zen 3 (torch's CPU
    exponential_), against ~0.2 ms for this, on every token sampled at T > 0.
    """
    cdf = probs.double().cumsum(dim=-1)  # [num_rows, vocab_size]
    x = uniform.double().unsqueeze(1) * cdf[:, -1:]  # [num_rows, 1], < the total for u < 1
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_max(probs.shape[1] - 1)


def uniform_noise(
    num_rows: int,
    num_cols: int,
    generators: Sequence[torch.Generator | None],  # [num_rows]; None = global RNG
    device: torch.device | str | None = None,
) -> torch.Tensor:  # [num_rows, num_cols] float32 in [0, 1)
    """U[0, 1) noise per row, e.g. the `uniform` [batch, k] of `rejection_sample`; row i draws
    from generators[i] if set, so a seeded row's noise depends only on its generator, not on its
    batch neighbours."""
    if len(generators) != num_rows:
        raise ValueError(f"need one generator (or None) per row: {len(generators)} != {num_rows}")
    out = torch.empty(num_rows, num_cols, dtype=torch.float32, device=device)
    unseeded_rows = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded_rows) == num_rows:
        return out.uniform_()
    if unseeded_rows:
        unseeded = torch.empty(len(unseeded_rows), num_cols, dtype=torch.float32, device=device).uniform_()
        out[torch.tensor(unseeded_rows, device=device)] = unseeded
    for i, generator in enumerate(generators):
        if generator is not None:
            out[i].uniform_(generator=generator)
    return out


# Draws over rows up to this long run in plain Python (_inverse_cdf).
SHORT_ROW = 64


class RowProbs(NamedTuple):
    """One row's sampling distribution on the CPU: probs [m] over the token ids [m] it can draw
    (ascending), or over the whole vocabulary when ids is None. Normalized up to float rounding.
    numpy: its ops on a few hundred numbers cost ~1 us where torch's cost ~10."""

    ids: np.ndarray | None  # [m] int64
    probs: np.ndarray  # [m] or [vocab_size] float

    def prob(self, token: int) -> float:
        if self.ids is None:
            return float(self.probs[token])
        i = int(np.searchsorted(self.ids, token))
        return float(self.probs[i]) if i < len(self.ids) and self.ids[i] == token else 0.0

    def dense(self, vocab_size: int) -> torch.Tensor:  # [vocab_size] float32
        if self.ids is None:
            return torch.from_numpy(self.probs).float()
        out = torch.zeros(vocab_size)
        out[torch.from_numpy(self.ids)] = torch.from_numpy(self.probs).float()
        return out

    def draw(self, uniform: float, minus: torch.Tensor | None = None, minus_token: int | None = None) -> int:
        """A token by inverse CDF at uniform (the first whose float64 running sum exceeds uniform x the
        total), from these probs or, with `minus` (a [vocab_size] CPU row of another distribution) or
        `minus_token` (a one-hot one), from the residual max(probs - minus, 0) when it has any mass:
        speculative sampling's recovered token."""
        probs = self.probs
        if minus is not None:
            q = minus.detach().numpy()
            residual = np.maximum(probs - (q if self.ids is None else q[self.ids]), 0.0)
            probs = residual if residual.sum() > 0 else probs
        elif minus_token is not None:  # max(p - one-hot, 0): p without that token
            residual = probs.copy()
            if self.ids is None:
                residual[minus_token] = 0.0
            else:
                residual[self.ids == minus_token] = 0.0
            probs = residual if residual.sum() > 0 else probs
        i = _inverse_cdf(probs, uniform)
        return i if self.ids is None else int(self.ids[i])


def _inverse_cdf(probs: np.ndarray, uniform: float) -> int:
    """The first index whose float64 running sum of probs exceeds uniform x their total, or the last
    of positive probability if rounding puts that at the total. A few probs in plain Python: right
    after a forward each numpy call costs tens of microseconds of cold caches (the weights have just
    streamed through them), a list a few."""
    if len(probs) <= SHORT_ROW:
        cdf = list(itertools.accumulate(probs.tolist()))
        i = min(bisect.bisect_right(cdf, uniform * cdf[-1]), len(cdf) - 1)
        while i > 0 and cdf[i] == cdf[i - 1]:  # never a token of probability 0
            i -= 1
        return i
    cdf = np.cumsum(probs, dtype=np.float64)
    return min(int(np.searchsorted(cdf, uniform * cdf[-1], side="right")), int(np.flatnonzero(probs)[-1]))


class SoftmaxRow(NamedTuple):
    """softmax(logits / temperature) over the whole vocabulary (no filter narrows the row), kept as
    the row, its largest scaled value and its normalizer: a probability is one exp, a draw one or
    two passes over the row (kernels/sampling_ops.py), with no [vocab] tensor built."""

    logits: torch.Tensor  # [vocab_size] float32
    temperature: float
    top: float  # the largest logits / temperature
    total: float  # sum of exp(logits / temperature - top)

    def prob(self, token: int) -> float:
        scaled = np.float32(self.logits[token]) / np.float32(self.temperature)
        return math.exp(float(scaled) - self.top) / self.total

    def dense(self, vocab_size: int) -> torch.Tensor:  # [vocab_size]
        return torch.softmax(self.logits.float() / torch.tensor(self.temperature, dtype=torch.float32), dim=0)

    def draw(self, uniform: float, minus: torch.Tensor | None = None, minus_token: int | None = None) -> int:
        """As RowProbs.draw."""
        if minus is not None:
            minus = minus.float().contiguous()
        return sampling_ops.row_draw(self.logits, self.temperature, self.top, self.total, uniform, minus,
                                     -1 if minus_token is None else minus_token)


# One row's distribution: over the tokens it can draw, or a whole-vocabulary softmax kept as its normalizer.
RowDistribution = RowProbs | SoftmaxRow


def row_probs(
    logits: torch.Tensor,  # [vocab_size] float, not modified
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> RowDistribution:
    """logits_to_probs for one row without its [vocab] tensors, in one C++ call (kernels/sampling_ops.py):
    a row whose filters keep fewer than all its tokens comes back over the ones kept (RowProbs), found
    among its candidates, the logits within CANDIDATE_MARGIN of its largest after temperature (the same
    kept tokens and probabilities, up to float rounding); a row only a temperature shapes comes back as
    its largest value and its softmax's normalizer (SoftmaxRow). logits_to_probs is ~10 torch ops over
    the whole row, with the draw's float64 cumulative sum: SmolLM2's plain sampling at T 0.7, top-p 0.9
    cost ~2.2 ms a token in the engine and this ~0.35; speculation verified k + 1 such rows a step. A
    greedy row, a CUDA row, and a row whose kept set reaches past its candidates (a nucleus holding
    more than they do: a flat row over a large vocabulary) take logits_to_probs (RowProbs, ids None)."""
    if temperature == 0 or logits.is_cuda:
        return _dense_row(logits, temperature, top_k, top_p, min_p)
    logits = logits.float().contiguous()
    min_p_offset = -math.log(min_p) if min_p > 0.0 else math.inf
    if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:  # every token drawable
        top, total = sampling_ops.row_softmax(logits, temperature)
        if not math.isnan(top):
            return SoftmaxRow(logits, temperature, top, total)
        return _dense_row(logits, temperature, top_k, top_p, min_p)
    kept = sampling_ops.row_kept(logits, temperature, top_k, top_p, min_p_offset, CANDIDATE_MARGIN, NUCLEUS_GUESS)
    if kept is None:
        return _dense_row(logits, temperature, top_k, top_p, min_p)
    return RowProbs(*kept)


def _dense_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> RowProbs:
    settings = (torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    return RowProbs(None, logits_to_probs(logits.unsqueeze(0), *settings)[0].cpu().numpy())
