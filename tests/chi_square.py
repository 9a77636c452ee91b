"""Chi-square goodness of fit for sampled tokens (speculative sampling must follow the target)."""

import torch


def chi_square_p_value(token_ids: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of the counts of token_ids [N] under probs [C]; cells expecting < 5 are pooled."""
    counts = torch.bincount(token_ids, minlength=len(probs)).double()  # [C]
    expected = probs.double() * len(token_ids)  # [C]
    assert counts[expected == 0].sum() == 0, "emitted a token the target gives probability 0"
    is_small = expected < 5
    counts = torch.cat([counts[~is_small], counts[is_small].sum(0, keepdim=True)])
    expected = torch.cat([expected[~is_small], expected[is_small].sum(0, keepdim=True)])
    keep = expected > 0
    counts, expected = counts[keep], expected[keep]
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(len(expected) - 1, dtype=torch.float64)
    return torch.special.gammaincc(df / 2, stat / 2).item()
