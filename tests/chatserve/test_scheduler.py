"""Scheduler.prefill_tokens_next_step: the prompt tokens the next step will feed next to the
decodes (what speculation prices draft rows against)."""

from chatserve.config import EngineConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams


def test_prefill_tokens_next_step_follows_the_schedule(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, max_num_seqs=2,
                                 max_num_batched_tokens=32))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((20, 30, 10)):
        engine.add_request([5 + i] * n, params, f"r{i}")
    sched = engine.scheduler
    assert sched.prefill_tokens_next_step() == 32  # r0 + r1 (two free slots) = 50, capped by the budget
    engine.step()  # r0 prefilled whole (20), r1's first 12 tokens; r2 waits for a slot
    assert [r.request_id for r in sched.running] == ["r0", "r1"]
    assert sched.prefill_tokens_next_step() == 18  # r1's rest; r0 decodes; no free slot for r2
    engine.step()
    assert sched.prefill_tokens_next_step() == 0  # both decode, r2 still has no slot
    while engine.has_unfinished():
        engine.step()
    assert sched.prefill_tokens_next_step() == 0
