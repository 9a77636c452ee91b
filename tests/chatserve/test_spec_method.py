"""Per-request speculation method (SamplingParams.spec_method) on an engine with a draft model:
greedy output unchanged, mixed methods in the same steps, and the prefix-cache rule that a
draft request only reuses blocks whose draft KV is valid."""

import dataclasses

import pytest
import torch

from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams
from tests.chatserve.test_engine import assert_pool_empty

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
DRAFT = dataclasses.replace(GREEDY, spec_method="draft")
NGRAM = dataclasses.replace(GREEDY, spec_method="ngram")
OFF = dataclasses.replace(GREEDY, num_draft_tokens=0)
PROMPTS = ["Hello there", "def add(a, b):", "1, 2, 3, 4,", "The quick brown fox jumps over",
           "SELECT * FROM", "x"]


def make_engine(model_dir, draft_dir=None, method="draft", **kw):
    spec = None
    if method:
        spec = SpecConfig(method=method, draft_model=str(draft_dir) if draft_dir else None,
                          num_draft_tokens=4, adaptive=False)
    kw.setdefault("kv_cache_memory", 8 << 20)
    return Engine(EngineConfig(model=str(model_dir), spec=spec, **kw))


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, method=None)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    return prompts, [engine.generate([p], GREEDY)[0]["token_ids"] for p in prompts]


def test_mixed_methods_in_one_batch_match_spec_off(tiny_llama_dir, tiny_draft_dir, plain):
    prompts, expected = plain
    engine = make_engine(tiny_llama_dir, tiny_draft_dir)
    params = [DRAFT, NGRAM, OFF] * 2
    steps = []  # per step: the methods of the decodes that were scheduled
    schedule = engine.scheduler.schedule

    def recording_schedule():
        scheduled = schedule()
        steps.append({s.req.stats.spec_method for s in scheduled if s.is_decode})
        engine.block_manager.check_invariants([r.table for r in engine.requests.values()])
        return scheduled

    engine.scheduler.schedule = recording_schedule
    outs = engine.generate(prompts, params)
    assert [o["token_ids"] for o in outs] == expected
    assert any(methods == {"draft", "ngram", None} for methods in steps), "the three never shared a step"
    for o, p in zip(outs, params):
        st = o["stats"]
        assert st.spec_method == {DRAFT: "draft", NGRAM: "ngram", OFF: None}[p]
        if p is OFF:
            assert st.num_drafted == 0
    assert all(o["stats"].num_drafted > 0 for o, p in zip(outs, params) if p is DRAFT)
    assert engine.spec.stats.num_draft_tokens == sum(o["stats"].num_drafted for o in outs)
    assert_pool_empty(engine)


def test_preemption_with_mixed_methods_keeps_outputs(tiny_llama_dir, tiny_draft_dir, plain):
    """A small pool forces preemption; preempted requests re-match the prefix cache with their
    own draft-KV need (shared prompts make the cache matter)."""
    prompts, expected = plain
    models = make_engine(tiny_llama_dir, tiny_draft_dir).models
    per_block = sum(r.kv_cache.num_bytes // models.block_manager.num_blocks
                    for r in (models.target_runner, models.draft_runner))
    engine = make_engine(tiny_llama_dir, tiny_draft_dir, kv_cache_memory=10 * per_block)
    assert engine.block_manager.num_blocks == 10
    prompts, expected, params = prompts * 2, expected * 2, [DRAFT, NGRAM, OFF, NGRAM, DRAFT, OFF] * 2
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert [o["token_ids"] for o in outs] == expected
    assert_pool_empty(engine)


def test_default_method_is_the_engines(tiny_llama_dir, tiny_draft_dir, plain):
    prompts, expected = plain
    engine = make_engine(tiny_llama_dir, tiny_draft_dir)
    assert engine.spec_methods == ("draft", "ngram")
    out = engine.generate(prompts[:1], GREEDY)[0]
    assert out["token_ids"] == expected[0] and out["stats"].spec_method == "draft"
    ngram_engine = make_engine(tiny_llama_dir, method="ngram")
    assert ngram_engine.spec_methods == ("ngram",)
    out = ngram_engine.generate(prompts[:1], NGRAM)[0]
    assert out["token_ids"] == expected[0] and out["stats"].spec_method == "ngram"


def test_prefix_cache_across_methods_keeps_draft_kv_valid(tiny_llama_dir):
    """Self-draft: acceptance is exactly 1.0 only if the draft's KV for every reused block is
    right. Both pools start as noise, so a draft turn that attached an n-gram turn's blocks
    (no draft KV written) drafts garbage: that mistake measured 1 of 78 drafts accepted."""
    engine = make_engine(tiny_llama_dir, tiny_llama_dir)
    noise = torch.Generator().manual_seed(0)
    for runner in (engine.models.target_runner, engine.models.draft_runner):
        runner.kv_cache.pool.copy_(torch.randn(runner.kv_cache.pool.shape, generator=noise) * 30)
    cold = make_engine(tiny_llama_dir, method=None, enable_prefix_caching=False)
    history = engine.tokenizer.encode("a long conversation " * 8)  # ~65 tokens: 4 full blocks
    first = engine.generate([history], NGRAM)[0]
    assert first["token_ids"] == cold.generate([history], GREEDY)[0]["token_ids"]
    turn2 = history + first["token_ids"] + engine.tokenizer.encode(" and then?")
    expected = cold.generate([turn2], GREEDY)[0]["token_ids"]

    second = engine.generate([turn2], DRAFT)[0]  # the n-gram turn's blocks hold no draft KV
    assert second["token_ids"] == expected
    assert second["stats"].cached_tokens == 0
    assert second["stats"].num_accepted == second["stats"].num_drafted > 0

    third = engine.generate([turn2], DRAFT)[0]  # now the draft turn's blocks are cached
    assert third["token_ids"] == expected
    assert third["stats"].cached_tokens >= len(history)
    assert third["stats"].num_accepted == third["stats"].num_drafted > 0

    for params in (NGRAM, OFF):  # blocks with draft KV serve the others too
        out = engine.generate([turn2], params)[0]
        assert out["token_ids"] == expected
        assert out["stats"].cached_tokens >= len(history)
    assert_pool_empty(engine)


def test_ngram_turns_share_their_prefix_on_a_draft_engine(tiny_llama_dir, tiny_draft_dir):
    engine = make_engine(tiny_llama_dir, tiny_draft_dir)
    history = engine.tokenizer.encode("a long conversation " * 8)
    first = engine.generate([history], NGRAM)[0]
    turn2 = history + first["token_ids"] + engine.tokenizer.encode(" and then?")
    second = engine.generate([turn2], NGRAM)[0]
    assert second["stats"].cached_tokens >= len(history)
    assert_pool_empty(engine)


def test_unavailable_method_is_a_clear_error(tiny_llama_dir):
    ids = [1, 2, 3]
    ngram_engine = make_engine(tiny_llama_dir, method="ngram")
    with pytest.raises(ValueError, match="spec_method: 'draft' needs a draft model"):
        ngram_engine.add_request(ids, DRAFT)
    no_spec = make_engine(tiny_llama_dir, method=None)
    with pytest.raises(ValueError, match="spec_method: this engine runs without speculation"):
        no_spec.add_request(ids, NGRAM)
    with pytest.raises(ValueError, match="spec_method: must be one of 'draft', 'ngram'"):
        SamplingParams(spec_method="eagle")
    for engine in (ngram_engine, no_spec):
        assert_pool_empty(engine)
