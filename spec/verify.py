"""Verification of draft tokens against the target: pure functions, randomness passed in.

Output convention (both functions): output tokens = accepted tokens + one recovered or
bonus token. Row b of `output_token_ids` [batch, k + 1] holds num_accepted[b] accepted draft
tokens, then one token sampled from the target, then -1 in every unused slot:

    drafts  [a, b, c]      target accepts a, rejects b
    output  [a, r, -1, -1] num_accepted = 1, r = recovered token
    drafts  [a, b, c]      all accepted
    output  [a, b, c, x]   num_accepted = 3, x = bonus token

So every row emits num_accepted + 1 tokens, also when it had no draft tokens (k = 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spec.sampling import RowDistribution, sample_from_probs


def verify_greedy(
    draft_token_ids: torch.Tensor,  # [batch, k] long, -1 padded
    num_draft_tokens: torch.Tensor,  # [batch] long, each in [0, k]
    target_argmax: torch.Tensor,  # [batch, k + 1] long: target argmax after each prefix
) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch, k + 1] long, -1 padded; [batch] long)
    """Greedy verification: accept drafts while draft == target argmax at that position.

    The first mismatch emits the target argmax there (recovered); if all num_draft_tokens[b]
    drafts match, target_argmax[b, num_draft_tokens[b]] is the bonus token. Returns
    (output_token_ids, num_accepted).
    """
    num_accepted = _count_accepted(draft_token_ids == target_argmax[:, :-1], num_draft_tokens)
    # Accepted drafts equal the target argmax, so the row is target_argmax up to num_accepted.
    positions = torch.arange(target_argmax.shape[1], device=target_argmax.device)  # [k + 1]
    is_emitted = positions.unsqueeze(0) <= num_accepted.unsqueeze(1)  # [batch, k + 1]
    output_token_ids = torch.where(is_emitted, target_argmax, -1)
    return output_token_ids, num_accepted


def verify_greedy_row(drafts: list[int], target_argmax: list[int]) -> list[int]:
    """verify_greedy for one sequence, in plain Python: drafts [k], target_argmax [k + 1] -> the
    emitted tokens (the accepted drafts, then the target's token after them). A step verifies a
    few ints per request; each torch op of the batched version costs 10-30 us in the engine (cold
    caches after a forward), and it took about ten."""
    if len(target_argmax) != len(drafts) + 1:
        raise ValueError(f"need k + 1 = {len(drafts) + 1} target tokens, got {len(target_argmax)}")
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return target_argmax[: n + 1]


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [batch, k] long, -1 padded
    num_draft_tokens: torch.Tensor,  # [batch] long, each in [0, k]
    draft_probs: torch.Tensor,  # [batch, k, vocab_size]: draft distribution of each draft token
    target_probs: torch.Tensor,  # [batch, k + 1, vocab_size]: target distribution per position
    uniform: torch.Tensor,  # [batch, k] float in [0, 1)
    sample_uniform: torch.Tensor,  # [batch] float in [0, 1), for the one sampled token
) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch, k + 1] long, -1 padded; [batch] long)
    """Speculative sampling (Leviathan et al., arXiv:2211.17192; Chen et al., arXiv:2302.01318).

    Draft i is accepted if uniform[b, i] < min(1, target_probs[x] / draft_probs[x]) for its
    token x, until the first rejection. At the first rejected position j the row emits a
    recovered token ~ normalize(max(target_probs[j] - draft_probs[j], 0)), or ~ target_probs[j]
    if that residual is all zero. If all num_draft_tokens[b] drafts are accepted it emits a
    bonus token ~ target_probs[b, num_draft_tokens[b]]. Either way the emitted sequence is
    distributed exactly as sampling from the target. One-hot draft_probs (n-gram or greedy
    drafts) are fine. Draft slots past num_draft_tokens[b] are ignored.
    Returns (output_token_ids, num_accepted).
    """
    batch_size, k = draft_token_ids.shape
    safe_token_ids = draft_token_ids.clamp_min(0).unsqueeze(-1)  # [batch, k, 1], -1 -> 0
    draft_token_probs = draft_probs.gather(2, safe_token_ids).squeeze(-1)  # [batch, k]
    target_token_probs = target_probs[:, :k].gather(2, safe_token_ids).squeeze(-1)  # [batch, k]
    # u < target / draft without dividing; draft 0 and target 0 rejects.
    is_accepted = uniform * draft_token_probs < target_token_probs  # [batch, k]
    num_accepted = _count_accepted(is_accepted, num_draft_tokens)

    # The one sampled position per row: j = num_accepted (a rejection or the bonus slot).
    rows = torch.arange(batch_size, device=draft_token_ids.device)  # [batch]
    target_probs_at_j = target_probs[rows, num_accepted]  # [batch, vocab_size]
    if k > 0:
        draft_probs_at_j = draft_probs[rows, num_accepted.clamp_max(k - 1)]  # [batch, vocab_size]
        residuals = (target_probs_at_j - draft_probs_at_j).clamp_min_(0)  # [batch, vocab_size]
        use_residual = (num_accepted < num_draft_tokens) & (residuals.sum(-1) > 0)  # [batch]
        probs_at_j = torch.where(use_residual.unsqueeze(1), residuals, target_probs_at_j)
    else:
        probs_at_j = target_probs_at_j
    # No normalization needed: sample_from_probs is invariant to scaling a row.
    sampled_token_ids = sample_from_probs(probs_at_j, sample_uniform)  # [batch]

    positions = torch.arange(k, device=draft_token_ids.device)  # [k]
    is_kept = positions.unsqueeze(0) < num_accepted.unsqueeze(1)  # [batch, k]
    output_token_ids = torch.full((batch_size, k + 1), -1, dtype=torch.long, device=rows.device)
    output_token_ids[:, :k] = torch.where(is_kept, draft_token_ids, -1)
    output_token_ids.scatter_(1, num_accepted.unsqueeze(1), sampled_token_ids.unsqueeze(1))
    return output_token_ids, num_accepted


def _count_accepted(
    is_accepted: torch.Tensor,  # [batch, k] bool, per position
    num_draft_tokens: torch.Tensor,  # [batch] long
) -> torch.Tensor:  # [batch] long
    """Length of the accepted prefix, counting only the first num_draft_tokens[b] drafts."""
    positions = torch.arange(is_accepted.shape[1], device=is_accepted.device)  # [k]
    is_drafted = positions.unsqueeze(0) < num_draft_tokens.unsqueeze(1)  # [batch, k]
    return (is_accepted & is_drafted).long().cumprod(dim=1).sum(dim=1)


def rejection_sample_rows(
    draft_token_ids: list[int],  # k
    target: Callable[[int], RowDistribution],  # i -> the target's distribution after the first i drafts
    draft_probs: torch.Tensor | None,  # [k, vocab_size]: each draft token's distribution; None = one-hot
    uniform: Sequence[float],  # [k + 1] in [0, 1): k acceptance tests, then the sampled token
) -> tuple[list[int], int]:  # (emitted tokens, num_accepted)
    """rejection_sample for one row, computing the target's distribution at a position only when the
    row gets there (an early rejection leaves the later rows alone) and without [vocab] tensors
    (RowDistribution: a filtered row's few tokens, or a softmax's normalizer). The same acceptance
    tests, recovered and bonus tokens as rejection_sample at the same uniforms, up to float rounding
    of the probabilities."""
    k = len(draft_token_ids)
    for i, token in enumerate(draft_token_ids):
        probs = target(i)
        draft_prob = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if not uniform[i] * draft_prob < probs.prob(token):  # draft 0 and target 0 rejects
            if draft_probs is None:
                return draft_token_ids[:i] + [probs.draw(uniform[k], minus_token=token)], i
            return draft_token_ids[:i] + [probs.draw(uniform[k], minus=draft_probs[i])], i
    return draft_token_ids + [target(k).draw(uniform[k])], k
