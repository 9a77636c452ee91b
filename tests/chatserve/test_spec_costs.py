"""The speculation cost tables are measured in scratch blocks that go back to the pool, and
interpolate between measured row counts."""

import pytest

from chatserve.block_manager import BlockTable
from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.spec_costs import NGRAM_STEP_COST, SpecCosts, _interpolate, measure_spec_costs, row_grid


def test_interpolation_and_grid():
    seconds = {1: 1.0, 4: 1.0, 8: 3.0}
    assert _interpolate(seconds, 5) == pytest.approx(3.0)  # rounds up to the next measured count
    assert _interpolate(seconds, 4) == pytest.approx(1.0)
    assert _interpolate(seconds, 16) == pytest.approx(6.0)  # proportional past the grid
    assert row_grid(20, 4) == [1, 2, 3, 4, 5, 8, 12, 16, 20]
    assert row_grid(64, 4) == [1, 2, 3, 4, 5, 8, 12, 16, 20, 24, 28, 32, 48, 64]
    costs = SpecCosts({1: 1.0, 2: 1.0, 4: 1.0, 5: 2.0, 8: 2.0, 10: 2.5}, {1: 0.3, 2: 0.3})
    draft, verify = costs.batch_costs(2, 4, use_draft_model=True)
    assert draft == pytest.approx(0.3) and verify == pytest.approx([1.0, 1.0, 2.0, 2.0, 2.5])
    assert costs.batch_costs(1, 2, use_draft_model=False)[0] == NGRAM_STEP_COST


def test_costs_are_measured_and_the_pool_is_left_as_it_was(tiny_llama_dir, tiny_draft_dir):
    spec = SpecConfig(method="draft", draft_model=str(tiny_draft_dir), num_draft_tokens=4)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec, max_num_seqs=4))
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # the engine's own calibration gave its blocks back
    costs = measure_spec_costs(engine.models, 4, 4, use_draft_model=True)
    assert sorted(costs.target_seconds) == [1, 2, 3, 4, 5, 8, 12, 16, 20][: len(costs.target_seconds)]
    assert max(costs.target_seconds) == 20 and sorted(costs.draft_seconds) == [1, 2, 3, 4]
    assert all(t > 0 for t in costs.target_seconds.values())
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
    table = engine.spec.costs.table(4, 4, True)
    assert len(table) == 4 and all(len(v) == 5 and v[0] == pytest.approx(1.0) for _, v in table)
    ngram = measure_spec_costs(engine.models, 2, 4, use_draft_model=False)
    assert ngram.draft_seconds == {} and ngram.batch_costs(1, 2, False)[0] == NGRAM_STEP_COST


def test_a_full_pool_skips_calibration(tiny_llama_dir, tiny_draft_dir):
    spec = SpecConfig(method="draft", draft_model=str(tiny_draft_dir), num_draft_tokens=4)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec))
    bm = engine.block_manager
    hog = BlockTable()
    assert bm.allocate(hog, bm.num_blocks * bm.block_size)
    assert measure_spec_costs(engine.models, 4, 16, use_draft_model=True) is None
    bm.free(hog)
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_adaptive_batches_are_lossless_and_leave_the_pool_empty(tiny_llama_dir, tiny_draft_dir, method):
    """The measured-cost path (allocate_drafts over the batch): 6 requests at once, greedy output equal
    to speculation off, some drafts made, every block back in the pool."""
    from chatserve.sampling_params import SamplingParams
    from tests.chatserve.test_engine import assert_pool_empty

    spec = SpecConfig(method=method, draft_model=str(tiny_draft_dir) if method == "draft" else None, num_draft_tokens=4)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec, max_num_seqs=6))
    assert engine.spec.costs is not None
    prompts = [[1 + i, 5, 9, 5, 9, 5, 9, 2 + i] * 3 for i in range(6)]  # repeats: n-gram finds matches
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    on = engine.generate(prompts, params)
    spec_runner = engine.spec
    engine.set_speculation(None)
    off = engine.generate(prompts, params)
    assert [o["token_ids"] for o in on] == [o["token_ids"] for o in off]
    drafted = sum(o["stats"].num_drafted for o in on)
    accepted = sum(o["stats"].num_accepted for o in on)
    assert drafted > 0
    assert_pool_empty(engine)
    # The engine-wide estimate (new requests' prior) moved from its prior toward what happened.
    prior = {"draft": 0.8, "ngram": 0.5}[method]
    rate = spec_runner.method_accept_rate[method].rate
    assert rate != prior
    if abs(accepted / drafted - prior) > 0.2:  # k depends on measured timings; near the prior the EMA may lag
        assert (rate < prior) == (accepted / drafted < prior)
