"""Integration on the real Qwen2.5-Coder-1.5B-Instruct (skipped unless it is in the cache): its chat
template offers a get_weather tool, and the reply to "What's the weather in Paris?" is a call that
parses and names Paris, unconstrained (tool_choice auto) and forced by the grammar (required), where
<tool_call> is one of the tokenizer's own tokens."""

import json

import pytest

from chatserve.catalog import DEFAULT_TARGET, cache_dir
from chatserve.config import EngineConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams
from chatserve.tool_calls import parse_tools, split_reply, tool_call_grammar

pytestmark = pytest.mark.slow
MODEL_DIR = cache_dir() / "models" / DEFAULT_TARGET
TOOLS = parse_tools([{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}])
CHAT = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine():
    if not (MODEL_DIR / "config.json").exists():
        pytest.skip(f"{DEFAULT_TARGET} is not in {MODEL_DIR.parent}")
    return Engine(EngineConfig(model=str(MODEL_DIR), kv_cache_memory=64 << 20))


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
