import numpy as np
import pytest

from spec.ngram import NgramProposer


def _propose(context, k=8, **kwargs):
    return NgramProposer(**kwargs).propose([context], [k]).token_ids[0]


def test_match_found_proposes_what_followed():
    assert _propose([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9, 2, 3]


def test_no_match_proposes_nothing():
    assert _propose([1, 2, 3, 4, 5]) == []


def test_prefers_longer_n_over_more_recent_shorter_match():
    # "3" recurs most recently at index 6 (followed by 8), but "2 3" recurs at index 1..2.
    context = [1, 2, 3, 7, 0, 5, 3, 8, 2, 3]
    assert _propose(context, k=2) == [7, 0]
    assert _propose(context, k=2, max_n=1) == [8, 2]


def test_most_recent_occurrence_wins():
    context = [5, 6, 1, 5, 6, 2, 5, 6]
    assert _propose(context, k=1) == [2]


def test_k_caps_and_max_draft_tokens_caps():
    context = [1, 2, 3, 4, 5, 6, 1]
    assert _propose(context, k=3) == [2, 3, 4]
    assert _propose(context, k=10, max_draft_tokens=2) == [2, 3]
    assert _propose(context, k=0) == []


def test_proposal_may_run_into_the_suffix_itself():
    # The only earlier "7 7" starts at 0; what follows runs to the end of the context.
    assert _propose([7, 7, 7], k=5) == [7]


def test_min_n_rejects_short_matches():
    context = [1, 2, 9, 4, 2]
    assert _propose(context, min_n=1) == [9, 4, 2]
    assert _propose(context, min_n=2) == []


def test_context_shorter_than_n():
    assert _propose([], k=3) == []
    assert _propose([4], k=3) == []
    assert _propose([4, 4], k=3, min_n=2, max_n=4) == []
    assert _propose([4, 4], k=3) == [4]
    assert _propose([4, 4], k=3, max_n=10) == [4]
    assert _propose([1, 4, 1, 4], k=3, max_n=10) == [1, 4]


def test_batch_and_ndarray_input():
    proposer = NgramProposer(max_draft_tokens=4)
    draft = proposer.propose([[1, 2, 1], [3, 4], [5, 6, 5, 6]], [2, 2, 8])
    assert draft.token_ids == [[2, 1], [], [5, 6]]
    assert draft.probs is None
    assert proposer.propose_one(np.array([1, 2, 1], dtype=np.int32), 2) == [2, 1]


def test_long_context_matches_naive_search():
    rng = np.random.default_rng(0)
    context = rng.integers(0, 5, size=4000).tolist()
    proposer = NgramProposer(min_n=2, max_n=5, max_draft_tokens=6)
    assert proposer.propose_one(context, 6) == _ref_propose(context, 2, 5, 6)
    for end in rng.integers(2, 4000, size=50):
        assert proposer.propose_one(context[:end], 6) == _ref_propose(context[:end], 2, 5, 6)


def _ref_propose(context, min_n, max_n, k):
    for n in range(max_n, min_n - 1, -1):
        suffix = context[-n:] if n <= len(context) else None
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


def test_invalid_arguments():
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)
    with pytest.raises(ValueError):
        NgramProposer(min_n=0)
