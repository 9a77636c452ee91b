import pytest

from spec.adaptive import AdaptiveDraftLength


def _run(controller: AdaptiveDraftLength, accepts: bool, num_steps: int, batch_size: int = 1) -> list[int]:
    """Drive the controller with drafts that are all accepted or all rejected; return the ks."""
    ks = []
    for _ in range(num_steps):
        k = controller.next_k(batch_size)
        ks.append(k)
        controller.update(k, k if accepts else 0)
    return ks


def test_expected_tokens_formula():
    controller = AdaptiveDraftLength(max_k=4)
    assert controller.expected_tokens(0, 0.5) == 1.0
    assert controller.expected_tokens(2, 0.5) == pytest.approx(1 + 0.5 + 0.25)
    assert controller.expected_tokens(3, 1.0) == 4.0
    assert controller.expected_tokens(3, 0.0) == 1.0


def test_high_acceptance_grows_k_to_max():
    controller = AdaptiveDraftLength(max_k=8, initial_accept_rate=0.5, draft_step_cost=0.1)
    ks = _run(controller, accepts=True, num_steps=40)
    assert ks[0] < 8
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


def test_costs_change_the_choice():
    controller = AdaptiveDraftLength(max_k=8, ema=1.0)
    controller.update(8, 7)  # alpha = 7 / 8
    controller.set_costs(draft_step_cost=0.05, verify_base_cost=1.0, verify_per_token_cost=0.01)
    cheap = controller.next_k()
    controller.set_costs(draft_step_cost=0.4, verify_base_cost=1.0, verify_per_token_cost=0.01)
    dear = controller.next_k()
    controller.set_costs(draft_step_cost=1.0, verify_base_cost=1.0, verify_per_token_cost=0.01)
    too_dear = controller.next_k()
    assert cheap > dear > 0
    assert too_dear == 0


def test_larger_batch_drafts_less():
    controller = AdaptiveDraftLength(max_k=8, ema=1.0, draft_step_cost=0.1, verify_per_token_cost=0.02)
    controller.update(8, 7)
    ks = [controller.next_k(batch_size) for batch_size in (1, 8, 64, 1024)]
    assert ks == sorted(ks, reverse=True)
    assert ks[0] > ks[-1] == 0


def test_min_accept_rate_forces_zero():
    controller = AdaptiveDraftLength(max_k=4, ema=1.0, min_accept_rate=0.6, draft_step_cost=0.0)
    controller.update(4, 1)  # alpha = 0.5: profitable with free drafts, but below the floor
    assert controller.next_k() == 0


def test_invalid_update():
    with pytest.raises(ValueError):
        AdaptiveDraftLength(max_k=4).update(2, 3)


def test_measured_verify_costs_avoid_an_expensive_row_count():
    """With 5 rows costing twice 4 (int8 GEMV in blocks of 4 rows), k = 3 beats k = 4 even at
    high acceptance; with a flat table k = 4 wins."""
    stepped = AdaptiveDraftLength(max_k=4, ema=1.0, initial_accept_rate=0.88, draft_step_cost=0.3,
                                  verify_costs=[1.0, 1.0, 1.0, 1.05, 2.0])
    flat = AdaptiveDraftLength(max_k=4, ema=1.0, initial_accept_rate=0.88, draft_step_cost=0.3,
                               verify_costs=[1.0, 1.0, 1.0, 1.05, 1.1])
    assert stepped.next_k() == 3
    assert flat.next_k() == 4
    assert stepped.cost(4) == pytest.approx(4 * 0.3 + 2.0)
    with pytest.raises(ValueError):
        stepped.set_costs(0.3, 1.0, 0.01, [1.0, -1.0])


def test_batch_costs_stop_drafting_when_the_batch_makes_it_expensive():
    """Batch 1: verifying drafts costs little, so it drafts (k = 2 at 80% acceptance). Batch 4: the same drafts make 20
    rows against 4 (measured ~3.5x a plain step) and the draft runs 4 rows too: plain wins."""
    costs = [(0.3, [1.0, 1.0, 1.0, 1.05, 1.1]), (0.35, [1.0, 1.1, 1.5, 2.0, 2.4]),
             (0.4, [1.0, 1.5, 2.2, 2.8, 3.2]), (0.45, [1.0, 2.0, 2.9, 3.5, 4.4])]
    controller = AdaptiveDraftLength(max_k=4, ema=1.0, initial_accept_rate=0.8, batch_costs=costs)
    assert controller.next_k(batch_size=1) == 2
    assert controller.next_k(batch_size=4) == 0
    assert controller.cost(2, batch_size=9) == pytest.approx(2 * 0.45 + 2.9)  # past the table: its last row
