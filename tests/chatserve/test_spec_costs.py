"""The speculation cost tables are measured in scratch blocks that go back to the pool, and
round up to the next measured row count; with no room to measure, a linear model stands in."""

import dataclasses
import os
import time

import pytest

from chatserve.block_manager import BlockTable
from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.spec_costs import MAX_ROWS, SpecCosts, assumed_spec_costs, measure_spec_costs, row_grid
from spec.adaptive import AcceptanceEMA


def test_lookup_and_grid():
    costs = SpecCosts({8: 3.0, 1: 1.0, 4: 1.0}, {2: 0.4, 1: 0.3})  # any key order
    assert costs.target(5) == pytest.approx(3.0)  # rounds up to the next measured count
    assert costs.target(4) == pytest.approx(1.0)
    assert costs.target(3) == pytest.approx(1.0)
    assert costs.target(16) == pytest.approx(6.0)  # proportional past the grid
    assert costs.draft(2) == pytest.approx(0.4) and costs.draft(4) == pytest.approx(0.8)
    assert SpecCosts({1: 1.0}, {}).draft(3) == 0.0  # no draft model
    assert row_grid(20, 4) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20]
    assert row_grid(64, 4) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 28, 32, 48, 64]
    assert row_grid(64, 1) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 28, 32, 48, 64]  # 3 rows not priced as 8
    assert row_grid(20, 9) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 20]
    assert row_grid(6, 4) == [1, 2, 3, 4, 5, 6]


def test_a_prefill_chunk_prices_draft_rows_past_it():
    """4 decodes: a 5th row starts a new int8 tile alone (+100%), but next to 60 prompt rows it
    adds one row of a big forward; the plain step still costs what 4 decode rows do."""
    from spec.adaptive import allocate_drafts

    costs = SpecCosts({1: 1.0, 4: 1.0, 8: 2.0, 32: 4.0, 64: 6.4}, {})
    alone, with_prefill = costs.step_target(4), costs.step_target(4, prefill_rows=60)
    assert alone(4) == with_prefill(4) == pytest.approx(1.0)
    assert alone(5) == pytest.approx(2.0)
    assert with_prefill(5) == pytest.approx(1.0 + 6.4 * 65 / 64 - 6.4)  # one row at 0.1 per row
    assert allocate_drafts([[0.5]] * 4, alone) == [0] * 4
    assert allocate_drafts([[0.5]] * 4, with_prefill) == [1] * 4


def test_assumed_costs_are_linear():
    costs = assumed_spec_costs(64, has_draft_model=True)
    assert costs.target(1) == pytest.approx(1.0) and costs.target(21) == pytest.approx(2.0)
    assert costs.draft(1) == pytest.approx(0.35) and costs.draft(11) == pytest.approx(0.45)
    assert assumed_spec_costs(64, has_draft_model=False).draft_seconds == {}


def test_costs_are_measured_and_the_pool_is_left_as_it_was(tiny_llama_dir, tiny_draft_dir):
    spec = SpecConfig(method="draft", draft_model=str(tiny_draft_dir), num_draft_tokens=4)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec, max_num_seqs=4))
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # the engine's own calibration gave its blocks back
    costs = measure_spec_costs(engine.models, 4, 4)
    assert sorted(costs.target_seconds) == row_grid(20, 4)
    assert max(costs.target_seconds) == 20 and sorted(costs.draft_seconds) == [1, 2, 3, 4]
    assert sorted(costs.catch_up_seconds) == [16, 32, 64, 128, 256]
    assert all(t > 0 for t in costs.target_seconds.values())
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()
    # the engine's own: 4 sequences of up to num_free_draft_tokens (16) free drafts
    assert sorted(engine.spec.costs.target_seconds) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 28, 32, 48, 64]
    no_draft = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, max_num_seqs=4))
    ngram = measure_spec_costs(no_draft.models, 2, 4)
    assert ngram.draft_seconds == {} and ngram.draft(4) == 0.0


def test_a_measured_table_is_kept_and_read_back_for_the_same_models_and_grid(tiny_llama_dir, tiny_draft_dir,
                                                                              tmp_path, monkeypatch):
    """With costs_cache_dir, the first start measures and saves the table; a second start of the same
    models and grid reads it back unmeasured and prices with the same numbers; another grid, other
    model files (touched), or a file that does not parse are measured again; without a cache dir
    nothing is kept."""
    import shutil

    from chatserve import spec_costs

    calls = []
    measure = spec_costs.measure_spec_costs
    monkeypatch.setattr(spec_costs, "measure_spec_costs", lambda *a, **k: (calls.append(a[1:]), measure(*a, **k))[1])
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    cache = tmp_path / "costs"
    spec = SpecConfig(method="draft", draft_model=str(tiny_draft_dir), num_draft_tokens=4, costs_cache_dir=str(cache))

    def start(max_num_seqs=2, spec=spec):
        return Engine(EngineConfig(model=str(model_dir), kv_cache_memory=8 << 20, spec=spec, max_num_seqs=max_num_seqs))

    first = start()
    assert len(calls) == 1 and first.spec.costs_source.startswith("measured, saved to ")
    (saved,) = cache.glob("*.json")
    second = start()
    assert len(calls) == 1 and second.spec.costs_source.startswith(f"read from {saved}")
    assert second.spec.costs == first.spec.costs  # every table, to the float
    assert second.spec.costs.draft_seconds and second.spec.costs.catch_up_seconds
    start(max_num_seqs=3)  # another grid: another key
    assert len(calls) == 2 and len(list(cache.glob("*.json"))) == 2
    saved.write_text("{")  # cut short
    assert start().spec.costs_source.startswith("measured, saved to") and len(calls) == 3
    assert start().spec.costs_source.startswith("read from") and len(calls) == 3  # replaced by a whole one
    for weights in model_dir.glob("*.safetensors"):  # the same path, other bytes as far as anyone can tell
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert start().spec.costs_source.startswith("measured") and len(calls) == 4
    uncached = start(spec=dataclasses.replace(spec, costs_cache_dir=None))
    assert uncached.spec.costs_source == "measured" and len(calls) == 5 and len(list(cache.glob("*.json"))) == 3


def test_a_full_pool_skips_calibration(tiny_llama_dir, tiny_draft_dir):
    spec = SpecConfig(method="draft", draft_model=str(tiny_draft_dir), num_draft_tokens=4)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec))
    bm = engine.block_manager
    hog = BlockTable()
    assert bm.allocate(hog, bm.num_blocks * bm.block_size)
    assert measure_spec_costs(engine.models, 4, 16) is None
    bm.free(hog)
    assert bm.num_free_blocks == bm.num_blocks


def test_an_engine_without_room_to_measure_drafts_on_assumed_costs(tiny_llama_dir, tiny_draft_dir):
    """A pool too small for the scratch blocks: the engine prices drafts with the linear model,
    and its greedy output still equals speculation off."""
    from chatserve.sampling_params import SamplingParams
    from tests.chatserve.test_engine import assert_pool_empty

    spec = SpecConfig(method="draft", draft_model=str(tiny_draft_dir), num_draft_tokens=4)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec, max_num_seqs=4))
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6] * 2]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.set_speculation(None)
    off = engine.generate(prompt, params)[0]["token_ids"]
    bm = engine.block_manager
    hog = BlockTable()  # leaves 4 free blocks: the scratch rows (48 + 20 tokens) need 5
    assert bm.allocate(hog, (bm.num_blocks - 4) * bm.block_size)
    engine.set_speculation(spec)
    bm.free(hog)
    assert engine.spec.costs == assumed_spec_costs(MAX_ROWS, has_draft_model=True)
    on = engine.generate(prompt, params)[0]
    assert on["token_ids"] == off and on["stats"].num_drafted > 0
    assert_pool_empty(engine)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_adaptive_batches_are_lossless_and_leave_the_pool_empty(tiny_llama_dir, tiny_draft_dir, method):
    """The measured-cost path (allocate_drafts over the batch): 6 requests at once, greedy output equal
    to speculation off, some drafts made, every block back in the pool. Draft-model requests may take
    suffix proposals instead of their draft's (whichever promises more at the measured costs), so the
    estimates checked are those of the methods that drafted."""
    from chatserve.sampling_params import SamplingParams
    from tests.chatserve.test_engine import assert_pool_empty

    spec = SpecConfig(method=method, draft_model=str(tiny_draft_dir) if method == "draft" else None, num_draft_tokens=4)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec, max_num_seqs=6))
    assert engine.spec.costs is not None
    # Pinned to a real pair's shape (extra rows cheap, a draft forward ~10% of the target's):
    # the tiny models' measured costs are all overhead, and on a busy machine they can price
    # every draft out, which would leave nothing here to check.
    engine.spec.costs = SpecCosts({1: 1.0, 4: 1.05, 8: 1.3, 16: 1.8, 32: 3.0, 64: 5.0},
                                  {1: 0.1, 8: 0.15, 64: 0.4} if method == "draft" else {})
    priors = {name: m.accept_rate.rate for name, m in engine.spec.methods.items()}
    prompts = [[1 + i, 5, 9, 5, 9, 5, 9, 2 + i] * 3 for i in range(6)]  # repeats: n-gram finds matches
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    on = engine.generate(prompts, params)
    spec_runner = engine.spec
    engine.set_speculation(None)
    off = engine.generate(prompts, params)
    assert [o["token_ids"] for o in on] == [o["token_ids"] for o in off]
    assert sum(o["stats"].num_drafted for o in on) > 0
    assert_pool_empty(engine)
    # The engine-wide estimate (new requests' prior) of each method that drafted moved from its
    # prior toward what happened.
    used = {name: stats for name, stats in spec_runner.stats_by_method.items() if stats.num_draft_tokens}
    assert set(used) <= {method, "suffix"}
    for name, stats in used.items():
        prior, rate = priors[name], spec_runner.methods[name].accept_rate.rate
        observed = stats.num_accepted_tokens / stats.num_draft_tokens
        assert rate != prior
        if abs(observed - prior) > 0.2:  # k depends on measured timings; near the prior the EMA may lag
            assert (rate < prior) == (observed < prior)


class _Clock:
    """A fake perf_counter: forwards advance it by what they cost, a slow spell adds to a run of calls."""

    def __init__(self, slow_calls: range):
        self.now, self.calls, self.slow_calls = 0.0, 0, slow_calls

    def __call__(self) -> float:
        return self.now

    def forward(self, rows: int) -> None:
        self.now += rows * 1e-3 + (0.1 if self.calls in self.slow_calls else 0.0)
        self.calls += 1


class _Runner:
    def __init__(self, clock: _Clock, per_row: float):
        self.clock, self.per_row = clock, per_row

    def run(self, items):
        self.clock.forward(int(self.per_row * len(items[0].token_ids)) or 1)


class _Pool:
    def allocate(self, table, num_tokens):
        table.block_ids = [0]
        return True

    def free(self, table):
        pass


@pytest.mark.parametrize("spell_start", [0, 3, 9, 14, 20, 31])
def test_a_slow_spell_of_the_machine_does_not_bend_the_table(monkeypatch, spell_start):
    """The machine slows for 8 forwards in a row (another tenant): every forward of up to 16
    rows still gets a clean timing, so the table is the runners' true cost per row count. Timed
    point by point (warm-up and two repeats each, as before), the spell lands on every timing of
    two or three row counts, and 2-4 rows looked as dear as 5 (or as cheap as 1)."""
    import types

    from chatserve import spec_costs

    clock = _Clock(range(spell_start, spell_start + 8))
    monkeypatch.setattr(spec_costs.time, "perf_counter", clock)
    models = types.SimpleNamespace(block_manager=_Pool(), target_runner=_Runner(clock, 1),
                                   draft_runner=_Runner(clock, 0.5), eagle_runner=None)
    costs = measure_spec_costs(models, 4, 2)
    assert costs.target_seconds == {r: pytest.approx(r * 1e-3) for r in row_grid(10, 4)}
    assert costs.draft_seconds == {r: pytest.approx(max(r // 2, 1) * 1e-3) for r in (1, 2)}
    assert set(costs.catch_up_seconds) == set(spec_costs.CATCH_UP_ROWS)


def test_service_forwards_reprice_the_table():
    """Rows seen in service cost what they took (median); a row count not seen keeps the table's
    shape at the level of its nearest seen neighbour; nothing is corrected before MIN_SEEN."""
    from chatserve.spec_costs import ObservedForwards

    table = SpecCosts({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 2.0, 8: 2.2}, {})
    seen = ObservedForwards()
    for _ in range(ObservedForwards.MIN_SEEN - 1):
        assert not seen.observe(2, 1.1)  # observe says whether the correction moved: not yet
        assert not seen.observe(3, 2.0)
    assert seen.corrected(table) == table  # too few to say anything
    assert seen.observe(2, 1.1) and seen.observe(3, 2.0)
    costs = seen.corrected(table)
    assert costs.target(2) == pytest.approx(1.1) and costs.target(3) == pytest.approx(2.0)
    assert costs.target(1) == pytest.approx(1.0)  # nearest seen: 2 rows, as the table said
    assert costs.target(4) == pytest.approx(1.3 * 2.0 / 1.2)  # nearest seen: 3 rows, 1.67x the table
    assert costs.target(8) == pytest.approx(2.2 * 2.0 / 1.2)
    assert costs.draft_seconds == table.draft_seconds
    assert not seen.observe(3, 9.0)  # one slow forward among four moves nothing
    assert seen.corrected(table).target(3) == pytest.approx(2.0)
    assert not seen.observe(3, 9.0)  # nor two of five
    assert seen.observe(3, 9.0) and seen.corrected(table).target(3) == pytest.approx(5.5)  # three of six do


def test_one_served_ratio_scales_the_start_up_shape():
    """ObservedForwards(reshape=False): the start-up table's shape at the level service says, one
    ratio over the latest forwards of any row count, so a row count bought once in a slow spell
    and seldom after keeps no dear price of its own; prices never fall as rows grow."""
    from chatserve.spec_costs import ObservedForwards

    table = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 8: 2.0}
    seen = ObservedForwards(reshape=False)
    for _ in range(ObservedForwards.MIN_SEEN):
        seen.observe(4, 2.6)  # a slow spell, the only four-row forwards
    assert seen.corrected_table(table) == {r: pytest.approx(2 * t) for r, t in table.items()}
    for _ in range(3 * ObservedForwards.WINDOW):  # then plain steps at 1.5x the table
        seen.observe(2, 1.65)
    assert seen.corrected_table(table) == {r: pytest.approx(1.5 * t) for r, t in table.items()}
    seen.reshape = True
    assert seen.corrected_table(table)[4] == pytest.approx(2.6)  # reshaped, four rows stay where the spell left them
    seen.reshape = False
    assert ObservedForwards(reshape=False).corrected_table(table) is None  # nothing seen yet
    ratio = 1.65 / 0.9  # against a start-up table whose two rows timed below its one
    assert seen.corrected_table({1: 1.0, 2: 0.9, 3: 1.2}) == {
        1: pytest.approx(ratio), 2: pytest.approx(ratio), 3: pytest.approx(1.2 * ratio)}


def test_one_served_ratio_rebuilds_the_table_only_once_it_moves():
    """The engine asks after every decode forward: while the ratio stays within RATIO_STEP of the
    one the table was built at, the observer gives back that very table (SpecRunner keeps its
    costs); past it, a table at the new ratio; another start-up table prices every forward anew."""
    from chatserve.spec_costs import ObservedForwards

    table = {1: 1.0, 2: 1.1, 4: 1.3}
    seen = ObservedForwards(reshape=False)
    for _ in range(3 * ObservedForwards.WINDOW):
        seen.observe(1, 1.5)
    built = seen.corrected_table(table)
    assert built == {r: pytest.approx(1.5 * t) for r, t in table.items()}
    for _ in range(ObservedForwards.WINDOW):  # a third of the window a little dearer: the median barely moves
        seen.observe(2, 1.1 * 1.5 * 1.005)
    assert seen.corrected_table(table) is built
    for _ in range(2 * ObservedForwards.WINDOW):  # now most of the window: the median moves by 0.5%
        seen.observe(2, 1.1 * 1.5 * 1.005)
    assert seen.corrected_table(table) is built
    for _ in range(2 * ObservedForwards.WINDOW):  # 4% dearer
        seen.observe(4, 1.3 * 1.56)
    moved = seen.corrected_table(table)
    assert moved is not built and moved == {r: pytest.approx(1.56 * t) for r, t in table.items()}
    other = {1: 3.0, 2: 3.0, 4: 3.0}  # every forward priced again against it
    assert seen.corrected_table(other) == {r: pytest.approx(1.3 * 1.56 / 3.0 * 3.0) for r in other}


def test_recent_row_counts_cost_their_own_median_until_they_leave_the_latest():
    """ObservedForwards(reshape=False, recent=True): a row count seen MIN_SEEN times among the latest
    3 x window forwards costs their median (a start-up table that timed 3 rows as cheap as 2 is
    corrected once 3 rows are bought); one seen fewer times there takes the start-up shape at the
    one ratio, so a count bought long ago keeps no old price of its own; never falling as rows grow."""
    from chatserve.spec_costs import ObservedForwards

    table = {1: 1.0, 2: 1.2, 3: 1.2, 4: 1.6}  # 3 rows timed as cheap as 2 at start-up
    seen = ObservedForwards(reshape=False, recent=True)
    latest = 3 * ObservedForwards.WINDOW
    for _ in range(latest - ObservedForwards.MIN_SEEN):
        seen.observe(2, 1.2 * 1.5)  # service at 1.5x the table
    for _ in range(ObservedForwards.MIN_SEEN):
        seen.observe(3, 2.4)  # what 3 rows cost
    corrected = seen.corrected_table(table)
    assert corrected[2] == pytest.approx(1.8) and corrected[3] == pytest.approx(2.4)
    assert corrected[1] == pytest.approx(1.5) and corrected[4] == pytest.approx(2.4)  # 1.6 x 1.5, floored at 3's
    for _ in range(latest - 1):  # 3 rows fall out of the latest but one
        seen.observe(2, 1.8)
    assert seen.corrected_table(table) == {1: pytest.approx(1.5), 2: pytest.approx(1.8), 3: pytest.approx(1.8),
                                           4: pytest.approx(2.4)}
    seen.recent = False  # the one ratio alone (session 54)
    assert seen.corrected_table(table)[3] == pytest.approx(1.8)


def test_a_head_observer_reprices_the_head_table_alone():
    from chatserve.spec_costs import ObservedForwards

    table = SpecCosts({1: 1.0, 2: 1.1}, {}, head_seconds={1: 0.3, 2: 0.4, 3: 0.5})
    seen = ObservedForwards(table="head_seconds")
    for _ in range(ObservedForwards.MIN_SEEN):
        seen.observe(1, 0.1)  # a third of the start-up price
    costs = seen.corrected(table)
    assert costs.head(1) == pytest.approx(0.1) and costs.head(3) == pytest.approx(0.5 / 3)
    assert costs.target_seconds == table.target_seconds
    without = SpecCosts({1: 1.0}, {})
    assert seen.corrected(without) is without  # no head: nothing to correct


def test_corrected_prices_never_fall_as_rows_grow():
    from chatserve.spec_costs import ObservedForwards

    table = SpecCosts({1: 1.0, 4: 1.3, 5: 2.0, 8: 2.2}, {})
    seen = ObservedForwards()
    for _ in range(ObservedForwards.MIN_SEEN):
        seen.observe(4, 3.0)  # 2.3x the table
        seen.observe(5, 2.0)  # as the table
    costs = seen.corrected(table)
    assert costs.target(4) == pytest.approx(3.0)
    assert costs.target(5) == pytest.approx(3.0) and costs.target(8) == pytest.approx(3.0)


def test_batch_two_stops_buying_rows_that_service_prices_dearer():
    """The session-21 loss: the start-up table said a batch-2 step's extra rows cost +8 ms each,
    the engine's steps took +17. Priced by the table, two sequences at acceptance 0.4 draft; once
    service's forwards are seen, they do not."""
    from chatserve.spec_costs import ObservedForwards
    from spec.adaptive import allocate_drafts

    table = SpecCosts({1: 0.040, 2: 0.048, 3: 0.056, 4: 0.064, 5: 0.072, 6: 0.080}, {})
    gains = [[0.4, 0.16]] * 2
    assert sum(allocate_drafts(gains, table.target)) > 0
    seen = ObservedForwards()
    for rows, ms in ((2, 55.1), (3, 72.3), (4, 89.6)):
        for _ in range(ObservedForwards.MIN_SEEN):
            seen.observe(rows, ms / 1e3)
    assert allocate_drafts(gains, seen.corrected(table).target) == [0, 0]


def test_the_engine_reports_its_decode_forwards_and_costs_set_by_hand_stay(tiny_llama_dir):
    """Every decode-only step's forward reaches the cost table (a prompt's steps do not: their
    time is the prompt's); costs set by hand are used as set."""
    from chatserve.sampling_params import SamplingParams

    spec = SpecConfig(method="ngram", num_draft_tokens=2)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec, max_num_seqs=2))
    measured = engine.spec.costs
    seen = []
    observe = engine.spec.observe_forward
    engine.spec.observe_forward = lambda rows, seconds: (seen.append(rows), observe(rows, seconds))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.generate([[1, 5, 9, 5, 9, 5, 9, 2] * 4, [2, 6, 8, 6, 8, 6, 8, 3] * 4], params)
    assert len(seen) >= 6 and all(1 <= rows <= 2 * 3 for rows in seen)  # decodes and drafts, never a prompt
    assert engine.spec.costs.target_seconds != measured.target_seconds
    assert sorted(engine.spec.costs.target_seconds) == sorted(measured.target_seconds)
    slow = engine.sampler.verify, engine.sampler.sample  # the step's verification and sampling count too
    engine.sampler.verify = lambda *a, **kw: (time.sleep(0.02), slow[0](*a, **kw))[1]
    engine.sampler.sample = lambda *a, **kw: (time.sleep(0.02), slow[1](*a, **kw))[1]
    times = []
    engine.spec.observe_forward = lambda rows, seconds: (times.append(seconds), observe(rows, seconds))
    engine.generate([[1, 5, 9, 5, 9, 5, 9, 2] * 4], params)
    assert times and min(times) >= 0.02
    engine.sampler.verify, engine.sampler.sample = slow
    pinned = SpecCosts({1: 1.0, 8: 1.3}, {})
    engine.spec.costs = pinned
    engine.generate([[1, 5, 9, 5, 9, 5, 9, 2] * 4], params)
    assert engine.spec.costs is pinned


def test_a_draft_models_served_steps_reprice_its_table(monkeypatch, tiny_llama_dir, tiny_draft_dir):
    """propose times each draft position that only drafts (the draft model's forward with its
    sampling) and the engine's draft table follows them: a draft model timed at start-up as nearly
    free, then slowed by 30 ms a forward, is priced at >= 30 ms once its steps are seen, the rows it
    was never timed at keep their keys, and the allocator then stops buying its drafts."""
    from chatserve import spec_costs
    from chatserve.sampling_params import SamplingParams
    from chatserve.spec_costs import ObservedForwards
    from tests.chatserve.test_engine import assert_pool_empty

    measure = spec_costs.measure_spec_costs

    def nearly_free_draft(*args, **kwargs):
        costs = measure(*args, **kwargs)
        return dataclasses.replace(costs, draft_seconds={r: t / 100 for r, t in costs.draft_seconds.items()})

    monkeypatch.setattr(spec_costs, "measure_spec_costs", nearly_free_draft)
    spec = SpecConfig(method="draft", draft_model=str(tiny_draft_dir), num_draft_tokens=4, suffix_corpus_tokens=0)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, spec=spec, max_num_seqs=2))
    measured = engine.spec.costs
    method = engine.spec.methods["draft"]
    method.accept_rate = AcceptanceEMA(ema=0.05, prior=0.9)  # trusted: the random draft drafts from the start
    timed, observe = [], engine.spec.step_observers["draft"].observe
    engine.spec.step_observers["draft"].observe = lambda rows, seconds: (timed.append(rows), observe(rows, seconds))[1]
    run = method.runner.run
    method.runner.run = lambda *a, **kw: (time.sleep(0.03), run(*a, **kw))[1]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.generate([[1, 5, 9, 2] * 4], params)
    assert len(timed) >= ObservedForwards.MIN_SEEN and set(timed) == {1}
    assert sorted(engine.spec.costs.draft_seconds) == sorted(measured.draft_seconds)
    assert engine.spec.costs.draft(1) >= 0.03 > measured.draft(1)
    assert engine.spec.costs.target_seconds.keys() == measured.target_seconds.keys()
    before = engine.spec.stats_by_method["draft"].num_draft_tokens
    method.accept_rate = AcceptanceEMA(ema=0.05, prior=0.9)
    engine.generate([[3, 6, 8, 4] * 4], params)
    # a draft position now costs 30 ms beside a few-ms target step: only the probes draft
    assert engine.spec.stats_by_method["draft"].num_draft_tokens - before <= 24 // method.probe_every + 1
    assert_pool_empty(engine)
