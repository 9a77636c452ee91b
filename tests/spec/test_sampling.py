import math

import numpy as np
import pytest
import torch

from spec import sampling
from spec.sampling import (
    apply_repetition_penalty,
    argmax_rows,
    logits_to_probs,
    sample_from_probs,
    uniform_noise,
)


def _probs(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    min_p: float | list[float] = 0.0,
) -> torch.Tensor:  # [num_rows, vocab_size]
    num_rows = logits.shape[0]

    def per_row(value, dtype):
        values = value if isinstance(value, list) else [value] * num_rows
        return torch.tensor(values, dtype=dtype)

    return logits_to_probs(
        logits,
        per_row(temperature, torch.float32),
        per_row(top_k, torch.long),
        per_row(top_p, torch.float32),
        per_row(min_p, torch.float32),
    )


def _log(probs: list[float]) -> torch.Tensor:  # [1, len(probs)]
    return torch.tensor([probs]).log()


def test_no_filters_is_softmax():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_probs(logits), logits.softmax(-1))


def test_temperature():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    torch.testing.assert_close(_probs(logits, temperature=2.0), (logits / 2).softmax(-1))


def test_greedy_rows_are_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2, 2.9], [5.0, 0.0, 0.0, 0.0]])
    probs = _probs(logits, temperature=[0.0, 1.0], top_k=[1, 0], top_p=[0.5, 1.0])
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(probs[1], logits[1].softmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax_with_ties_nans_and_infinities(dtype):
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 5.0, nan, 1.0], [1.0, nan, 7.0, 7.0], [-inf] * 4,
                         [inf, 1.0, inf, 0.0], [-2.0, -1.0, -1.0, -3.0]], dtype=dtype)
    logits = torch.randn(5, 49152, generator=torch.Generator().manual_seed(3)).to(dtype)
    for x in (rows, logits, logits[:, ::3], logits[2]):
        got = argmax_rows(x)
        assert got.dtype == torch.long and torch.equal(got, x.argmax(-1)), x.shape
    assert argmax_rows(rows).tolist() == [1, 0, 1, 0, 0, 1]


def test_top_k():
    logits = _log([0.1, 0.4, 0.2, 0.3])
    expected = torch.tensor([[0.0, 0.4, 0.0, 0.3]]) / 0.7
    torch.testing.assert_close(_probs(logits, top_k=2), expected)
    torch.testing.assert_close(_probs(logits, top_k=10), logits.softmax(-1))  # k > vocab_size


def test_top_p_keeps_smallest_set_with_mass_at_least_p():
    logits = _log([0.15, 0.5, 0.1, 0.25])
    # Ascending mass: 0.1, 0.25 (+0.15), 0.5, 1.0 -> drop the two whose total is <= 0.3.
    expected = torch.tensor([[0.0, 0.5, 0.0, 0.25]]) / 0.75
    torch.testing.assert_close(_probs(logits, top_p=0.7), expected)


def test_top_p_always_keeps_the_top_token():
    logits = _log([0.2, 0.6, 0.2])
    assert _probs(logits, top_p=0.01).tolist() == [[0.0, 1.0, 0.0]]


def test_top_k_then_top_p():
    logits = _log([0.05, 0.4, 0.3, 0.25])
    # Top-2 -> {0.4, 0.3} renormalized to {4/7, 3/7}; top_p 0.5 drops 3/7 (<= 0.5).
    assert _probs(logits, top_k=2, top_p=0.5).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_min_p():
    logits = _log([0.5, 0.3, 0.15, 0.05])
    # Threshold 0.4 * 0.5 = 0.2 keeps 0.5 and 0.3.
    expected = torch.tensor([[0.5, 0.3, 0.0, 0.0]]) / 0.8
    torch.testing.assert_close(_probs(logits, min_p=0.4), expected)


def test_filters_apply_only_to_their_rows():
    logits = _log([0.1, 0.4, 0.2, 0.3]).repeat(4, 1)
    probs = _probs(logits, top_k=[2, 0, 0, 0], top_p=[1.0, 0.5, 1.0, 1.0], min_p=[0.0, 0.0, 0.6, 0.0])
    full = torch.tensor([0.1, 0.4, 0.2, 0.3])
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.4, 0.0, 0.3]) / 0.7)
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 0.4, 0.0, 0.3]) / 0.7)
    torch.testing.assert_close(probs[2], torch.tensor([0.0, 0.4, 0.0, 0.3]) / 0.7)
    torch.testing.assert_close(probs[3], full)


def _ref_top_k_top_p(logits, top_k, top_p):
    """vLLM's `apply_top_k_top_p`: one full ascending sort, masks, scatter back."""
    vocab_size = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1)
    k = torch.where(top_k > 0, top_k.clamp_max(vocab_size), vocab_size)
    sorted_logits[sorted_logits < sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))] = float("-inf")
    is_dropped = sorted_logits.softmax(-1).cumsum(-1) <= (1 - top_p).unsqueeze(1)
    is_dropped[:, -1] = False
    sorted_logits[is_dropped] = float("-inf")
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits).softmax(-1)


@pytest.mark.parametrize(
    "nucleus_guess, logit_scale, is_full_sort",
    [(1024, 4.0, False), (30, 12.0, False), (30, 4.0, True), (3, 4.0, True)],
)
def test_top_k_top_p_matches_full_sort_reference(monkeypatch, nucleus_guess, logit_scale, is_full_sort):
    # Peaked rows keep their nucleus inside the guess; flat rows force the full sort.
    gen = torch.Generator().manual_seed(2)
    num_rows, vocab_size = 64, 200
    row_scales = logit_scale * (0.5 + 0.5 * torch.rand(num_rows, 1, generator=gen))
    is_boosted = torch.arange(vocab_size) < 3
    logits = (torch.randn(num_rows, vocab_size, generator=gen) + 2.0 * is_boosted) * row_scales
    top_k = torch.randint(0, 60, (num_rows,), generator=gen) * (torch.rand(num_rows, generator=gen) < 0.6)
    top_p = torch.where(torch.rand(num_rows, generator=gen) < 0.6, torch.rand(num_rows, generator=gen), 1.0)
    top_k[:3], top_p[:3] = torch.tensor([0, 25, 5]), torch.tensor([1.0, 0.9, 1.0])
    expected = _ref_top_k_top_p(logits, top_k, top_p)

    monkeypatch.setattr(sampling, "NUCLEUS_GUESS", nucleus_guess)
    monkeypatch.setattr(sampling, "MAX_CANDIDATES", 0)  # the partial sorts (test_candidates_... for the rest)
    num_sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **kw: num_sorts.append(1) or real_sort(*a, **kw))
    ones = torch.ones(num_rows)
    probs = logits_to_probs(logits, ones, top_k, top_p, torch.zeros(num_rows))
    torch.testing.assert_close(probs, expected)
    assert len(num_sorts) == int(is_full_sort)


@pytest.mark.parametrize("logit_scale", [1.0, 4.0, 12.0])
@pytest.mark.parametrize("vocab_size", [200, 5000])
def test_candidates_give_the_full_sorts_filters(monkeypatch, logit_scale, vocab_size):
    """Rows whose candidates (logits within CANDIDATE_MARGIN of the row's largest) hold what their
    filter keeps take the candidates' sort; the rest of the batch then the partial sorts: the same
    probabilities as the full-sort reference either way, and for a batch of peaked rows no top-k over
    a whole row."""
    gen = torch.Generator().manual_seed(5)
    num_rows = 12
    logits = torch.randn(num_rows, vocab_size, generator=gen) * logit_scale
    logits[:, :4] += 20.0 * torch.rand(num_rows, 1, generator=gen)  # some rows peaked
    logits[0, 3] = logits[0, 2]  # a tie at a boundary
    top_k = torch.tensor([0, 3, 4, 0, 40, 0, 2, 0, 10, 0, 0, 1])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.99, 1.0, 0.3, 0.8, 1.0, 0.95, 0.7, 1e-6, 1.0])
    expected = _ref_top_k_top_p(logits, top_k, top_p)
    for rows in (slice(None), slice(0, 3), slice(9, 12)):
        probs = logits_to_probs(logits[rows], torch.ones(12)[rows], top_k[rows], top_p[rows], torch.zeros(12)[rows])
        torch.testing.assert_close(probs, expected[rows])
    peaked = logits / logit_scale
    peaked[:, :4] += 30.0  # every row's mass in its top 4, within the margin: the candidates are enough
    real_topk, num_topk = torch.Tensor.topk, []
    monkeypatch.setattr(torch.Tensor, "topk", lambda *a, **kw: num_topk.append(1) or real_topk(*a, **kw))
    top_k = top_k.clamp_max(4)
    probs = logits_to_probs(peaked, torch.ones(12), top_k, top_p, torch.zeros(12))
    torch.testing.assert_close(probs, _ref_top_k_top_p(peaked, top_k, top_p))
    assert num_topk == []
    candidates = sampling._candidate_values(peaked, top_k, top_p, peaked.logsumexp(-1))
    assert candidates is not None and candidates.shape[0] == 12 and (candidates[:, 0] == peaked.amax(-1)).all()
    nan_row = peaked.clone()
    nan_row[3, 7] = float("nan")  # no candidates in that row (its max is NaN): the partial sorts
    assert sampling._candidate_values(nan_row, top_k, top_p, nan_row.logsumexp(-1)) is None
    monkeypatch.setattr(sampling, "MAX_CANDIDATES", 2)  # more candidates than that: the partial sorts
    assert sampling._candidate_values(peaked, top_k, top_p, peaked.logsumexp(-1)) is None


def _ref_repetition_penalty(logits, seen_token_ids, penalties):
    out = logits.clone()
    for row, (seen, penalty) in enumerate(zip(seen_token_ids, penalties)):
        for token_id in set(int(t) for t in seen):
            value = out[row, token_id]
            out[row, token_id] = value / penalty if value > 0 else value * penalty
    return out


def test_repetition_penalty_matches_loop_reference():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=gen)
    seen = [
        [1, 2, 2, 39],
        torch.tensor([0, 5, 7]),
        [],
        torch.randint(0, 40, (30,), generator=gen),
        [3, 4],
    ]
    penalties = [1.3, 0.8, 2.0, 1.7, 1.0]
    expected = _ref_repetition_penalty(logits, seen, penalties)
    out = apply_repetition_penalty(logits, seen, penalties)
    assert out is logits
    torch.testing.assert_close(out, expected)


def test_repetition_penalty_all_ones_is_a_no_op():
    logits = torch.randn(2, 8)
    before = logits.clone()
    apply_repetition_penalty(logits, [[1, 2], [3]], [1.0, 1.0])
    assert torch.equal(logits, before)


def test_sample_from_probs_inverts_the_cumulative_sum():
    probs = torch.tensor([[0.2, 0.8], [0.5, 0.5], [0.0, 1.0], [0.3, 0.0], [1.0, 0.0]])
    uniform = torch.tensor([0.19, 0.5, 0.0, 0.99, 0.9999999])
    assert sample_from_probs(probs, uniform).tolist() == [0, 1, 1, 0, 0]
    # a zero-probability token is never drawn, at either side of it; rows need not be normalized
    probs = torch.tensor([[0.0, 3.0, 0.0, 0.0, 1.0, 0.0]]).expand(5, 6)
    uniform = torch.tensor([0.0, 0.7499, 0.75, 0.9, 1 - 2**-24])
    assert sample_from_probs(probs, uniform).tolist() == [1, 1, 4, 4, 4]


def test_sample_from_probs_distribution(generator):
    probs = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4])
    num_rows = 100_000
    uniform = uniform_noise(1, num_rows, [generator])[0]
    counts = torch.bincount(sample_from_probs(probs.expand(num_rows, 5) * 3, uniform), minlength=5)
    sigma = (probs * (1 - probs) / num_rows).sqrt()
    assert counts[1] == 0 and ((counts / num_rows - probs).abs() <= 5 * sigma).all()


def test_uniform_noise_per_row_seeds_are_reproducible():
    def noise(seeds):
        generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        return uniform_noise(len(seeds), 32, generators)

    first = noise([7, None, 8])
    second = noise([None, 8, None, 7])
    assert torch.equal(first[0], second[3])
    assert torch.equal(first[2], second[1])
    assert not torch.equal(first[0], first[2])
    assert first.shape == (3, 32)
    with pytest.raises(ValueError, match="one generator"):
        uniform_noise(2, 4, [None])


def test_uniform_noise_seeded_and_in_range():
    u = uniform_noise(2, 1000, [torch.Generator().manual_seed(1), None])
    again = uniform_noise(1, 1000, [torch.Generator().manual_seed(1)])
    assert torch.equal(u[0], again[0])
    assert ((u >= 0) & (u < 1)).all()
    assert u.mean().item() == pytest.approx(0.5, abs=math.sqrt(1 / 12 / 2000) * 5)


def _row_settings():
    """(temperature, top_k, top_p, min_p) that narrow a row, and some that do not."""
    return [(1.0, 0, 0.9, 0.0), (0.7, 0, 0.5, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 40, 1.0, 0.0), (0.8, 40, 0.95, 0.05),
            (1.0, 0, 1.0, 0.1), (1.0, 0, 1.0, 1e-9), (1.3, 5, 0.7, 0.0), (1.0, 0, 0.999, 0.0), (1.0, 0, 1e-6, 0.0),
            (0.5, 0, 1.0, 0.0), (0.0, 0, 0.9, 0.0)]


@pytest.mark.parametrize("logit_scale", [0.5, 4.0, 12.0])
@pytest.mark.parametrize("vocab_size", [300, 5000])
def test_row_probs_equal_logits_to_probs(logit_scale, vocab_size):
    """A row's distribution over only the tokens it can draw: the same tokens and probabilities as
    logits_to_probs over the whole row, for flat rows (many candidates, a long nucleus), peaked ones,
    a top-k reaching past the margin, min-p's floor, ties at the boundary, a greedy row."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(8, vocab_size, generator=gen) * logit_scale
    logits[:4, :5] += 25.0 * torch.rand(4, 1, generator=gen)  # peaked rows
    logits[1, 7] = logits[1].max()  # a tie with the largest
    logits[2, 9] = logits[2].topk(3).values[-1]  # a tie with the third largest
    for temperature, top_k, top_p, min_p in _row_settings():
        expected = _probs(logits, temperature, top_k, top_p, min_p)
        for row, want in zip(logits, expected):
            got = sampling.row_probs(row, temperature, top_k, top_p, min_p)
            is_narrowed = temperature > 0 and (top_k > 0 or top_p < 1.0 or min_p > 0)
            if temperature == 0:
                assert got.ids is None  # logits_to_probs' one-hot
            else:
                assert isinstance(got, sampling.RowProbs if is_narrowed else sampling.SoftmaxRow), (top_k, top_p, min_p)
            dense = got.dense(vocab_size)
            # the same kept tokens, but for a flat row's long nucleus at top-p near 1, whose edge float32
            # sums over thousands of tokens (logits_to_probs) and float64 ones (row_probs) may place one
            # token apart
            differs = (dense > 0) ^ (want > 0)
            assert int(differs.sum()) <= (1 if top_p > 0.99 and logit_scale < 1 else 0), (temperature, top_k, top_p)
            rtol = 1e-5 if not differs.any() else 1e-3
            torch.testing.assert_close(dense[~differs], want[~differs], atol=1e-6, rtol=rtol)
            assert float(want[differs].sum() + dense[differs].sum()) < 1e-4
            if is_narrowed:
                assert (np.diff(got.ids) > 0).all() and (got.probs > 0).all()


def test_row_probs_prob_and_draw():
    row = torch.tensor([0.0, 3.0, 2.0, -9.0, 3.0, 1.0])
    narrowed = sampling.row_probs(row, 1.0, 0, 0.8)
    whole = sampling.row_probs(row, 1.0)
    dense = sampling.RowProbs(None, whole.dense(6).numpy())
    assert narrowed.ids.tolist() == [1, 2, 4] and isinstance(whole, sampling.SoftmaxRow)
    for dist in (narrowed, whole, dense):
        full = dist.dense(6)
        assert dist.prob(4) == pytest.approx(float(full[4])) and narrowed.prob(0) == 0.0
        cdf = full.double().cumsum(0) / full.double().sum()
        for u in (0.0, 0.2, 0.5, 0.999):
            assert dist.draw(u) == int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True))
        # the residual max(p - q, 0): here all of p's mass but token 1's
        q = torch.zeros(6)
        q[1] = 1.0
        assert {dist.draw(u, minus=q) for u in torch.linspace(0, 0.999, 50).tolist()} <= {0, 2, 3, 4, 5}
        assert {dist.draw(u, minus_token=1) for u in torch.linspace(0, 0.999, 50).tolist()} <= {0, 2, 3, 4, 5}
        assert dist.draw(0.3, minus=full * 1.01) == dist.draw(0.3)  # no residual mass: p itself
