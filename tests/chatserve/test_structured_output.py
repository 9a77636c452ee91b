"""Structured output (SamplingParams.json_schema) on tiny random models: the reply parses and
validates against the schema, greedy speculation (n-gram, a draft model, the model drafting for
itself) leaves it token for token unchanged, sampling with drafts stays valid, the pool empties."""

import dataclasses
import json
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams
from tests.chatserve.test_engine import assert_pool_empty


class Person(BaseModel):
    """Every field bounded, so a random model's reply ends well within max_tokens."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=99)
    ok: bool
    color: Literal["red", "green", "blue"]


SCHEMA = json.dumps(Person.model_json_schema())
GREEDY = SamplingParams(max_tokens=300, temperature=0.0, json_schema=SCHEMA)
# The prompts hold replies of the schema's shape, so n-gram lookup finds drafts in them.
PROMPTS = ['{"name":"Ann","age":7,"ok":true,"color":"red"} {"name":"Bo","age":',
           "Hello there", '{"name":"', "x"]


def make_engine(model_dir, method=None, draft_dir=None, **kw):
    spec = None
    if method:
        spec = SpecConfig(method=method, draft_model=str(draft_dir) if draft_dir else None, num_draft_tokens=4,
                          adaptive=False)
    return Engine(EngineConfig(model=str(model_dir), spec=spec, kv_cache_memory=8 << 20, **kw))


def assert_valid(result) -> Person:
    assert result["finish_reason"] == "stop", result
    return Person.model_validate_json(result["text"])


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    results = engine.generate(prompts, GREEDY)
    for r in results:
        assert_valid(r)
    assert_pool_empty(engine)
    return prompts, [r["token_ids"] for r in results]


def test_greedy_reply_ends_when_the_object_closes(plain, tiny_llama_dir):
    """No EOS is needed: once only EOS could follow, the request stops."""
    tok = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20)).tokenizer
    for token_ids in plain[1]:
        assert tok.decode(token_ids).endswith("}") and token_ids[-1] not in tok.eos_token_ids


@pytest.mark.parametrize("method", ["ngram", "draft", "self-draft"])
def test_greedy_speculation_leaves_constrained_output_unchanged(plain, tiny_llama_dir, tiny_draft_dir, method):
    prompts, expected = plain
    draft_dir = {"ngram": None, "draft": tiny_draft_dir, "self-draft": tiny_llama_dir}[method]
    engine = make_engine(tiny_llama_dir, "ngram" if method == "ngram" else "draft", draft_dir)
    results = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert [r["token_ids"] for r in results] == expected
    assert sum(r["stats"].num_drafted for r in results) > 0
    if method == "self-draft":  # masked draft == masked target: every model draft accepted (not suffix's)
        stats = engine.spec.stats_by_method["draft"]
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert_pool_empty(engine)


@pytest.mark.parametrize("method", [None, "ngram", "draft"])
def test_sampled_replies_match_the_schema(tiny_llama_dir, tiny_draft_dir, method):
    engine = make_engine(tiny_llama_dir, method, tiny_draft_dir if method == "draft" else None)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = [dataclasses.replace(GREEDY, temperature=t, top_p=p, seed=i)
              for i, (t, p) in enumerate([(1.0, 1.0), (0.7, 0.9), (1.5, 1.0), (1.0, 0.5)])]
    results = engine.generate(prompts, params)
    for r in results:
        assert_valid(r)
    if method:
        assert sum(r["stats"].num_drafted for r in results) > 0
    assert_pool_empty(engine)


def test_drafts_with_padding_ids_leave_the_grammar_as_it_was(tiny_llama_dir):
    """Drafts holding an id past the tokenizer's vocabulary (a padding row of the LM head, which a
    draft model samples after an EOS draft): counted valid up to it, and the matcher's mask
    unchanged after (llguidance's validate_tokens given one counted a refused EOS valid and
    stopped the matcher)."""
    engine = make_engine(tiny_llama_dir)
    tok, eos, vocab = engine.tokenizer, engine.tokenizer.eos_token_ids[0], engine.models.vocab_size
    padding = len(tok.hf)
    assert padding < vocab  # the tiny model's LM head has padding rows
    close, word = tok.encode("}"), tok.encode('"na')
    for text, num_valid in (('{"name":"Ann","age":7,"ok":true,"color":"red"', 2), ('{"name":"Ann"', 0), ("{", 0)):
        for drafts, expected in ((close + [eos, padding], num_valid), ([eos, padding], 0), ([padding], 0),
                                 (word + [padding], len(word) if text == "{" else 0)):
            grammar = engine._grammar_matcher(GREEDY)
            for t in tok.encode(text):
                grammar.consume(t)
            before = grammar.mask(vocab)
            assert grammar.num_valid(drafts) == expected, (text, drafts)
            assert torch.equal(grammar.mask(vocab), before) and not grammar.is_stopped


def test_sampled_replies_with_drafts_all_close_their_object(tiny_llama_dir, tiny_draft_dir):
    """Sampled chat replies under the draft model, one seed each: every reply that stops parses
    (seed 5 once stopped mid-object: its draft chain held an EOS and a padding id after it)."""
    engine = make_engine(tiny_llama_dir, "draft", tiny_draft_dir)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Who are you?"}])
    for seed in range(8):
        result = engine.generate([prompt], dataclasses.replace(GREEDY, temperature=1.0, seed=seed))[0]
        if result["finish_reason"] == "stop":
            assert_valid(result)
    assert_pool_empty(engine)


def test_json_object_and_a_bad_schema(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    prompt = engine.tokenizer.encode("x")
    any_object = SamplingParams(max_tokens=64, temperature=0.0, json_schema='{"type":"object"}')
    result = engine.generate([prompt], any_object)[0]
    if result["finish_reason"] == "stop":  # a random model may keep an object open past 64 tokens
        assert isinstance(json.loads(result["text"]), dict)
    else:
        assert result["text"].startswith("{")
    with pytest.raises(ValueError, match="response_format"):
        engine.add_request(prompt, dataclasses.replace(any_object, json_schema='{"type":"nonsense"}'))
    assert_pool_empty(engine)
