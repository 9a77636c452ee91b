"""Engine behaviour on tiny random models: batching, preemption, prefix reuse, stops, errors."""

import dataclasses
import itertools
import random

import pytest

from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "Hello there",
    "def add(a, b):",
    "The quick brown fox jumps over",
    "x",
    "Once upon a time, in a land far away, there lived",
    "1, 2, 3, 4,",
    "SELECT * FROM",
    "Lorem ipsum dolor sit amet",
]


def make_engine(model_dir, **kw):
    kw.setdefault("kv_cache_memory", 8 << 20)
    return Engine(EngineConfig(model=str(model_dir), **kw))


def assert_pool_empty(engine):
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert not engine.requests


def run_with_random_aborts(engine, methods: list[dict], num_requests: int, seed: int = 0) -> None:
    """Requests i = 0..num_requests-1 (greedy and sampled in turn, methods[i % len(methods)]
    applied to their SamplingParams), run to the end with ~8% of steps aborting a random live
    one; the block manager's invariants are checked after every step and every abort."""
    tok, rng = engine.tokenizer, random.Random(seed)
    base = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=48, temperature=0.8, seed=1, ignore_eos=True)]
    live = set()
    for i in range(num_requests):
        prompt = tok.encode(f"item {i % 3}: a b c a b c " * (2 + i % 4))
        live.add(engine.add_request(prompt, dataclasses.replace(base[i % 2], **methods[i % len(methods)])))
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished:
                live.discard(d.request_id)
        engine.block_manager.check_invariants([r.table for r in engine.requests.values()])
        if live and rng.random() < 0.08:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            live.discard(victim)
            engine.block_manager.check_invariants([r.table for r in engine.requests.values()])


@pytest.fixture(scope="module")
def alone_outputs(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    return prompts, [engine.generate([p], GREEDY)[0]["token_ids"] for p in prompts]


def test_batch_invariance_eight_concurrent(tiny_llama_dir, alone_outputs):
    prompts, alone = alone_outputs
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=32)  # forces chunked prefill too
    outs = engine.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in outs] == alone
    assert_pool_empty(engine)


def test_preemption_keeps_outputs(tiny_llama_dir, alone_outputs):
    prompts, alone = alone_outputs
    # 12 blocks of 16 tokens cannot hold 8 sequences of ~40 tokens at once.
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # layers * (k, v) * block * kv_heads * head_dim * fp32
    engine = make_engine(tiny_llama_dir, kv_cache_memory=12 * per_block, enable_prefix_caching=False)
    assert engine.block_manager.num_blocks == 12
    outs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o["token_ids"] for o in outs] == alone
    assert_pool_empty(engine)


def test_second_turn_computes_only_new_tokens(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    history = engine.tokenizer.encode("a long conversation " * 50)  # ~1,000 tokens
    first = engine.generate([history], GREEDY)[0]
    assert first["stats"].cached_tokens == 0
    turn2 = history + first["token_ids"] + engine.tokenizer.encode(" and then?")
    second = engine.generate([turn2], GREEDY)[0]
    computed = second["stats"].prompt_tokens - second["stats"].cached_tokens
    assert second["stats"].cached_tokens >= len(history) + len(first["token_ids"]) - 16
    assert computed <= 16 + len(" and then?")
    # and the answer is what a cold engine gives
    cold = make_engine(tiny_llama_dir, enable_prefix_caching=False).generate([turn2], GREEDY)[0]
    assert second["token_ids"] == cold["token_ids"]
    assert_pool_empty(engine)


def test_stop_strings_trim_exactly_and_never_leak(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    ids = engine.tokenizer.encode("Hello there")
    full = engine.generate([ids], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    text = full["text"]
    stop = text[10:13]
    assert len(stop) == 3
    out = engine.generate([ids], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[: text.index(stop)]
    assert stop not in out["text"]


def test_stop_token_ids_and_max_tokens(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    ids = engine.tokenizer.encode("Hello")
    full = engine.generate([ids], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert len(full["token_ids"]) == 10 and full["finish_reason"] == "length"
    target = full["token_ids"][4]
    out = engine.generate([ids], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[target]))[0]
    assert out["finish_reason"] == "stop"
    assert out["token_ids"] == full["token_ids"][: full["token_ids"].index(target) + 1]


def test_generate_aborts_what_runs_past_its_deadline(tiny_llama_dir, alone_outputs):
    """generate(deadline=): the step that passes it is the last; unfinished requests end "abort"
    with the tokens they had (a prefix of what they would have said), every block freed."""
    import time

    prompts, outputs = alone_outputs
    engine = make_engine(tiny_llama_dir)
    calls = []
    outs = engine.generate(prompts[:2], GREEDY, deadline=time.perf_counter(), on_step=lambda: calls.append(1))
    assert len(calls) == 1 and [o["finish_reason"] for o in outs] == ["abort", "abort"]
    for out, alone in zip(outs, outputs):
        assert len(out["token_ids"]) <= 1 and out["token_ids"] == alone[: len(out["token_ids"])]
    assert_pool_empty(engine)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    ids = engine.tokenizer.encode("Hello")
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    a = engine.generate([ids], p)[0]["token_ids"]
    others = [engine.tokenizer.encode(x) for x in PROMPTS[:3]]
    b = engine.generate([ids] + others, [p] + [SamplingParams(max_tokens=16, temperature=1.0)] * 3)[0]["token_ids"]
    assert a == b
    c = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.9, seed=124, ignore_eos=True))[0]["token_ids"]
    assert a != c


def test_memory_stats_count_each_weight_storage_once(tiny_llama_dir):
    """The int4 loader carves a model's weights out of one arena: counting that storage once a view
    made SmolLM2-135M's weights 21 GB (session 58)."""
    engine = make_engine(tiny_llama_dir, quantization="int4", dtype="float32")
    mem = engine.memory_stats()
    tensors = list(itertools.chain(engine.models.target.parameters(), engine.models.target.buffers()))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert mem["weights_bytes"] == sum(storages.values())
    assert sum(t.nbytes for t in tensors) <= mem["weights_bytes"] < mem["rss_bytes"]


def test_abort_frees_blocks_at_once(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    rid = engine.add_request(engine.tokenizer.encode("Hello " * 30), GREEDY)
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    delta = engine.abort(rid)
    assert delta.finish_reason == "abort"
    assert not engine.has_unfinished()
    assert_pool_empty(engine)


def test_bad_input_errors_name_the_problem(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    with pytest.raises(ValueError, match="2048"):
        engine.add_request([5] * 2048, GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([5, 99999], GREEDY)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens="5")
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig.from_dict({"modle": "x"})
    assert_pool_empty(engine)


# -- speculation: greedy output must not change -------------------------------------------


def spec_engine(model_dir, draft, method="draft", **kw):
    spec = SpecConfig(method=method, draft_model=str(draft) if draft else None, num_draft_tokens=4, adaptive=False)
    return make_engine(model_dir, spec=spec, **kw)


def test_self_draft_accepts_everything_and_matches(tiny_llama_dir, alone_outputs):
    prompts, alone = alone_outputs
    engine = spec_engine(tiny_llama_dir, tiny_llama_dir)
    outs = engine.generate(prompts[:3], GREEDY)
    assert [o["token_ids"] for o in outs] == alone[:3]
    for o in outs:
        assert o["stats"].num_drafted > 0
        assert o["stats"].num_accepted == o["stats"].num_drafted  # acceptance 1.0
    assert_pool_empty(engine)


def test_random_draft_rejects_most_and_still_matches(tiny_llama_dir, tiny_draft_dir, alone_outputs):
    prompts, alone = alone_outputs
    engine = spec_engine(tiny_llama_dir, tiny_draft_dir)
    outs = engine.generate(prompts, GREEDY)  # 8 batched together
    assert [o["token_ids"] for o in outs] == alone
    drafted = sum(o["stats"].num_drafted for o in outs)
    accepted = sum(o["stats"].num_accepted for o in outs)
    assert drafted > 0 and accepted < drafted / 2
    assert_pool_empty(engine)


def test_ngram_matches_and_finds_repeats(tiny_llama_dir, alone_outputs):
    prompts, alone = alone_outputs
    engine = spec_engine(tiny_llama_dir, None, method="ngram")
    outs = engine.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in outs] == alone
    assert_pool_empty(engine)


def test_spec_respects_max_tokens_and_stop(tiny_llama_dir):
    engine = spec_engine(tiny_llama_dir, tiny_llama_dir)
    plain = make_engine(tiny_llama_dir)
    ids = plain.tokenizer.encode("Hello there")
    for n in (1, 2, 5, 7):
        p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        assert engine.generate([ids], p)[0]["token_ids"] == plain.generate([ids], p)[0]["token_ids"]
    full = plain.generate([ids], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    stop = full["text"][12:15]
    p = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    a, b = engine.generate([ids], p)[0], plain.generate([ids], p)[0]
    assert a["text"] == b["text"] and a["token_ids"] == b["token_ids"]
    assert_pool_empty(engine)


@pytest.mark.parametrize("spec", [None, SpecConfig(method="ngram", num_draft_tokens=3, adaptive=False)],
                         ids=["plain", "ngram"])
def test_lm_head_sees_only_the_rows_that_need_logits(tiny_llama_dir, spec):
    """The last chunk of a prompt needs the logits of its last row only (a decode step: one row
    plus one per draft). Computing the whole chunk's logits cost seconds of TTFT on a real model."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_num_batched_tokens=64, spec=spec))
    model = engine.models.target_runner.model
    seen = []
    original = model.compute_logits
    model.compute_logits = lambda hidden: (seen.append(hidden.shape[0]), original(hidden))[1]
    prompt = list(range(10, 110))  # 100 tokens: chunks of 64 and 36
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 12
    rows = [n for n in seen if n]  # (a mid-prompt chunk asks for none)
    assert rows[0] == 1  # the prompt's last chunk
    assert max(rows) <= 1 + (spec.num_draft_tokens if spec else 0)


@pytest.mark.parametrize("draft", ["self", "random"])
def test_deltas_say_how_each_token_came(tiny_llama_dir, tiny_draft_dir, draft):
    """Per delta: origins and text pieces, one per token; the accepted count is the stats',
    a step ends in one recovered or bonus token, and the pieces join to the text."""
    engine = spec_engine(tiny_llama_dir, tiny_llama_dir if draft == "self" else tiny_draft_dir)
    prompt = engine.tokenizer.encode("Hello there")
    engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    stats = deltas[-1].stats
    for d in deltas:
        assert len(d.origins) == len(d.pieces) == len(d.token_ids) and "".join(d.pieces) == d.text
        if d.origins[-1] in ("recovered", "bonus"):
            assert set(d.origins[:-1]) <= {"accepted"}
    origins = [o for d in deltas for o in d.origins]
    assert origins[0] == "target"  # the first token comes from the prompt's forward, with no drafts
    assert origins.count("accepted") == stats.num_accepted > (0 if draft == "self" else -1)
    assert "recovered" not in origins if draft == "self" else "recovered" in origins
    assert "".join(d.text for d in deltas) == engine.tokenizer.decode([t for d in deltas for t in d.token_ids])
