"""Per-request speculation method (SamplingParams.spec_method) on an engine with a draft model:
greedy output unchanged, mixed methods in the same steps, and the two commit horizons: every
request shares every committed block, and a draft request trusts draft KV only where marked."""

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
    assert engine.spec_methods == ("draft", "ngram", "suffix")
    out = engine.generate(prompts[:1], GREEDY)[0]
    assert out["token_ids"] == expected[0] and out["stats"].spec_method == "draft"
    ngram_engine = make_engine(tiny_llama_dir, method="ngram")
    assert ngram_engine.spec_methods == ("ngram", "suffix")
    out = ngram_engine.generate(prompts[:1], NGRAM)[0]
    assert out["token_ids"] == expected[0] and out["stats"].spec_method == "ngram"


def noisy_self_draft_engine(model_dir):
    """Self-draft on pools full of noise: acceptance is exactly 1.0 only if the draft's KV for
    every position it reads is right (a draft that trusted a block without draft KV drafts from
    noise: that mistake measured 1 of 78 drafts accepted)."""
    engine = make_engine(model_dir, model_dir)
    noise = torch.Generator().manual_seed(0)
    for runner in (engine.models.target_runner, engine.models.draft_runner):
        runner.kv_cache.pool.copy_(torch.randn(runner.kv_cache.pool.shape, generator=noise) * 30)
    return engine


def test_prefix_cache_across_methods_keeps_draft_kv_valid(tiny_llama_dir):
    engine = noisy_self_draft_engine(tiny_llama_dir)
    cold = make_engine(tiny_llama_dir, method=None, enable_prefix_caching=False)
    history = engine.tokenizer.encode("a long conversation " * 8)  # ~65 tokens: 4 full blocks
    first = engine.generate([history], NGRAM)[0]
    assert first["token_ids"] == cold.generate([history], GREEDY)[0]["token_ids"]
    turn2 = history + first["token_ids"] + engine.tokenizer.encode(" and then?")
    expected = cold.generate([turn2], GREEDY)[0]["token_ids"]

    second = engine.generate([turn2], DRAFT)[0]  # the n-gram turn's blocks: target KV, no draft KV
    assert second["token_ids"] == expected
    assert second["stats"].cached_tokens >= len(history)  # shared all the same...
    assert second["stats"].num_accepted == second["stats"].num_drafted > 0  # ...and its draft caught up

    third = engine.generate([turn2], DRAFT)[0]  # now the blocks carry the draft's mark
    assert third["token_ids"] == expected
    assert third["stats"].cached_tokens >= len(history)
    assert third["stats"].num_accepted == third["stats"].num_drafted > 0

    for params in (NGRAM, OFF):  # blocks with draft KV serve the others too
        out = engine.generate([turn2], params)[0]
        assert out["token_ids"] == expected
        assert out["stats"].cached_tokens >= len(history)
    assert_pool_empty(engine)


@pytest.mark.parametrize("order", [("draft", "off"), ("off", "draft")])
def test_draft_and_spec_off_requests_share_each_others_prefix(tiny_llama_dir, order):
    """The same conversation, turn by turn, alternating a draft request and a spec-off one:
    each turn reuses all of the previous turn's blocks whoever computed them, outputs equal a
    cold engine's, and the draft's acceptance stays near 1.0 (its KV is right wherever it reads;
    a draft reading blocks without draft KV accepts next to nothing)."""
    engine = noisy_self_draft_engine(tiny_llama_dir)
    cold = make_engine(tiny_llama_dir, method=None, enable_prefix_caching=False)
    prompt = engine.tokenizer.encode("Shared prefixes, both ways. " * 3)
    params = {"draft": DRAFT, "off": OFF}
    num_committed = 0  # full blocks the previous turn computed (all but its last token's KV)
    for turn, name in enumerate(order * 2):
        out = engine.generate([prompt], params[name])[0]
        assert out["token_ids"] == cold.generate([prompt], GREEDY)[0]["token_ids"]
        assert out["stats"].cached_tokens == num_committed  # every block of the previous turn
        if name == "draft":  # (not exactly 1.0: the draft computes the prompt in other chunks than the target)
            assert out["stats"].num_accepted >= 0.9 * out["stats"].num_drafted > 0
        num_committed = (len(prompt) + len(out["token_ids"]) - 1) // 16 * 16
        prompt = prompt + out["token_ids"] + engine.tokenizer.encode(f" turn {turn}?")
    assert_pool_empty(engine)


@pytest.mark.parametrize("max_tokens", [1, 8])
def test_a_long_prompt_with_a_short_reply_commits_its_prompt(tiny_llama_dir, tiny_draft_dir, max_tokens):
    """A draft request whose draft never sees its prompt (1 token) or may never draft (8, when
    priced out) still commits the target's blocks: the same prompt again reuses all of them,
    under every method."""
    spec = SpecConfig(method="draft", draft_model=str(tiny_draft_dir), num_draft_tokens=4)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), spec=spec, kv_cache_memory=8 << 20))
    prompt = [(7 * i) % 250 + 3 for i in range(1000)]
    short = dataclasses.replace(DRAFT, max_tokens=max_tokens)
    first = engine.generate([prompt], short)[0]
    assert first["stats"].cached_tokens == 0
    for params in (short, dataclasses.replace(NGRAM, max_tokens=max_tokens), dataclasses.replace(OFF, max_tokens=max_tokens)):
        again = engine.generate([prompt], params)[0]
        assert again["stats"].cached_tokens == (len(prompt) - 1) // 16 * 16
        assert again["token_ids"] == first["token_ids"]
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
        SamplingParams(spec_method="medusa")
    for engine in (ngram_engine, no_spec):
        assert_pool_empty(engine)


def test_an_explicitly_named_draft_with_another_tokenizer_is_an_error(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from tests.tiny_models import make_tiny_model

    other = make_tiny_model(tmp_path, "llama", seed=3, num_layers=1)
    tok = AutoTokenizer.from_pretrained(str(other))
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tok.save_pretrained(str(other))
    with pytest.raises(ValueError, match="draft model's tokenizer differs"):
        make_engine(tiny_llama_dir, other)
