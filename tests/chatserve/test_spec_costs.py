"""The speculation cost table is measured in scratch blocks that go back to the pool."""

from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.spec_costs import NGRAM_STEP_COST, measure_spec_costs


def test_costs_are_measured_and_the_pool_is_left_as_it_was(tiny_llama_dir, tiny_draft_dir):
    spec = SpecConfig(method="draft", draft_model=str(tiny_draft_dir), num_draft_tokens=4)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec))
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # the engine's own calibration gave its blocks back
    costs = measure_spec_costs(engine.models, 4, use_draft_model=True)
    assert len(costs.verify_costs) == 5 and costs.verify_costs[0] == 1.0
    assert all(c > 0 for c in costs.verify_costs) and costs.draft_step_cost > 0
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
    controller_costs = engine.spec.costs
    assert controller_costs is not None and len(controller_costs.verify_costs) == 5
    ngram = measure_spec_costs(engine.models, 2, use_draft_model=False)
    assert ngram.draft_step_cost == NGRAM_STEP_COST and len(ngram.verify_costs) == 3


def test_a_full_pool_skips_calibration(tiny_llama_dir, tiny_draft_dir):
    spec = SpecConfig(method="draft", draft_model=str(tiny_draft_dir), num_draft_tokens=4)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec))
    bm = engine.block_manager
    from chatserve.block_manager import BlockTable

    hog = BlockTable()
    assert bm.allocate(hog, bm.num_blocks * bm.block_size)
    assert measure_spec_costs(engine.models, 4, use_draft_model=True) is None
    bm.free(hog)
    assert bm.num_free_blocks == bm.num_blocks
