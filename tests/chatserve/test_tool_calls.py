"""chatserve/tool_calls.py: the reply parser (whole and streamed in every split), tools / tool_choice
checks, the grammar that forces a call, checked by an llguidance matcher on the tiny tokenizer (tags
spelled out) and on tokens like Qwen2.5's (tags as added tokens); then forced calls decoded by the
tiny model: they parse, validate, and n-gram speculation leaves greedy output unchanged."""

import json
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.grammar import GrammarMatcher, grammar_tokenizer, lark_grammar
from chatserve.tool_calls import (ToolCall, ToolCallParser, parse_call, parse_tool_choice, parse_tools,
                                  split_reply, tool_call_grammar)
from chatserve.sampling_params import SamplingParams
from tests.chatserve.test_engine import assert_pool_empty

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def streamed(text: str, cuts: list[int], max_calls=None, tool_names=()) -> tuple[str, list[ToolCall], list]:
    """Feed `text` cut at `cuts`; every item as it came out."""
    parser, items = ToolCallParser(max_calls, tool_names), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        items += parser.feed(text[a:b])
    items += parser.finish()
    return "".join(i for i in items if isinstance(i, str)), parser.calls, items


def test_one_call_alone():
    content, calls = split_reply(CALL)
    assert content == "" and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    entry = calls[0].to_dict()
    assert entry["type"] == "function" and entry["id"].startswith("call_") and len(entry["id"]) == 29
    assert calls[0].to_dict(index=2)["index"] == 2


def test_text_before_between_and_after_calls():
    text = "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n\nDone."
    content, calls = split_reply(text)
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Oslo"]
    assert content == "Let me check.\n\n\n\nDone."  # the blanks around and between calls
    assert len({c.id for c in calls}) == 2


def test_a_reply_without_calls_is_unchanged():
    for text in ["plain text\n\n", "a < b and <tool", "  x  ", "<tool_cal", ""]:
        assert split_reply(text) == (text, [])


@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {', 'not json', '["f"]', '{"arguments": {}}',
                                  '{"name": "f", "arguments": [1]}', '{"name": 3}'])
def test_malformed_call_stays_content(body):
    text = f"<tool_call>\n{body}\n</tool_call>"
    assert split_reply(text) == (text, [])


def test_unclosed_call_counts_if_its_json_parses():
    content, calls = split_reply('<tool_call>\n{"name": "now", "arguments": {}}\n')
    assert content == "" and calls[0].name == "now"
    assert split_reply("<tool_call>\n{\"name\": ")[1] == []


def test_arguments_as_a_json_string_and_missing_arguments():
    assert json.loads(parse_call('{"name": "f", "arguments": "{\\"a\\": 1}"}').arguments) == {"a": 1}
    assert parse_call('{"name": "f"}').arguments == "{}"
    assert parse_call('{"name": "f", "arguments": {"s": "é"}}').arguments == '{"s": "é"}'


def test_max_calls_keeps_the_first():
    content, calls = split_reply(CALL + "\n" + CALL.replace("Paris", "Oslo"), max_calls=1)
    assert content == "" and [json.loads(c.arguments)["city"] for c in calls] == ["Paris"]


TEXTS = ["Sure.\n" + CALL + "\nbye", CALL + CALL, "x <tool_c y " + CALL, "<tool_call>\nnot json\n</tool_call> z"]


@pytest.mark.parametrize("text", TEXTS)
def test_every_two_way_split_streams_what_the_whole_gives(text):
    whole_content, whole_calls = split_reply(text)
    for cut in range(len(text) + 1):
        content, calls, _ = streamed(text, [cut])
        assert content == whole_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


@pytest.mark.parametrize("text", TEXTS)
def test_character_by_character(text):
    content, calls, _ = streamed(text, list(range(1, len(text))))
    whole_content, whole_calls = split_reply(text)
    assert (content, [c.arguments for c in calls]) == (whole_content, [c.arguments for c in whole_calls])


def test_partial_tag_is_held_back_not_leaked():
    parser = ToolCallParser()
    assert parser.feed("Hello <tool_c") == ["Hello"]  # the space waits for what follows
    assert parser.feed("all>\n{\"name\": \"now\", ") == []
    items = parser.feed('"arguments": {}}\n</tool_call>')
    assert len(items) == 1 and isinstance(items[0], ToolCall)
    assert parser.feed(" <tool") == [] and parser.feed("kit") == ["  <toolkit"]  # with the blank held since "Hello "


def test_items_come_in_order():
    _, _, items = streamed("a" + CALL + "b", [3, 30])
    assert [type(i) for i in items] == [str, ToolCall, str]


BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("text, is_call", [
    (BARE, True), (f"```json\n{BARE}\n```", True), (f"  ```\n{BARE}```\n", True),
    ('{"name": "other", "arguments": {}}', False), ('{"answer": 42}', False), ("```python\nprint(1)\n```", False),
    ("{not json", False), (f"Here: {BARE}", False),
])
def test_bare_calls_naming_a_tool(text, is_call):
    """Qwen2.5-Coder's habit: the call's JSON without tags, maybe in a ```json fence."""
    content, calls = split_reply(text, tool_names=("get_weather",))
    assert (content, [c.name for c in calls]) == (("", ["get_weather"]) if is_call else (text, []))
    assert split_reply(text) == (text, [])  # without tools: never a call
    for cut in range(len(text) + 1):
        streamed_content, streamed_calls, _ = streamed(text, [cut], tool_names=("get_weather",))
        assert streamed_content == content and [c.arguments for c in streamed_calls] == [c.arguments for c in calls]


def test_a_reply_that_may_be_a_bare_call_is_held_to_the_end():
    parser = ToolCallParser(tool_names=("get_weather",))
    assert parser.feed(" ``") == [] and parser.feed("`json\n{") == [] and parser.feed('"a": 1}\n```') == []
    assert parser.finish() == [' ```json\n{"a": 1}\n```']
    tagged = ToolCallParser(tool_names=("get_weather",))
    assert tagged.feed("`x` ") == ["`x`"]  # not a fence: streamed at once
    assert [type(i) for i in tagged.feed(CALL) + tagged.finish()] == [ToolCall]


def test_parse_tools_and_tool_choice():
    tools = parse_tools([WEATHER, NOW])
    assert tools[1]["function"] == {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                  "additionalProperties": False}}
    assert parse_tool_choice(None, tools) == "auto" and parse_tool_choice(None, []) == "none"
    assert parse_tool_choice("required", tools) == "required"
    assert parse_tool_choice({"type": "function", "function": {"name": "now"}}, tools) == "now"
    for bad in ["sometimes", {"type": "function", "function": {"name": "nope"}}, {"name": "now"}]:
        with pytest.raises(ValueError, match="tool_choice"):
            parse_tool_choice(bad, tools)
    with pytest.raises(ValueError, match="needs a non-empty"):
        parse_tool_choice("required", [])


@pytest.mark.parametrize("tools, match", [
    ({"type": "function"}, "must be a list"),
    ([{"type": "code_interpreter"}], r"tools\[0\]"),
    ([{"type": "function", "function": {"name": "has space"}}], r"tools\[0\].function.name"),
    ([NOW, NOW], "declared twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "parameters"),
])
def test_bad_tools_are_refused(tools, match):
    with pytest.raises(ValueError, match=match):
        parse_tools(tools)


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    from tests.tiny_models import make_tokenizer

    hf = make_tokenizer(tmp_path_factory.mktemp("tok"))
    return hf, grammar_tokenizer(hf, [hf.eos_token_id])


def accepts(tok, grammar: str, text: str) -> bool:
    hf, ll_tok = tok
    ids = hf.encode(text)
    matcher = GrammarMatcher(ll_tok, lark_grammar(grammar))
    return matcher.num_valid(ids) == len(ids)


def test_grammar_forces_a_declared_call(tiny_tok):
    tools = parse_tools([WEATHER, NOW])
    required = tool_call_grammar(tools, None, is_parallel=False, are_tags_tokens=False)
    assert accepts(tiny_tok, required, CALL)
    assert accepts(tiny_tok, required, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert not accepts(tiny_tok, required, '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>')
    assert not accepts(tiny_tok, required, '<tool_call>\n{"name": "get_weather", "arguments": {}}')  # city required
    assert not accepts(tiny_tok, required, "Sure")
    assert not accepts(tiny_tok, required, CALL.replace('": "', '":"'))  # written as templates write calls
    assert not accepts(tiny_tok, required, CALL + "\n" + CALL)  # not parallel: one call
    parallel = tool_call_grammar(tools, None, is_parallel=True, are_tags_tokens=False)
    assert accepts(tiny_tok, parallel, CALL + "\n" + CALL)
    named = tool_call_grammar(tools, "now", is_parallel=False, are_tags_tokens=False)
    assert not accepts(tiny_tok, named, CALL)


def test_grammar_with_tags_as_tokens(tmp_path):
    """As in Qwen2.5's tokenizer: <tool_call> is an added (non-special) token, which llguidance
    matches only by the `<tool_call>` token syntax."""
    from tokenizers import AddedToken

    from tests.tiny_models import make_tokenizer

    hf = make_tokenizer(tmp_path)
    hf.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    ll_tok = grammar_tokenizer(hf, [hf.eos_token_id])
    grammar = tool_call_grammar(parse_tools([WEATHER]), "get_weather", False, are_tags_tokens=True)
    ids = hf.encode(CALL)
    assert ids[0] == hf.convert_tokens_to_ids("<tool_call>")
    assert GrammarMatcher(ll_tok, lark_grammar(grammar)).num_valid(ids) == len(ids)
    assert hf.decode(ids, skip_special_tokens=True) == CALL  # the tags survive decoding


# ---------------------------------------------------------------- decoding a forced call (tiny model)

class Weather(BaseModel):
    """Bounded, so a random model's call ends well within max_tokens."""

    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=8)
    unit: Literal["C", "F"]


BOUNDED_TOOLS = parse_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": Weather.model_json_schema()}},
    {"type": "function", "function": {"name": "now"}},
])
# The prompts hold calls, so n-gram lookup finds drafts in them.
CHATS = [[{"role": "user", "content": 'Call like <tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Oslo", "unit": "C"}}\n</tool_call> please'}],
         [{"role": "user", "content": "What time is it?"}]]


def assert_declared_call(result) -> ToolCall:
    assert result["finish_reason"] == "stop", result
    content, calls = split_reply(result["text"])
    assert content == "" and len(calls) == 1, result["text"]
    arguments = json.loads(calls[0].arguments)
    if calls[0].name == "get_weather":
        Weather.model_validate(arguments)
    else:
        assert calls[0].name == "now" and arguments == {}
    return calls[0]


@pytest.mark.parametrize("name", [None, "get_weather", "now"])
def test_forced_call_parses_and_ngram_speculation_leaves_it_unchanged(tiny_llama_dir, name):
    grammar = tool_call_grammar(BOUNDED_TOOLS, name, is_parallel=False, are_tags_tokens=False)
    params = SamplingParams(max_tokens=300, temperature=0.0, grammar=grammar)
    plain = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20))
    prompts = [plain.tokenizer.apply_chat_template(chat, tools=BOUNDED_TOOLS) for chat in CHATS]
    expected = plain.generate(prompts, params)
    for result in expected:
        call = assert_declared_call(result)
        assert name is None or call.name == name
    spec = SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    ngram = Engine(EngineConfig(model=str(tiny_llama_dir), spec=spec, kv_cache_memory=8 << 20))
    results = [ngram.generate([p], params)[0] for p in prompts]
    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in expected]
    assert sum(r["stats"].num_drafted for r in results) > 0
    assert_pool_empty(plain)
    assert_pool_empty(ngram)


def test_a_bad_grammar_is_refused_naming_grammar(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20))
    with_tags_as_tokens = tool_call_grammar(BOUNDED_TOOLS, None, False, are_tags_tokens=True)  # not this tokenizer's
    with pytest.raises(ValueError, match="grammar: .*<tool_call>"):
        engine.add_request([1, 2], SamplingParams(grammar=with_tags_as_tokens))
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar="start: x", json_schema='{"type": "object"}')
    assert_pool_empty(engine)
