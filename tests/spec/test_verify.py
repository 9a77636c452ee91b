"""Hand-written verification cases (vLLM test_perfect_match / test_early_mismatch style)."""

import pytest
import torch

from spec.proposer import Draft, one_hot_draft_probs
from spec.verify import rejection_sample, verify_greedy, verify_greedy_row

VOCAB_SIZE = 100


def _logits_spelling(token_ids: list[list[int]]) -> torch.Tensor:  # [batch, k + 1, vocab_size]
    """Target logits whose argmax at each position is the given token."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(token_ids), len(token_ids[0]), VOCAB_SIZE, generator=gen)
    logits.scatter_(2, torch.tensor(token_ids).unsqueeze(-1), 100.0)
    return logits


def _greedy(drafts: list[list[int]], target: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    max_k = len(target[0]) - 1
    draft_token_ids, num_draft_tokens = Draft(token_ids=drafts).to_tensors(num_cols=max_k)
    target_argmax = _logits_spelling(target).argmax(-1)  # [batch, k + 1]
    output_token_ids, num_accepted = verify_greedy(draft_token_ids, num_draft_tokens, target_argmax)
    return output_token_ids.tolist(), num_accepted.tolist()


def test_greedy_perfect_match_emits_bonus():
    assert _greedy([[1, 2, 3]], [[1, 2, 3, 4]]) == ([[1, 2, 3, 4]], [3])


def test_greedy_first_rejected():
    assert _greedy([[1, 2, 3]], [[5, 2, 3, 4]]) == ([[5, -1, -1, -1]], [0])


def test_greedy_early_mismatch():
    assert _greedy([[1, 2, 3]], [[1, 5, 3, 4]]) == ([[1, 5, -1, -1]], [1])


def test_greedy_last_rejected():
    assert _greedy([[1, 2, 3]], [[1, 2, 5, 4]]) == ([[1, 2, 5, -1]], [2])


def test_greedy_no_drafts_k0():
    assert _greedy([[], []], [[7], [8]]) == ([[7], [8]], [0, 0])


def test_greedy_mixed_rows_and_padding():
    drafts = [[1, 2, 3], [1, 2], [], [4, 5, 6], [9]]
    target = [
        [1, 2, 3, 4],  # all accepted -> bonus 4
        [1, 2, 7, 8],  # both drafts accepted -> bonus 7; target beyond num_draft ignored
        [6, 1, 2, 3],  # no drafts -> emits 6
        [4, 0, 6, 7],  # mismatch at 1
        [9, 9, 9, 9],  # one draft accepted -> bonus 9
    ]
    out, num_accepted = _greedy(drafts, target)
    assert out == [[1, 2, 3, 4], [1, 2, 7, -1], [6, -1, -1, -1], [4, 0, -1, -1], [9, 9, -1, -1]]
    assert num_accepted == [3, 2, 0, 1, 1]


def test_greedy_ignores_drafts_past_num_draft_tokens():
    # A stale draft slot that happens to match must not count.
    draft_token_ids = torch.tensor([[1, 2]])
    target_argmax = torch.tensor([[1, 2, 3]])
    out, num_accepted = verify_greedy(draft_token_ids, torch.tensor([1]), target_argmax)
    assert out.tolist() == [[1, 2, -1]] and num_accepted.tolist() == [1]


def test_one_rows_greedy_verification_is_the_batched_one():
    gen = torch.Generator().manual_seed(1)
    for _ in range(500):
        k = int(torch.randint(0, 6, (1,), generator=gen))
        target = torch.randint(0, 3, (k + 1,), generator=gen).tolist()  # 3 ids: many matches
        drafts = torch.randint(0, 3, (k,), generator=gen).tolist()
        out, num_accepted = _greedy([drafts], [target])
        emitted = verify_greedy_row(drafts, target)
        assert emitted == [t for t in out[0] if t != -1] and len(emitted) == num_accepted[0] + 1
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify_greedy_row([1, 2], [1, 2])


def _one_hots(token_ids: list[list[int]], vocab_size: int) -> torch.Tensor:  # [batch, n, vocab_size]
    return one_hot_draft_probs(torch.tensor(token_ids), vocab_size)


def test_rejection_sample_one_hot_target_and_draft_is_greedy():
    drafts = [[1, 2, 3], [1, 2, 3], [1, 2, 3]]
    target = [[1, 2, 3, 0], [1, 0, 3, 0], [3, 2, 3, 1]]
    draft_token_ids = torch.tensor(drafts)
    out, num_accepted = rejection_sample(
        draft_token_ids,
        torch.tensor([3, 3, 3]),
        one_hot_draft_probs(draft_token_ids, 4),
        _one_hots(target, 4),
        uniform=torch.full((3, 3), 0.999),
        sample_uniform=torch.zeros(3),
    )
    assert out.tolist() == [[1, 2, 3, 0], [1, 0, -1, -1], [3, -1, -1, -1]]
    assert num_accepted.tolist() == [3, 1, 0]


def test_rejection_sample_uses_uniform_threshold_and_residual():
    # Draft token 0 has draft prob 0.8 and target prob 0.4: accepted iff uniform < 0.5.
    draft_probs = torch.tensor([[[0.8, 0.2, 0.0]]]).repeat(2, 1, 1)
    target_probs = torch.tensor([[[0.4, 0.1, 0.5], [0.0, 1.0, 0.0]]]).repeat(2, 1, 1)
    out, num_accepted = rejection_sample(
        torch.tensor([[0], [0]]),
        torch.tensor([1, 1]),
        draft_probs,
        target_probs,
        uniform=torch.tensor([[0.49], [0.51]]),
        sample_uniform=torch.zeros(2),
    )
    # Row 0: accepted, bonus from target position 1 = token 1. Row 1: residual is [0, 0, 0.5].
    assert out.tolist() == [[0, 1], [2, -1]]
    assert num_accepted.tolist() == [1, 0]


def test_rejection_sample_zero_residual_falls_back_to_target():
    # With normalized probs a rejection implies some residual mass; rounding (or, here, an
    # unnormalized target) can leave target <= draft everywhere, so the residual is all zero.
    draft_probs = torch.tensor([[[0.5, 0.5]]])
    target_probs = torch.tensor([[[0.0, 0.5], [0.5, 0.5]]])  # unnormalized on purpose
    uniform, sample_uniform = torch.tensor([[0.0]]), torch.zeros(1)
    out, num_accepted = rejection_sample(
        torch.tensor([[0]]), torch.tensor([1]), draft_probs, target_probs, uniform, sample_uniform
    )
    assert out.tolist() == [[1, -1]] and num_accepted.tolist() == [0]


def test_rejection_sample_k0_and_zero_draft_rows_emit_from_target():
    target_probs = torch.tensor([[[0.0, 1.0, 0.0]]])
    out, num_accepted = rejection_sample(
        torch.zeros(1, 0, dtype=torch.long),
        torch.tensor([0]),
        torch.zeros(1, 0, 3),
        target_probs,
        torch.zeros(1, 0),
        torch.zeros(1),
    )
    assert out.tolist() == [[1]] and num_accepted.tolist() == [0]

    draft_token_ids = torch.tensor([[2, -1], [-1, -1]])
    out, num_accepted = rejection_sample(
        draft_token_ids,
        torch.tensor([1, 0]),
        one_hot_draft_probs(draft_token_ids, 3),
        _one_hots([[2, 0, 1], [1, 2, 2]], 3),
        torch.zeros(2, 2),
        torch.zeros(2),
    )
    assert out.tolist() == [[2, 0, -1], [1, -1, -1]]
    assert num_accepted.tolist() == [1, 0]


def test_one_hot_draft_probs_padding_is_zero():
    probs = one_hot_draft_probs(torch.tensor([[2, -1]]), 3)
    assert probs.tolist() == [[[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]]


def test_draft_to_tensors():
    draft_token_ids, num_draft_tokens = Draft(token_ids=[[5, 6], [], [7]]).to_tensors()
    assert draft_token_ids.tolist() == [[5, 6], [-1, -1], [7, -1]]
    assert num_draft_tokens.tolist() == [2, 0, 1]
    draft_token_ids, _ = Draft(token_ids=[[1]], probs=torch.zeros(1, 3, 4)).to_tensors()
    assert draft_token_ids.shape == (1, 3)
