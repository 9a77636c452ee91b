"""Suffix proposals: the longest match wins, frequencies count, separators and limits hold."""

import numpy as np
import pytest

from spec.suffix import SuffixCorpus, SuffixDraft, SuffixProposer


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    #          [1 2 3 4] 5     ...     [3 4] 9   ...  suffix [1 2 3 4]
    ctx = [1, 2, 3, 4, 5, 6, 7, 3, 4, 9, 8, 1, 2, 3, 4]
    draft = SuffixProposer().propose(ctx, 8)
    assert draft.match_len == 4
    assert draft.token_ids[0] == 5  # what followed the 4-token match, not the later 2-token one


def test_frequencies_pick_the_continuation_and_narrow_the_occurrences():
    # [7 8] (each time after a different token) was followed by 1 twice and by 2 once; after
    # [7 8 1] came 5 both times
    ctx = [7, 8, 1, 5, 30, 7, 8, 2, 6, 31, 7, 8, 1, 5, 32, 7, 8]
    draft = SuffixProposer(min_prob=0.0).propose(ctx, 2)
    assert draft.token_ids == [1, 5]
    assert draft.counts == [2, 2] and draft.totals == [3, 2]
    assert draft.score == pytest.approx(2 / 3 + 2 / 3)


def test_the_walk_stops_below_min_prob_and_at_max_spec_factor():
    ctx = [5, 1, 8, 5, 2, 9, 5, 3, 7, 5]  # 5 was followed by 1, 2, 3: each 1/3
    assert SuffixProposer(min_prob=0.5).propose(ctx, 4).token_ids == []
    assert len(SuffixProposer(min_prob=0.3).propose(ctx, 4).token_ids) == 1
    long = list(range(20)) + [99] + list(range(20))
    # a 20-token match may propose up to 20 * factor tokens, a 1-token match only `factor`
    assert len(SuffixProposer(max_spec_factor=0.25).propose(long, 16).token_ids) == 5
    assert len(SuffixProposer(max_spec_factor=1.0).propose([4, 9, 9, 9, 4], 16).token_ids) == 1


def test_no_match_and_tiny_contexts():
    proposer = SuffixProposer()
    assert proposer.propose([], 4) == SuffixDraft([], [], [], 0)
    assert proposer.propose([1], 4).token_ids == []
    assert proposer.propose([1, 2, 3], 4).token_ids == []  # the last token never occurred before
    assert proposer.propose([1, 2, 1], 0).token_ids == []


def test_the_corpus_matches_other_replies_and_never_crosses_a_separator():
    corpus = SuffixCorpus()
    corpus.add([10, 11, 12, 13])
    corpus.add([20, 21])
    proposer = SuffixProposer()
    draft = proposer.propose([3, 10, 11], 8, corpus)
    assert draft.token_ids == [12, 13] and draft.match_len == 2  # stops at the reply's end
    assert proposer.propose([3, 21], 8, corpus).token_ids == []  # nothing follows 21
    # the own context wins when it scores higher
    assert proposer.propose([10, 11, 40, 41, 10, 11], 8, corpus).token_ids[0] in (12, 40)


def test_the_corpus_drops_its_oldest_replies():
    corpus = SuffixCorpus(max_tokens=6)
    corpus.add([1, 2, 3])
    corpus.add([4, 5, 6])
    corpus.add([7, 8])
    assert corpus.tokens.tolist() == [-1, 4, 5, 6, -1, 7, 8, -1]
    assert SuffixProposer().propose([0, 1], 4, corpus).token_ids == []


def test_propose_takes_an_array_and_is_quick_at_4k():
    import time

    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 32_000, size=4_000)
    ctx = np.concatenate([ctx, ctx[1000:1010]])
    corpus = SuffixCorpus()
    for _ in range(60):
        corpus.add(rng.integers(0, 32_000, size=1_000).tolist())
    proposer = SuffixProposer()
    start = time.process_time()  # CPU time: a paused or crowded process does not fail the test
    draft = proposer.propose(ctx, 8, corpus)
    assert draft.token_ids == ctx[1010:1018].tolist() and draft.match_len == 10
    assert time.process_time() - start < 0.05


def _random_case(rng: np.random.Generator) -> tuple[list[int], SuffixCorpus, int, SuffixProposer]:
    """A context and corpus over a small vocabulary (so matches, ties and long runs happen), and a
    proposer with random limits."""
    vocab = int(rng.integers(2, 12))
    ctx = rng.integers(0, vocab, size=int(rng.integers(0, 300))).tolist()
    corpus = SuffixCorpus(max_tokens=int(rng.integers(1, 400)))
    for _ in range(int(rng.integers(0, 6))):
        corpus.add(rng.integers(0, vocab, size=int(rng.integers(0, 80))).tolist())
    proposer = SuffixProposer(max_depth=int(rng.integers(1, 40)), max_spec_factor=float(rng.uniform(0.3, 3)),
                              min_prob=float(rng.choice([0.0, 0.05, 0.1, 0.5])),
                              max_candidates=int(rng.integers(1, 64)))
    return ctx, corpus, int(rng.integers(-1, 10)), proposer


def test_the_cpp_draft_is_the_numpy_reference():
    from kernels.suffix_ops import suffix_draft

    ids = np.arange(8, dtype=np.int64)
    assert suffix_draft(ids, ids, True, 4, 8, 1.0, 0.1, 16) is not None  # the C++ path is the one tested
    rng = np.random.default_rng(7)
    for _ in range(3000):
        ctx, corpus, max_tokens, proposer = _random_case(rng)
        arr = np.fromiter(ctx, np.int64, len(ctx))
        for haystack, is_self in ((arr, True), (corpus.tokens, False)):
            fast = proposer._draft(haystack, arr, max_tokens, is_self)
            assert fast == proposer._draft_ref(haystack, arr, max_tokens, is_self), (ctx, max_tokens, is_self)


def test_the_cpp_draft_checks_its_arrays():
    from kernels.suffix_ops import suffix_draft

    ids = np.arange(8, dtype=np.int64)
    with pytest.raises(RuntimeError, match="int64"):
        suffix_draft(ids.astype(np.int32), ids, True, 4, 8, 1.0, 0.1, 16)
    with pytest.raises(RuntimeError, match="contiguous"):
        suffix_draft(ids, ids[::2], True, 4, 8, 1.0, 0.1, 16)


def test_token_array_follows_an_appended_list_and_starts_over_when_it_shrinks():
    from spec.proposer import TokenArray

    tokens, arr = [], TokenArray()
    rng = np.random.default_rng(0)
    views = []
    for _ in range(200):
        tokens += rng.integers(0, 50_000, size=int(rng.integers(0, 40))).tolist()
        view = arr.of(tokens)
        assert view.dtype == np.int64 and view.tolist() == tokens
        views.append((view, list(tokens)))
    assert all(v.tolist() == t for v, t in views)  # earlier views still hold their tokens
    assert arr.of([3, 2, 1]).tolist() == [3, 2, 1] and arr.of([]).tolist() == []


def test_an_offer_prices_a_long_match_above_a_one_token_match():
    """SuffixMethod.offer prices each draft by its depth (the matched context it continues) and the
    share of earlier occurrences it followed: a lone one-token match is worth less than a draft after
    four matched tokens, a split continuation less than a unanimous one, and deeper drafts of a
    walk more than its first."""
    from chatserve.config import SpecConfig
    from chatserve.request import Request
    from chatserve.sampling_params import SamplingParams
    from chatserve.spec_methods import SpecState
    from chatserve.spec_methods.suffix import SuffixMethod, position_price

    method = SuffixMethod(SpecConfig(method="suffix", suffix_corpus_tokens=0))

    def offer(prompt):
        req = Request("r", prompt, SamplingParams(temperature=0.0))
        req.spec = SpecState((method,))
        return method.offer(req, 4, 0.6)

    one = offer([5, 9, 8, 7, 5])  # [5] once before, then 9
    long = offer([1, 2, 3, 4, 9, 8, 7, 6, 1, 2, 3, 4])  # [1 2 3 4] once before, then 9 8 7 6
    split = offer([5, 9, 5, 7, 5])  # [5] twice before: 9 and 7
    assert one.token_ids == [9] and long.token_ids == [9, 8, 7, 6] and split.token_ids[:1] in ([7], [9])
    assert one.gains == [pytest.approx(position_price(1, 1, 1, 0.6))]
    assert one.gains[0] < 0.5 < long.gains[0]
    assert split.gains[0] == pytest.approx(one.gains[0] / 2)
    conditional = [b / a for a, b in zip(long.gains, long.gains[1:])]
    assert all(c >= long.gains[0] for c in conditional), conditional
    assert position_price(1, 1, 1, 0.9) > position_price(1, 1, 1, 0.1)  # the measured rate pulls
