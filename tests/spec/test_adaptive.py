import pytest

from spec.adaptive import (AdaptiveDraftLength, allocate_drafts, chain_drafts, chain_stop_gains, geometric_gains,
                           step_seconds, stop_probability)


def _linear(per_row: float = 0.05):
    """A target forward costing 1 for one row plus per_row for each extra row."""
    return lambda rows: 1.0 + per_row * (rows - 1)


def _step(controllers, target, draft=None) -> list[int]:
    """One engine step over these requests: offer, allocate over the batch, report the ks."""
    offers = [c.offer() for c in controllers]
    ks = allocate_drafts([geometric_gains(a, cap) for cap, a in offers], target, draft)
    for c, k in zip(controllers, ks):
        c.allocated(k)
    return ks


def _run(controller: AdaptiveDraftLength, accepts: bool, num_steps: int, draft_cost: float = 0.1) -> list[int]:
    """Drive one request with drafts that are all accepted or all rejected; return the ks."""
    ks = []
    for _ in range(num_steps):
        k = _step([controller], _linear(), lambda rows: draft_cost)[0]
        ks.append(k)
        controller.update(k, k if accepts else 0)
    return ks


def test_high_acceptance_grows_k_to_max():
    controller = AdaptiveDraftLength(max_k=8, initial_accept_rate=0.5)
    ks = _run(controller, accepts=True, num_steps=40)
    assert 0 < ks[0] < 8
    assert ks[-1] == 8
    assert controller.accept_rate > 0.95


def test_low_acceptance_drops_to_zero_then_probes_and_recovers():
    controller = AdaptiveDraftLength(max_k=4, probe_every=5)
    ks = _run(controller, accepts=False, num_steps=40)
    assert ks[0] > 0
    first_zero = ks.index(0)
    later = ks[first_zero:]
    probes = [i for i, k in enumerate(later) if k > 0]
    assert probes and all(b - a == 5 for a, b in zip(probes, probes[1:]))
    assert len(probes) >= 5
    # Once drafts start being accepted again, a probe brings speculation back.
    ks = _run(controller, accepts=True, num_steps=15)
    assert ks[-1] > 0 and all(k > 0 for k in ks[-5:])


def test_update_counts_the_rejected_position_only_when_there_is_one():
    controller = AdaptiveDraftLength(max_k=4, ema=1.0)
    controller.update(4, 4)
    assert controller.accept_rate == 1.0
    controller.update(4, 1)
    assert controller.accept_rate == 0.5
    controller.update(0, 0)  # no drafts: no information
    assert controller.accept_rate == 0.5


def test_draft_costs_change_the_choice():
    def k_at(draft_cost: float) -> int:
        controller = AdaptiveDraftLength(max_k=8, ema=1.0)
        controller.update(8, 7)  # alpha = 7 / 8
        return _step([controller], _linear(0.01), lambda rows: draft_cost)[0]

    cheap, dear, too_dear = k_at(0.05), k_at(0.4), k_at(1.0)
    assert cheap > dear > 0
    assert too_dear == 0


def test_larger_batch_drafts_less():
    """At alpha = 7/8 a request drafts less the more rows the step already has: past ~20 rows
    a draft row (0.02) buys less than the batch's own tokens per second."""
    per_request = []
    for batch_size in (1, 8, 64, 1024):
        controllers = [AdaptiveDraftLength(max_k=8, ema=1.0) for _ in range(batch_size)]
        for c in controllers:
            c.update(8, 7)
        ks = _step(controllers, _linear(0.02), lambda rows: 0.1 + 0.002 * rows)
        per_request.append(sum(ks) / batch_size)
    assert per_request == sorted(per_request, reverse=True)
    assert per_request[0] > per_request[-1] == 0


def test_min_accept_rate_forces_zero():
    controller = AdaptiveDraftLength(max_k=4, ema=1.0, min_accept_rate=0.6)
    controller.update(4, 1)  # alpha = 0.5: profitable with free drafts, but below the floor
    assert controller.offer() == (0, 0.5)
    assert _step([controller], _linear(0.0)) == [0]


def test_invalid_update():
    with pytest.raises(ValueError):
        AdaptiveDraftLength(max_k=4).update(2, 3)


# ---------------------------------------------------------------- batch-level allocation

def _gains(rates, caps):
    return [geometric_gains(r, c) for r, c in zip(rates, caps)]


def _tiled(rows: int) -> float:
    """Like torch's packed int8 GEMV on this CPU: rows go in tiles of 4, each a pass over the weights."""
    return 1.0 + ((rows + 3) // 4 - 1) * 0.95


def _brute_force(rates, caps, target, draft=None, setup=None):
    """Best expected tokens per second over every k vector (small cases only)."""
    import itertools

    best, best_rate = [0] * len(caps), len(caps) / target(len(caps))
    for ks in itertools.product(*(range(c + 1) for c in caps)):
        tokens = sum(sum(r ** j for j in range(k + 1)) for r, k in zip(rates, ks))
        seconds = target(len(caps) + sum(ks)) + sum(u for u, k in zip(setup or [0] * len(ks), ks) if k)
        if draft is not None:
            seconds += sum(draft(sum(k >= s for k in ks)) for s in range(1, max(ks, default=0) + 1) if any(k >= s for k in ks))
        if tokens / seconds > best_rate + 1e-12:
            best, best_rate = list(ks), tokens / seconds
    return best, best_rate


def _rate(rates, ks, target, draft=None, setup=None):
    tokens = sum(sum(r ** j for j in range(k + 1)) for r, k in zip(rates, ks))
    seconds = target(len(ks) + sum(ks)) + sum(u for u, k in zip(setup or [0] * len(ks), ks) if k)
    if draft is not None:
        seconds += sum(draft(sum(k >= s for k in ks)) for s in range(1, max(ks, default=0) + 1) if any(k >= s for k in ks))
    return tokens / seconds


@pytest.mark.parametrize("seed", range(40))
def test_allocate_drafts_is_optimal_without_a_draft_model(seed):
    """Free proposals (n-gram): the scan over n finds the best of all k vectors (checked by enumeration)."""
    import random

    rng = random.Random(seed)
    b = rng.randint(1, 4)
    rates = [rng.choice([0.0, 0.1, 0.5, 0.8, 0.95, 1.0, rng.random()]) for _ in range(b)]
    caps = [rng.randint(0, 4) for _ in range(b)]
    ks = allocate_drafts(_gains(rates, caps), _tiled)
    assert all(0 <= k <= c for k, c in zip(ks, caps))
    _, best_rate = _brute_force(rates, caps, _tiled)
    assert _rate(rates, ks, _tiled) == pytest.approx(best_rate)


@pytest.mark.parametrize("seed", range(20))
def test_allocate_drafts_with_a_draft_model_is_near_the_best(seed):
    """With draft steps priced per active sequence the scan is a heuristic: within 3% of the best here."""
    import random

    rng = random.Random(seed)
    b = rng.randint(1, 3)
    rates = [rng.choice([0.3, 0.6, 0.8, 0.9, rng.random()]) for _ in range(b)]
    caps = [rng.randint(0, 4) for _ in range(b)]
    draft = lambda rows: 0.25 + 0.02 * rows  # noqa: E731
    ks = allocate_drafts(_gains(rates, caps), _tiled, draft)
    _, best_rate = _brute_force(rates, caps, _tiled, draft)
    assert _rate(rates, ks, _tiled, draft) >= 0.97 * best_rate


def _scan_every_limit(gains, target, draft, runs_model):
    """allocate_drafts' scan as first written (no setups, no bound): every limit K on the draft steps
    from 1 to the largest cap, every n, every price looked up afresh."""
    b = len(gains)
    best_rate, best = b / target(b), []
    chosen_all = sorted(((g[j - 1], -j, i) for i, g in enumerate(gains) for j in range(1, len(g) + 1)), reverse=True)
    for limit in range(1, max(map(len, gains)) + 1):
        chosen = [c for c in chosen_all if -c[1] <= limit]
        tokens, active = float(b), [0] * (limit + 1)
        for n, (gain, neg_j, i) in enumerate(chosen, start=1):
            tokens += gain
            if runs_model[i]:
                active[-neg_j] += 1
            seconds = target(b + n) + sum(draft(a) for a in active[1:] if a)
            if tokens / seconds > best_rate:
                best_rate, best = tokens / seconds, chosen[:n]
    ks = [0] * b
    for _, _, i in best:
        ks[i] += 1
    return ks


@pytest.mark.parametrize("seed", range(60))
def test_allocate_drafts_scans_only_the_limits_on_draft_steps_that_can_matter(seed):
    """Free proposals of up to 16 beside a head's or a draft model's 4 (an EAGLE request with suffix
    proposals): limits on the draft steps past the model-run sequences' caps are skipped, and the
    allocation is the one the scan over every limit finds."""
    import random

    rng = random.Random(900 + seed)
    b = rng.randint(1, 4)
    runs_model = [rng.random() < 0.5 for _ in range(b)]
    caps = [rng.randint(0, 4) if m else rng.randint(0, 16) for m in runs_model]
    rates = [rng.choice([0.3, 0.5, 0.8, 0.95, rng.random()]) for _ in range(b)]
    gains = [sorted((rng.random() for _ in range(c)), reverse=True) if not m and rng.random() < 0.5
             else geometric_gains(r, c) for m, r, c in zip(runs_model, rates, caps)]
    draft = lambda rows: rng.choice([0.02, 0.1, 0.3]) + 0.02 * rows  # noqa: E731
    cost = draft(1)
    draft = lambda rows: cost + 0.02 * rows  # noqa: E731
    for target in (_tiled, lambda rows: 1.0 + 0.1 * (rows - 1)):
        assert allocate_drafts(gains, target, draft, runs_model) == _scan_every_limit(gains, target, draft, runs_model)


@pytest.mark.parametrize("seed", range(20))
def test_step_seconds_prices_a_step_as_allocate_drafts_does(seed):
    import random

    rng = random.Random(200 + seed)
    b = rng.randint(1, 4)
    ks = [rng.randint(0, 5) for _ in range(b)]
    setup = [rng.choice([0.0, 0.3, 1.0]) for _ in range(b)]
    runs_model = [rng.random() < 0.5 for _ in range(b)]
    draft = lambda rows: 0.25 + 0.02 * rows  # noqa: E731
    model_ks = [k if m else 0 for k, m in zip(ks, runs_model)]
    want = (_tiled(b + sum(ks)) + sum(u for u, k in zip(setup, ks) if k)
            + sum(draft(sum(k >= s for k in model_ks)) for s in range(1, max(model_ks) + 1) if any(k >= s for k in model_ks)))
    assert step_seconds(ks, _tiled, draft, runs_model, setup) == pytest.approx(want)
    assert step_seconds(ks, _tiled) == _tiled(b + sum(ks))


@pytest.mark.parametrize("seed", range(20))
def test_allocate_drafts_keeps_a_drafting_step_under_max_seconds(seed):
    """A bound on the step's seconds: the allocation is the best of those within it (checked by
    enumeration), and plain decoding stays allowed whatever the bound."""
    import itertools
    import random

    rng = random.Random(300 + seed)
    b = rng.randint(1, 3)
    rates = [rng.choice([0.5, 0.8, 0.95, 1.0]) for _ in range(b)]
    caps = [rng.randint(0, 6) for _ in range(b)]
    linear = lambda rows: 1.0 + 0.25 * (rows - 1)  # noqa: E731
    bound = linear(b) * rng.choice([0.5, 1.0, 1.6, 2.5, 4.0])
    ks = allocate_drafts(_gains(rates, caps), linear, max_seconds=bound)
    assert all(0 <= k <= c for k, c in zip(ks, caps))
    assert not any(ks) or step_seconds(ks, linear) <= bound
    within = [list(k) for k in itertools.product(*(range(c + 1) for c in caps))
              if not any(k) or linear(b + sum(k)) <= bound]
    assert _rate(rates, ks, linear) == pytest.approx(max(_rate(rates, k, linear) for k in within))


def test_allocate_drafts_uses_free_rows_and_refuses_a_new_tile():
    # 3 sequences: the 4th row of the tile is free, so even a 20% draft is worth it (1.2 > 1 token for nothing).
    assert sum(allocate_drafts(_gains([0.2, 0.2, 0.2], [4, 4, 4]), _tiled)) == 1
    # 8 sequences fill two tiles: one more row costs a third pass (+47%); 4 drafts at 0.9 are worth
    # 3.6 tokens on top of 8 (+45%) -- not enough; at 1.0 they are (4 drafts +50%, all 8: +100% for +97%).
    assert allocate_drafts(_gains([0.9] * 8, [1] * 8), _tiled) == [0] * 8
    assert allocate_drafts(_gains([1.0] * 8, [1] * 8), _tiled) == [1] * 8
    # Nothing to draft: all zeros.
    assert allocate_drafts(_gains([0.9, 0.9], [0, 0]), _tiled) == [0, 0]
    assert allocate_drafts(_gains([], []), _tiled) == []


def test_allocate_drafts_prices_only_draft_model_sequences_for_draft_steps():
    draft = lambda rows: 0.6  # noqa: E731  an expensive draft step
    # One sequence at 0.5 acceptance: a 0.6 draft step is not worth 0.5 of a token...
    assert allocate_drafts(_gains([0.5], [3]), _tiled, draft, [True]) == [0]
    # ...but the same proposal from n-gram (free) is: 4 rows cost what 1 does.
    assert allocate_drafts(_gains([0.5], [3]), _tiled, draft, [False]) == [3]


@pytest.mark.parametrize("seed", range(20))
def test_allocate_drafts_with_setups_is_near_the_best(seed):
    """Some sequences must catch up first (a setup paid if they draft at all): within 3% of the best here."""
    import random

    rng = random.Random(100 + seed)
    b = rng.randint(1, 3)
    rates = [rng.choice([0.3, 0.6, 0.8, 0.9, rng.random()]) for _ in range(b)]
    caps = [rng.randint(0, 4) for _ in range(b)]
    setup = [rng.choice([0.0, 0.0, 0.2, 0.8, 2.0]) for _ in range(b)]
    draft = lambda rows: 0.25 + 0.02 * rows  # noqa: E731
    ks = allocate_drafts(_gains(rates, caps), _tiled, draft, setup_seconds=setup)
    _, best_rate = _brute_force(rates, caps, _tiled, draft, setup)
    assert _rate(rates, ks, _tiled, draft, setup) >= 0.97 * best_rate


def test_allocate_drafts_pays_a_setup_once_per_drafting_sequence():
    draft = lambda rows: 0.1  # noqa: E731
    # One sequence at 0.8: 3 drafts fill the first tile, worth ~1.95 tokens for 0.3 of draft steps.
    assert allocate_drafts(_gains([0.8], [3]), _tiled, draft, [True]) == [3]
    assert allocate_drafts(_gains([0.8], [3]), _tiled, draft, [True], setup_seconds=[0.5]) == [3]  # still pays
    assert allocate_drafts(_gains([0.8], [3]), _tiled, draft, [True], setup_seconds=[2.0]) == [0]  # a catch-up too dear
    # Two sequences, only the second must catch up: the first drafts, the second does not.
    assert allocate_drafts(_gains([0.8, 0.8], [1, 1]), _tiled, draft, [True, True], setup_seconds=[0.0, 2.0]) == [1, 0]


def test_offer_pauses_at_low_acceptance_and_probes():
    c = AdaptiveDraftLength(max_k=4, ema=1.0, min_accept_rate=0.3, probe_every=4, initial_accept_rate=0.8)
    assert c.offer() == (4, pytest.approx(0.8))
    c.update(4, 0)  # alpha -> 0
    offers = []
    for _ in range(8):
        cap, rate = c.offer()
        offers.append(cap)
        c.allocated(cap)  # pretend the batch takes all it is offered
        if cap:
            c.update(cap, 0)
    assert offers == [0, 0, 0, 4, 0, 0, 0, 4]  # a probe every 4th step, at the initial rate


def test_a_chain_keeps_a_computed_draft_at_a_rows_price_and_goes_on_at_a_row_and_a_step():
    """chain_stop_gains -> (keep, go_on) in tokens of plain decoding: keep a computed draft for its
    verification row, compute another for a row and a draft step, over the chance that a made
    draft is accepted."""
    def target(rows):
        return 1.0 + 0.05 * (rows - 1)

    def least(*args):  # the go-on price of a chain whose next draft is sure to hold
        return chain_stop_gains(*args, 1.0)[1]

    assert chain_stop_gains(target, None, 1, 1, 1.0) == pytest.approx((0.05, 0.05))  # free proposals
    assert chain_stop_gains(target, lambda rows: 0.1, 1, 3, 1.0) == pytest.approx((0.05, 0.15))  # a head step
    assert chain_stop_gains(target, lambda rows: 0.1, 1, 3, 0.5) == pytest.approx((0.05, 0.30))  # half made hold
    assert chain_stop_gains(target, lambda rows: 0.1, 1, 3, 0.0)[1] == pytest.approx(0.15 / 0.05)  # floored
    # two sequences decode 2 tokens a plain step: a draft's 0.15 s is worth more tokens
    assert least(target, lambda rows: 0.1, 2, 2) == pytest.approx(0.15 * 2 / 1.05)

    def tiled(rows):  # int8 tiles of four rows: a fifth row starts a tile, which the drafts share
        return 1.0 if rows <= 4 else 2.0

    assert least(tiled, lambda rows: 0.1, 1, 3) == pytest.approx(0.1)
    assert least(tiled, lambda rows: 0.1, 1, 4) == pytest.approx(0.25 + 0.1)
    assert least(lambda rows: 1.0 - 0.01 * rows, None, 1, 1) == 0.0  # noise never pays to draft


def test_a_chain_stops_where_its_probability_falls_below_the_prices():
    """chain_drafts -> (drafts kept, head steps): a draft whose running product falls below keep is
    computed and dropped; one below go_on is kept and ends the chain; k caps it."""
    probs = [0.9, 0.5, 0.8, 0.9]  # running products 0.9, 0.45, 0.36, 0.324
    assert chain_drafts(probs, 4, 0.0, 0.0) == (4, 4)
    assert chain_drafts(probs, 2, 0.0, 0.0) == (2, 2)
    assert chain_drafts(probs, 4, 0.4, 0.4) == (2, 3)  # 0.36 computed, dropped
    assert chain_drafts(probs, 4, 0.1, 0.4) == (3, 3)  # 0.36 kept, below go-on: stops
    assert chain_drafts(probs, 4, 0.95, 0.95) == (0, 1)
    assert chain_drafts(probs, 0, 0.0, 0.0) == (0, 0)


def test_a_stop_price_reads_the_chain_probability_through_the_heads_power():
    """stop_probability: gain ** (1 / power), the gain itself at power 1, a price above 1 as 1, and
    a gain of 0 never stops."""
    assert stop_probability(0.09, 0.5) == pytest.approx(0.0081)
    assert stop_probability(0.09) == 0.09 and stop_probability(0.0, 0.5) == 0.0
    assert stop_probability(2.0, 0.5) == 1.0 and stop_probability(2.0) == 2.0
