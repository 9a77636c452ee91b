"""rejection_sample is lossless: a statistical test, deterministic under fixed seeds.

Each position i has its own fixed target distribution target_probs[i] and draft distribution
draft_probs[i], independent of earlier tokens, so the emitted tokens must be independent with
token i ~ target_probs[i]. V = 16, N = 200k rows in one batched call.
"""

import functools

import pytest
import torch

from tests.chi_square import chi_square_p_value

from spec.sampling import RowProbs, SoftmaxRow, logits_to_probs, row_probs
from spec.verify import rejection_sample, rejection_sample_rows

VOCAB_SIZE = 16
NUM_ROWS = 200_000
MIN_P_VALUE = 1e-6
CASES = [
    ("draft_equals_target", 2),
    ("disjoint_support", 3),
    ("one_hot_draft", 3),
    ("random_pair", 2),
    ("random_pair", 3),
    ("random_pair_mixed_k", 3),  # num_draft_tokens per row uniform in [0, 3]
]


def _random_probs(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:  # [*shape]
    """Dirichlet(1) rows."""
    x = torch.empty(shape).exponential_(generator=gen)
    return x / x.sum(-1, keepdim=True)


def _make_case(name: str, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(target_probs [k + 1, V], draft_probs [k, V]), a different target at each position."""
    target_probs = _random_probs((k + 1, VOCAB_SIZE), gen)
    if name == "draft_equals_target":
        draft_probs = target_probs[:k].clone()
    elif name == "disjoint_support":
        half = VOCAB_SIZE // 2
        target_probs[:, half:] = 0
        target_probs /= target_probs.sum(-1, keepdim=True)
        draft_probs = _random_probs((k, VOCAB_SIZE), gen)
        draft_probs[:, :half] = 0
        draft_probs /= draft_probs.sum(-1, keepdim=True)
    elif name == "one_hot_draft":
        draft_probs = torch.zeros(k, VOCAB_SIZE)
        draft_probs[torch.arange(k), target_probs[:k].argmax(-1)] = 1.0  # likely, not certain
    else:
        draft_probs = _random_probs((k, VOCAB_SIZE), gen)
    return target_probs, draft_probs


def _step(
    target_probs: torch.Tensor,  # [k + 1, V]
    draft_probs: torch.Tensor,  # [k, V]
    num_draft_tokens: torch.Tensor,  # [N]
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([N, k + 1], [N])
    """One speculative step for N rows: draft from draft_probs, then verify."""
    k = draft_probs.shape[0]
    # Inverse-CDF sampling of the drafts: N uniforms per position instead of N x V noise.
    cdfs = draft_probs.cumsum(-1)  # [k, V]
    cdfs[:, -1] = 1.0
    uniform = torch.rand(k, NUM_ROWS, generator=gen)  # [k, N]
    draft_token_ids = torch.searchsorted(cdfs, uniform, right=True).T.contiguous()  # [N, k]
    is_drafted = torch.arange(k) < num_draft_tokens.unsqueeze(1)
    draft_token_ids = torch.where(is_drafted, draft_token_ids, -1)
    return rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        draft_probs.expand(NUM_ROWS, -1, -1),
        target_probs.expand(NUM_ROWS, -1, -1),
        torch.rand(NUM_ROWS, k, generator=gen),
        torch.rand(NUM_ROWS, generator=gen),
    )


@functools.cache
def _simulate(name: str, k: int):
    """Two emitted tokens per row: a second step serves rows whose first step emitted one."""
    gen = torch.Generator().manual_seed(1234 + k)
    target_probs, draft_probs = _make_case(name, k, gen)
    if name.endswith("mixed_k"):
        num_draft_tokens = torch.randint(0, k + 1, (NUM_ROWS,), generator=gen)
    else:
        num_draft_tokens = torch.full((NUM_ROWS,), k)
    out, num_accepted = _step(target_probs, draft_probs, num_draft_tokens, gen)
    # The next step starts at position 1: the target there is target_probs[1].
    out_next, _ = _step(target_probs[1:], draft_probs[1:], (num_draft_tokens - 1).clamp_min(0), gen)
    second_token_ids = torch.where(num_accepted >= 1, out[:, 1], out_next[:, 0])  # [N]
    return target_probs, draft_probs, num_draft_tokens, out, num_accepted, second_token_ids


@pytest.mark.parametrize("name, k", CASES)
def test_first_token_follows_target(name, k):
    target_probs, _, _, out, _, _ = _simulate(name, k)
    assert chi_square_p_value(out[:, 0], target_probs[0]) > MIN_P_VALUE


@pytest.mark.parametrize("name, k", CASES)
def test_every_position_follows_target_once_reached(name, k):
    """Given that a step emits a token at position i, it is ~ target_probs[i] (covers bonus)."""
    target_probs, _, _, out, num_accepted, _ = _simulate(name, k)
    for position in range(k + 1):
        rows = num_accepted >= position
        assert (out[rows, position] >= 0).all() and (out[~rows, position] == -1).all()
        if rows.sum() >= 1000:
            assert chi_square_p_value(out[rows, position], target_probs[position]) > MIN_P_VALUE, position


@pytest.mark.parametrize("name, k", CASES)
def test_acceptance_rate_is_sum_of_min(name, k):
    target_probs, draft_probs, num_draft_tokens, _, num_accepted, _ = _simulate(name, k)
    # Position 0 over rows that drafted it; position 1 over rows that reached it.
    for position, rows in [
        (0, num_draft_tokens >= 1),
        (1, (num_draft_tokens >= 2) & (num_accepted >= 1)),
    ]:
        if not rows.any():  # disjoint support: nothing passes position 0
            continue
        expected = torch.minimum(target_probs[position], draft_probs[position]).sum().item()
        observed = (num_accepted[rows] > position).double().mean().item()
        sigma = (expected * (1 - expected) / rows.sum().item()) ** 0.5
        assert abs(observed - expected) <= 4 * sigma + 1e-6, (position, observed, expected)


@pytest.mark.parametrize("name, k", CASES)
def test_first_two_tokens_factorize_like_target(name, k):
    target_probs, _, _, out, _, second_token_ids = _simulate(name, k)
    assert not torch.allclose(target_probs[0], target_probs[1])
    pair_ids = out[:, 0] * VOCAB_SIZE + second_token_ids  # [N]
    pair_probs = torch.outer(target_probs[0], target_probs[1]).reshape(-1)  # [V * V]
    assert chi_square_p_value(pair_ids, pair_probs) > MIN_P_VALUE


def test_emitted_tokens_stay_in_target_top_k():
    k, top_k = 3, 4
    gen = torch.Generator().manual_seed(7)
    target_logits = torch.randn(k + 1, VOCAB_SIZE, generator=gen)  # [k + 1, V]
    ones = torch.ones(k + 1)
    target_probs = logits_to_probs(
        target_logits, ones, torch.full((k + 1,), top_k), ones, torch.zeros(k + 1)
    )  # [k + 1, V]
    draft_probs = _random_probs((k, VOCAB_SIZE), gen)  # full support, unfiltered
    out, num_accepted = _step(target_probs, draft_probs, torch.full((NUM_ROWS,), k), gen)

    is_top_k = torch.zeros(k + 1, VOCAB_SIZE, dtype=torch.bool)
    is_top_k.scatter_(1, target_logits.topk(top_k, dim=-1).indices, True)
    is_emitted = out >= 0  # [N, k + 1]
    positions = torch.arange(k + 1).expand(NUM_ROWS, -1)
    assert is_top_k[positions[is_emitted], out[is_emitted]].all()
    assert (num_accepted > 0).any() and (num_accepted < k).any()
    assert chi_square_p_value(out[:, 0], target_probs[0]) > MIN_P_VALUE


@pytest.mark.parametrize("name, k", CASES)
def test_one_row_at_a_time_equals_the_batch(name, k):
    """rejection_sample_rows (one request, the target's rows as RowProbs or SoftmaxRow, built only up
    to where the row stops) emits what rejection_sample does at the same uniforms: so it is lossless
    too."""
    gen = torch.Generator().manual_seed(99 + k)
    target_probs, draft_probs = _make_case(name, k, gen)
    num_trials = 400
    cdfs = draft_probs.cumsum(-1)  # [k, V]
    cdfs[:, -1] = 1.0
    drafts = torch.searchsorted(cdfs, torch.rand(k, num_trials, generator=gen), right=True).T  # [trials, k]
    uniform = torch.rand(num_trials, k + 1, generator=gen)
    sparse = [RowProbs(p.nonzero().squeeze(1).numpy(), p[p > 0].numpy()) for p in target_probs]  # narrowed rows
    dense = [RowProbs(None, p.numpy()) for p in target_probs]
    softmax = [row_probs(p.log(), 1.0) for p in target_probs]  # a temperature alone: SoftmaxRow
    assert all(isinstance(row, SoftmaxRow) for row in softmax)
    is_one_hot = name == "one_hot_draft"
    batch_out, batch_accepted = rejection_sample(drafts, torch.full((num_trials,), k),
                                                 draft_probs.expand(num_trials, -1, -1),
                                                 target_probs.expand(num_trials, -1, -1), uniform[:, :k], uniform[:, k])
    for trial in range(num_trials):
        built = []
        rows = (dense, sparse, softmax)[trial % 3]

        def target(i, rows=rows, built=built):
            built.append(i)
            return rows[i]

        tokens, accepted = rejection_sample_rows(drafts[trial].tolist(), target, None if is_one_hot else draft_probs,
                                                 uniform[trial].tolist())
        assert accepted == int(batch_accepted[trial])
        assert tokens == batch_out[trial, : accepted + 1].tolist()
        assert built == list(range(accepted + 1))  # no row past the first rejection
