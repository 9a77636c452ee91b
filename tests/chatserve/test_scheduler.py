"""Scheduler.prefill_tokens_next_step: the prompt tokens the next step will feed next to the
decodes (what speculation prices draft rows against)."""

from chatserve.config import EngineConfig
from chatserve.engine import Engine
from chatserve.scheduler import Scheduler, StepCosts
from chatserve.sampling_params import SamplingParams


def test_prefill_tokens_next_step_follows_the_schedule(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, max_num_seqs=2,
                                 max_num_batched_tokens=32, stall_limit=0))
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


def test_step_costs_split_a_mixed_step_by_the_decode_estimate():
    costs = StepCosts(alpha=0.5)
    costs.observe(0.030, num_prompt_tokens=10, num_decodes=2)
    assert costs.prompt_token_s is None  # no decode estimate yet to subtract
    costs.observe(0.010, num_prompt_tokens=0, num_decodes=2)
    costs.observe(0.030, num_prompt_tokens=10, num_decodes=2)
    assert costs.decode_s == 0.010 and abs(costs.prompt_token_s - 0.002) < 1e-12
    costs.observe(0.100, num_prompt_tokens=100, num_decodes=0)  # a prompt alone: all its time
    assert abs(costs.prompt_token_s - 0.0015) < 1e-12  # EMA of 2 ms and 1 ms
    assert costs.mixed_steps == 1 and not costs.decode_stale
    costs.observe(0.020, num_prompt_tokens=0, num_decodes=1)
    assert abs(costs.decode_s - 0.015) < 1e-12 and costs.mixed_steps == 0


def test_prompt_chunks_beside_decodes_keep_to_the_stall_limit(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, max_num_batched_tokens=64,
                                 stall_limit=3.0))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    sched = engine.scheduler
    engine.add_request([5] * 10, params, "r0")
    engine.step()  # r0 prefilled alone, now decoding
    engine.add_request([6] * 100, params, "r1")

    def chunks():
        return [(s.req.request_id, s.num_new_tokens) for s in sched.schedule()]

    sched.costs.decode_s, sched.costs.prompt_token_s = 0.010, 0.001  # (3 - 1) * 10 ms / 1 ms = 20 tokens
    assert sched.prefill_tokens_next_step() == 20
    assert chunks() == [("r0", 1), ("r1", 20)]
    sched.costs.prompt_token_s = 0.1  # one prompt token costs 10 decode steps: the floor still advances
    assert chunks() == [("r0", 1), ("r1", Scheduler.MIN_PROMPT_CHUNK)]
    sched.stall_limit = 0  # off: the token budget alone
    assert chunks() == [("r0", 1), ("r1", 63)]
    sched.stall_limit, sched.costs.prompt_token_s = 3.0, None  # a prompt token unmeasured: the floor
    assert chunks() == [("r0", 1), ("r1", Scheduler.MIN_PROMPT_CHUNK)]
    sched.costs.decode_s = None  # a decode step unmeasured: this step feeds decodes only, to measure it
    assert chunks() == [("r0", 1)]
    sched.costs.decode_s, sched.costs.mixed_steps = 0.010, StepCosts.REFRESH  # and again when stale
    assert chunks() == [("r0", 1)] and sched.prefill_tokens_next_step() == 0


def test_a_prompt_alone_takes_the_whole_budget_and_the_engine_measures_its_steps(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, max_num_batched_tokens=64))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request([7] * 100, params, "r0")
    engine.scheduler.costs.decode_s, engine.scheduler.costs.prompt_token_s = 0.010, 0.001
    assert [s.num_new_tokens for s in engine.scheduler.schedule()] == [64]  # no stream to stall
    engine.scheduler.costs = StepCosts()
    while engine.has_unfinished():
        engine.step()
    costs = engine.scheduler.costs
    assert costs.prompt_token_s > 0 and costs.decode_s > 0
    engine.check_no_leaks()


def test_the_shortest_prompt_goes_first_so_a_follow_up_does_not_queue_behind_a_paste(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20, max_num_batched_tokens=32))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request([5] * 200, params, "paste")
    engine.step()  # the paste's first 32 tokens
    engine.add_request([6] * 20, params, "short")
    sched = engine.scheduler
    sched.stall_limit = 0  # the token budget alone: the rest goes on to the paste
    assert [(s.req.request_id, s.num_new_tokens) for s in sched.schedule()] == [("short", 20), ("paste", 12)]
    sched.stall_limit = 3.0  # the short prompt's first token ends the step: the paste waits while the
    sched.costs.decode_s, sched.costs.prompt_token_s = 0.010, 0.002  # 10 more tokens take 2 decode steps
    assert [(s.req.request_id, s.num_new_tokens) for s in sched.schedule()] == [("short", 20), ("paste", 10)]
    engine.scheduler.preempt(engine.requests["paste"])  # back to waiting, the paste is re-run from its tokens
    while engine.has_unfinished():
        engine.step()
    engine.check_no_leaks()
