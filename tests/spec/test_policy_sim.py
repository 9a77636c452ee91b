"""benchmarks/spec_policy_sim.py: its walk is train_head's, and its replay of serving's decisions
follows the head's chains (synthetic chains, no model)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from chatserve.train_head import walked_length

_SPEC = importlib.util.spec_from_file_location(
    "spec_policy_sim", Path(__file__).resolve().parents[2] / "benchmarks" / "spec_policy_sim.py")
sim = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = sim  # its dataclasses look their module up
_SPEC.loader.exec_module(sim)

# a served run's shape (ms): rows get dearer, a head step ~5% of a forward
COSTS = sim.Costs({1: 38.4, 2: 41.0, 3: 41.6, 4: 44.3, 5: 47.0, 6: 51.2}, head=1.9, overhead=0.8)


def _chains(seed: int, replies: int = 12, anchors: int = 150, power: float = 0.73):
    """Chains whose acceptance follows the head's probability: a chain of P is accepted ~ P ** power."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(replies):
        # as train_head.chain_hits: anchor i's (s+1)-th draft is past the reply when i + s >= anchors
        inside = torch.arange(anchors)[:, None] + torch.arange(sim.MAX_K)[None] < anchors
        sure = torch.rand(anchors, sim.MAX_K, generator=gen) ** 0.5 * inside
        held = (torch.rand(anchors, sim.MAX_K, generator=gen) < sure.cumprod(1) ** power) & inside
        out.append((held.int().cumprod(1).bool(), sure))
    return out


@pytest.mark.parametrize("k", [1, 2, 4])
def test_fixed_chain_walks_as_train_head(k):
    chains = _chains(0)
    out = sim.fixed_chain(chains, k, COSTS)
    assert out.tokens / out.steps == pytest.approx(walked_length([h for h, _ in chains], k))


def test_a_sure_head_drafts_every_position_it_may():
    hits = [torch.ones(100, sim.MAX_K, dtype=torch.bool)]
    sure = [torch.ones(100, sim.MAX_K)]
    out = sim.replay(list(zip(hits, sure)), sim.Policy("serving"), COSTS)
    assert out.accepted == out.drafts  # every draft held
    assert out.drafts / out.steps > 3.0  # the estimate climbs and the allocation gives the whole cap
    assert out.tokens == 100  # the walk covers the reply once


def test_a_head_that_is_never_right_stops_drafting():
    hits = [torch.zeros(400, sim.MAX_K, dtype=torch.bool)]
    sure = [torch.full((400, sim.MAX_K), 0.9)]
    out = sim.replay(list(zip(hits, sure)), sim.Policy("serving"), COSTS)
    assert out.accepted == 0 and out.steps == 400
    assert out.drafts / out.steps < 0.25  # priced out after the estimate falls; probes only


def test_a_lower_stop_power_drafts_longer_chains():
    chains = _chains(1)
    plain = sim.replay(chains, sim.Policy("serving"), COSTS)
    calibrated = sim.replay(chains, sim.Policy("calibrated", power=0.5), COSTS)
    assert calibrated.drafts / calibrated.steps > plain.drafts / plain.steps
