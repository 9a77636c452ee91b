"""A row of logits at a temperature (kernels/sampling_ops.py): the C++ against the plain-torch references."""

import math

import numpy as np
import pytest
import torch

from kernels import sampling_ops

# sizes: a few whole AVX2 vectors, a ragged tail, a real vocabulary
SIZES = [8, 37, 1000, 49_152]


def _row(size: int, generator: torch.Generator, scale: float = 4.0) -> torch.Tensor:
    row = torch.randn(size, generator=generator) * scale
    row[size // 3] = float("-inf")  # a grammar's masked token
    return row


def test_the_c_plus_plus_path_is_the_one_tested():
    assert sampling_ops.usable(torch.zeros(8))
    assert not sampling_ops.usable(torch.zeros(8, dtype=torch.float64)) and not sampling_ops.usable(torch.zeros(2, 8))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_row_softmax(size, temperature, generator):
    row = _row(size, generator)
    row[size // 2] = row.max()  # a tie with the largest
    top, total = sampling_ops.row_softmax(row, temperature)
    ref_top, ref_total = sampling_ops.row_softmax_ref(row, temperature)
    assert top == ref_top  # the same float32 division
    assert total == pytest.approx(ref_total, rel=1e-6) and total >= 2.0  # the two largest tokens' own weights
    row[size - 1] = float("nan")  # in the ragged tail for 37
    assert all(math.isnan(x) for x in sampling_ops.row_softmax(row, temperature))
    assert all(math.isnan(x) for x in sampling_ops.row_softmax_ref(row, temperature))


@pytest.mark.parametrize("size", [37, 1000, 49_152])
@pytest.mark.parametrize("residual", [None, "minus", "minus_token"])
def test_row_draw(size, residual, generator):
    """The same tokens as the reference's inverse CDF at 200 uniforms (up to the exp's rounding at a
    boundary: at most one differs), never a token of weight 0, and never the one-hot's token."""
    row = _row(size, generator, scale=1.0)
    temperature = 0.8
    top, total = sampling_ops.row_softmax(row, temperature)
    probs = torch.softmax(row / temperature, 0)
    minus, minus_token = None, -1
    if residual == "minus":
        minus = torch.softmax(torch.randn(size, generator=generator), 0)
    elif residual == "minus_token":
        minus_token = int(probs.argmax())
    uniforms = torch.rand(200, generator=generator).tolist() + [0.0, 1 - 2**-24]
    got = [sampling_ops.row_draw(row, temperature, top, total, u, minus, minus_token) for u in uniforms]
    want = [sampling_ops.row_draw_ref(row, temperature, top, total, u, minus, minus_token) for u in uniforms]
    assert sum(a != b for a, b in zip(got, want)) <= 1
    assert all(probs[t] > 0 for t in got) and minus_token not in got
    if minus is not None:
        assert all(probs[t] > minus[t] for t in got)  # the residual's support


def test_row_draw_without_residual_mass_draws_the_row(generator):
    row = _row(1000, generator)
    top, total = sampling_ops.row_softmax(row, 1.0)
    covering = torch.softmax(row, 0) * 1.01  # covers the row everywhere: max(p - q, 0) = 0
    for u in (0.1, 0.5, 0.9):
        drawn = sampling_ops.row_draw(row, 1.0, top, total, u, covering)
        assert drawn == sampling_ops.row_draw(row, 1.0, top, total, u)
    one_token = torch.full((8,), float("-inf"))
    one_token[5] = 0.0  # the only drawable token is the one-hot's: no residual, the row itself
    assert sampling_ops.row_draw(one_token, 1.0, 0.0, 1.0, 0.5, None, 5) == 5


SETTINGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 0.9, 0.0), (0.7, 0, 0.5, 0.0), (1.0, 3, 1.0, 0.0), (1.0, 40, 1.0, 0.0), (0.8, 40, 0.95, 0.05),
    (1.0, 0, 1.0, 0.1), (1.0, 0, 1.0, 1e-9), (1.3, 5, 0.7, 0.0), (1.0, 0, 0.999, 0.0), (1.0, 0, 1e-6, 0.0),
    (1.0, 2000, 0.9, 0.0), (0.6, 0, 0.95, 0.0),
]


@pytest.mark.parametrize("size", [37, 5000, 49_152])
@pytest.mark.parametrize("scale", [0.5, 4.0, 12.0])
def test_row_kept(size, scale, generator):
    """The same kept tokens as the reference and the same probabilities (float64 sums in another
    order, and the C++ exp's rounding where the whole row is summed), for flat and peaked rows, ties,
    a masked token, long nuclei (past the guess of 1,024), a top-k past the margin."""
    rows = [_row(size, generator, scale) for _ in range(3)]
    rows[1][:5] += 25.0  # peaked
    rows[2][7] = rows[2].max()  # a tie with the largest
    margin, guess = 16.0, 1024
    for row in rows:
        for temperature, top_k, top_p, min_p in SETTINGS:
            offset = -math.log(min_p) if min_p > 0 else math.inf
            got = sampling_ops.row_kept(row, temperature, top_k, top_p, offset, margin, guess)
            want = sampling_ops.row_kept_ref(row, temperature, top_k, top_p, offset, margin, guess)
            assert (got is None) == (want is None), (temperature, top_k, top_p, min_p)
            if got is not None:
                assert len(got[0]) > 0
                np.testing.assert_array_equal(got[0], want[0])
                np.testing.assert_allclose(got[1], want[1], rtol=1e-9, atol=1e-15)


def test_row_kept_sums_the_whole_row_only_when_the_tail_bound_is_unsure(monkeypatch):
    """Top-p alone normalizes by the whole row; the tokens below the candidates hold at most
    (vocab - m) e^-margin of the largest's mass: the row is summed only when that could move the
    nucleus, and then the nucleus is the full sort's."""
    vocab_size = 20_000
    row = torch.full((vocab_size,), -17.0)  # a tail just below the margin: 2e4 x e^-17 ~ 8e-4 of the top
    row[:4] = torch.tensor([0.0, -0.5, -1.0, -1.5])
    expected = torch.softmax(row, 0).sort(descending=True).values.cumsum(0)
    sums = []
    real_sum = sampling_ops.row_weight_sum_ref
    monkeypatch.setattr(sampling_ops, "row_weight_sum_ref", lambda *a: sums.append(1) or real_sum(*a))
    far = sampling_ops.row_kept_ref(row, 1.0, 0, 0.5, math.inf, 16.0, 1024)  # 2 tokens whatever the tail holds
    assert sums == [] and far[0].tolist() == [0, 1]
    edge = float(expected[1]) + 1e-5  # where the two ends of the bound give 2 and 3 tokens: the row says 3
    near = sampling_ops.row_kept_ref(row, 1.0, 0, edge, math.inf, 16.0, 1024)
    assert sums == [1] and near[0].tolist() == [0, 1, 2]
    for top_p, kept in ((0.5, [0, 1]), (edge, [0, 1, 2])):
        assert sampling_ops.row_kept(row, 1.0, 0, top_p, math.inf, 16.0, 1024)[0].tolist() == kept


def test_row_kept_of_a_nan_row():
    row = torch.zeros(37)
    row[35] = float("nan")  # in the ragged tail
    for fn in (sampling_ops.row_kept, sampling_ops.row_kept_ref):
        assert fn(row, 1.0, 0, 0.9, math.inf, 16.0, 1024) is None
