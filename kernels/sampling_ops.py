"""One row of logits at a temperature, in C++ (kernels/sampling_cpu.cpp), with plain-torch references.

Sampling a token or verifying a draft at T > 0 reads whole rows of logits (49,152 for SmolLM2,
151,936 for Qwen) to find a few hundred drawable tokens or one row's normalizer. Each torch op over
such a row costs 20-150 us in the engine (a comparison, a nonzero, a division, a logsumexp, a
float64 cumulative sum: the step's weights have just streamed through the caches), and a row took
~10 of them. Here a call reads the row once or twice: row_kept (what top-k, top-p and min-p keep,
and their probabilities), row_softmax (a temperature alone: the largest value and the normalizer),
row_draw (a token from such a softmax, or from its residual after a draft's distribution).

A row's value is s = logits / temperature (float32, as logits_to_probs computes it), its weights
exp(s - top) with top the largest s. The C++ takes a contiguous float32 CPU row with the extension
built (`usable`); anything else takes the reference. The C++ exp is Cephes' (relative error ~2e-7),
so sums and draws agree with the references up to float rounding, not bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kernels import cpu_ext


def usable(logits: torch.Tensor) -> bool:
    return (logits.dtype == torch.float32 and logits.dim() == 1 and not logits.is_cuda and logits.is_contiguous()
            and cpu_ext.is_available())


def row_candidates_ref(logits: torch.Tensor, temperature: float,
                       offset: float) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(top, ids [m] ascending, values [m]): the row's largest s (NaN, and no candidates, if a value is
    NaN) and the tokens whose s >= float32(top - offset), with their s."""
    scaled = logits.float() / torch.tensor(temperature, dtype=torch.float32)  # [vocab]
    top = float(scaled.max()) if len(scaled) else math.nan
    if math.isnan(top):
        return top, torch.empty(0, dtype=torch.long), torch.empty(0)
    ids = (scaled >= torch.tensor(top - offset, dtype=torch.float32)).nonzero().squeeze(1)
    return top, ids, scaled[ids]


def row_softmax(logits: torch.Tensor, temperature: float) -> tuple[float, float]:
    """(top, total): the row's largest s (NaN if a value is NaN) and the sum of exp(s - top)."""
    if usable(logits):
        return cpu_ext.extension().row_softmax(logits, temperature)
    return row_softmax_ref(logits, temperature)


def row_softmax_ref(logits: torch.Tensor, temperature: float) -> tuple[float, float]:
    top, _, _ = row_candidates_ref(logits, temperature, 0.0)
    return top, (math.nan if math.isnan(top) else row_weight_sum_ref(logits, temperature, top))


def row_weight_sum_ref(logits: torch.Tensor, temperature: float, top: float) -> float:
    """The sum of exp(s - top) over the row."""
    scaled = logits.float() / torch.tensor(temperature, dtype=torch.float32)
    return float((scaled.double() - top).exp().sum())


def row_draw(logits: torch.Tensor, temperature: float, top: float, total: float, uniform: float,
             minus: torch.Tensor | None = None, minus_token: int = -1) -> int:
    """A token at uniform by inverse CDF from softmax(s) (top, total: row_softmax), or from the residual
    max(softmax(s) - minus, 0) (minus a [vocab] distribution, or the one-hot at minus_token >= 0) when
    that has any mass."""
    if usable(logits) and (minus is None or (minus.dtype == torch.float32 and minus.is_contiguous())):
        return cpu_ext.extension().row_draw(logits, temperature, top, total, uniform, minus, minus_token)
    return row_draw_ref(logits, temperature, top, total, uniform, minus, minus_token)


def row_draw_ref(logits, temperature, top, total, uniform, minus=None, minus_token=-1) -> int:
    scaled = logits.float() / torch.tensor(temperature, dtype=torch.float32)
    weights = (scaled.double() - top).exp()  # [vocab]
    drawn = weights
    if minus is not None:
        drawn = (weights - minus.double() * total).clamp_min(0)
    elif 0 <= minus_token < len(weights):
        drawn = weights.clone()
        drawn[minus_token] = 0.0
    if not bool(drawn.sum() > 0):
        drawn = weights
    cdf = drawn.cumsum(0)  # [vocab] float64
    i = int(torch.searchsorted(cdf, torch.tensor([uniform * float(cdf[-1])], dtype=torch.float64), right=True))
    return min(i, int(drawn.nonzero().max()))


def row_kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p_offset: float,
             margin: float, nucleus_guess: int) -> tuple[np.ndarray, np.ndarray] | None:
    """What logits_to_probs's top-k, top-p and min-p (min_p_offset = -log(min_p), inf = off) keep of one
    row at temperature > 0: (ids [m] int64 ascending, probs [m] float64), found among the row's
    candidates as row_kept_ref says; None for a NaN row and for a nucleus reaching past the candidates."""
    if usable(logits):
        ids, probs = cpu_ext.extension().row_kept(logits, temperature, top_k, top_p, min_p_offset, margin,
                                                  nucleus_guess)
        return (ids.numpy(), probs.numpy()) if len(ids) else None
    return row_kept_ref(logits, temperature, top_k, top_p, min_p_offset, margin, nucleus_guess)


def row_kept_ref(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p_offset: float,
                 margin: float, nucleus_guess: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The candidates are the tokens at or above a floor: min-p's threshold (nothing below it is kept),
    or with top-k or top-p `margin` below the largest if that is higher, lowered while the top-k
    reaches below it. The k-th largest candidate is top-k's threshold (ties kept). Top-p's sorted
    prefix is a partial sort of the candidates (nucleus_guess of them, all if the nucleus is longer),
    normalized by the top-k's mass, or without top-k by the whole row's: the candidates' plus a tail
    of at most (vocab - m) e^-offset (in units of the largest token's weight), the nucleus read at both
    ends of that range and the whole row summed only when they disagree. The kept tokens' softmax is
    taken over their values in float64."""
    offset = min(min_p_offset, margin) if top_k > 0 or top_p < 1.0 else min_p_offset
    is_min_p_floor = min_p_offset <= offset  # nothing below the floor is kept
    top, ids, values = row_candidates_ref(logits, temperature, offset)
    if math.isnan(top):
        return None
    if top_k > 0 and (top_p < 1.0 or not is_min_p_floor):  # top-p's normalization or the kept set needs the top-k
        while len(ids) < top_k and offset < math.inf:  # the top-k reaches lower
            offset = offset * 4 if offset < 1e4 else math.inf
            top, ids, values = row_candidates_ref(logits, temperature, offset)
    ids, values = ids.numpy(), values.numpy()
    m = len(ids)
    threshold = top - min_p_offset
    if top_k > 0 and m > top_k:
        threshold = max(threshold, float(_largest(values, top_k)[-1]))
    if top_p < 1.0:
        in_k = min(top_k, m) if top_k > 0 else m
        if top_k > 0:
            ordered = _largest(values, in_k)
            total, tail = float(np.exp(ordered.astype(np.float64) - top).sum()), 0.0
        else:
            ordered = _largest(values, min(in_k, nucleus_guess))
            total, tail = float(np.exp(values.astype(np.float64) - top).sum()), (len(logits) - m) * math.exp(-offset)
        whole = []

        def whole_mass() -> float:
            if not whole:
                whole.append(row_weight_sum_ref(logits, temperature, top))
            return whole[0]

        def nucleus(o: np.ndarray) -> int:
            kept = _count_nucleus(o, top, top_p, total)
            if top_k > 0 or kept == _count_nucleus(o, top, top_p, total + tail):
                return kept
            return _count_nucleus(o, top, top_p, whole_mass())

        kept = nucleus(ordered)
        if kept == len(ordered) < in_k:  # the nucleus is longer than the guess
            ordered = _largest(values, in_k)
            kept = nucleus(ordered)
        if top_k <= 0 and not is_min_p_floor and total < top_p * (total + tail) and total < top_p * whole_mass():
            return None  # the nucleus goes on past the candidates
        threshold = max(threshold, float(ordered[kept - 1]))
    is_kept = (values >= np.float32(threshold)) & (values > -np.inf)  # a token tied with the last kept one is kept too
    weights = np.exp(values[is_kept].astype(np.float64) - top)
    return ids[is_kept], weights / weights.sum()


def _largest(values: np.ndarray, n: int) -> np.ndarray:  # [n] descending
    if n < len(values):
        values = np.partition(values, len(values) - n)[len(values) - n :]
    return np.sort(values)[::-1]


def _count_nucleus(ordered: np.ndarray, top: float, top_p: float, total: float) -> int:
    """How many of ordered (descending) top-p keeps: while the larger ones hold < top_p of total (in
    units of the largest token's weight), at least one."""
    weights = np.exp(ordered.astype(np.float64) - top)
    mass_before = np.concatenate(([0.0], np.cumsum(weights)[:-1]))
    return max(int((mass_before < top_p * total).sum()), 1)
