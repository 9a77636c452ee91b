"""tools / tool_choice on /v1/chat/completions with a FakeEngine that replies with scripted calls:
message.tool_calls and finish_reason "tool_calls", the same streamed as delta.tool_calls with no
tag leaked as content, what each tool_choice offers and constrains, tool messages in, refusals."""

from __future__ import annotations

import json

import pytest

from chatserve import openai_protocol as OP
from chatserve import protocol as P

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time."}}
ASK = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER, NOW]}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def sse_chunks(response) -> list[dict]:
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_call_in_the_reply_becomes_message_tool_calls(client, engine):
    engine.reply = "Let me look.\n" + CALL
    body = client.post("/v1/chat/completions", json=ASK).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert engine.params[-1].grammar is None  # auto: parsed after, not constrained
    assert "<tools>" in engine.detokenize(engine.prompts[-1])  # offered through the template


def test_only_a_call_gives_null_content(client, engine):
    engine.reply = CALL
    message = client.post("/v1/chat/completions", json=ASK).json()["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1


@pytest.mark.parametrize("tokens_per_delta", [1, 3, 1000])
def test_streamed_calls_never_leak_a_tag(make_client, tokens_per_delta):
    from .fake_engine import FakeEngine

    engine = FakeEngine("Checking <tool_c.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"),
                        tokens_per_delta=tokens_per_delta)
    response = make_client(engine).post("/v1/chat/completions", json={**ASK, "stream": True})
    chunks = sse_chunks(response)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == "Checking <tool_c."
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [tc["index"] for tc in calls] == [0, 1]
    assert [json.loads(tc["function"]["arguments"])["city"] for tc in calls] == ["Paris", "Oslo"]
    assert all(tc["id"].startswith("call_") and tc["type"] == "function" for tc in calls)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_malformed_call_stays_content_and_stops(client, engine):
    engine.reply = "<tool_call>\n{not json}\n</tool_call>"
    choice = client.post("/v1/chat/completions", json=ASK).json()["choices"][0]
    assert choice["message"]["content"] == engine.reply and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_parallel_tool_calls_false_keeps_the_first(client, engine):
    engine.reply = CALL + "\n" + CALL.replace("Paris", "Oslo")
    body = client.post("/v1/chat/completions", json={**ASK, "parallel_tool_calls": False}).json()
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris"]


def test_tool_choice_none_offers_nothing_and_parses_nothing(client, engine):
    engine.reply = CALL
    choice = client.post("/v1/chat/completions", json={**ASK, "tool_choice": "none"}).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": CALL} and choice["finish_reason"] == "stop"
    assert "<tools>" not in engine.detokenize(engine.prompts[-1])


def test_required_and_named_choices_set_a_grammar(client, engine):
    engine.reply = CALL
    client.post("/v1/chat/completions", json={**ASK, "tool_choice": "required"})
    required = engine.params[-1].grammar
    assert '"get_weather"' in required and '"now"' in required and '("\\n" tool_call)*' in required
    named = {"type": "function", "function": {"name": "now"}}
    client.post("/v1/chat/completions", json={**ASK, "tool_choice": named, "parallel_tool_calls": False})
    grammar = engine.params[-1].grammar
    assert '"now"' in grammar and "get_weather" not in grammar and "tool_call)*" not in grammar
    assert '"<tool_call>"' in grammar  # the fake tokenizer spells the tags


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_fields_are_400s_naming_them(client, engine, extra, param):
    response = client.post("/v1/chat/completions", json={**ASK, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert engine.prompts == []


ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_tool_results_and_assistant_calls_are_accepted(client, engine):
    engine.reply = "It is sunny."
    body = client.post("/v1/chat/completions", json={"messages": ROUND_TRIP, "tools": [WEATHER]}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert "<tool>sunny, 21 C</tool>" in engine.detokenize(engine.prompts[-1])


def test_messages_are_normalized_for_the_template():
    """arguments become objects (the Qwen2.5 template writes `arguments | tojson`)."""
    assistant, tool = P.parse_chat_messages(ROUND_TRIP)[1:]
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert tool == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}


@pytest.mark.parametrize("message, match", [
    ({"role": "tool", "content": "x"}, "tool_call_id"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
     "not JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}, "tool_calls"),
    ({"role": "assistant", "content": None}, "content"),
])
def test_bad_tool_messages_are_refused(message, match):
    with pytest.raises(P.ProtocolError, match=match):
        P.parse_chat_messages([{"role": "user", "content": "x"}, message])


def test_tags_as_tokens_reach_the_grammar():
    """With Qwen2.5's tokenizer (<tool_call> an added token) the grammar names the token."""
    body = {**ASK, "tool_choice": "required"}
    as_tokens = OP.parse_chat_completion_request(body, 64, 2048, are_tool_tags_tokens=True).params.grammar
    as_text = OP.parse_chat_completion_request(body, 64, 2048).params.grammar
    assert 'tool_call: <tool_call> "\\n"' in as_tokens and 'tool_call: "<tool_call>" "\\n"' in as_text
    auto = OP.parse_chat_completion_request(ASK, 64, 2048)
    assert auto.params.grammar is None and [t["function"]["name"] for t in auto.tools] == ["get_weather", "now"]
    assert OP.parse_chat_completion_request({**ASK, "tool_choice": "none"}, 64, 2048).tools is None


def test_each_of_n_choices_is_parsed_for_calls_on_its_own(client, engine):
    """Choice i's reply comes from its seed (seed + i): choice 0 calls, choice 1 answers in text."""
    engine.reply_fn = lambda prompt, params: CALL if params.seed == 5 else "Sunny, I think."
    body = client.post("/v1/chat/completions", json={**ASK, "n": 2, "seed": 5}).json()
    calls, text = body["choices"]
    assert (calls["index"], calls["finish_reason"], calls["message"]["content"]) == (0, "tool_calls", None)
    assert calls["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert (text["index"], text["finish_reason"], text["message"]) == (1, "stop", {"role": "assistant",
                                                                                  "content": "Sunny, I think."})
    assert [p.seed for p in engine.params[-2:]] == [5, 6]
    streamed = sse_chunks(client.post("/v1/chat/completions", json={**ASK, "n": 2, "seed": 5, "stream": True}))
    by_index = {0: [], 1: []}
    for chunk in streamed:
        [choice] = chunk["choices"]
        by_index[choice["index"]].append(choice)
    assert any("tool_calls" in c["delta"] for c in by_index[0])
    assert [c["finish_reason"] for c in by_index[0] + by_index[1] if c["finish_reason"]] == ["tool_calls", "stop"]
    assert "".join(c["delta"].get("content") or "" for c in by_index[1]) == "Sunny, I think."


def test_the_deprecated_functions_api_is_read_as_tools(client, engine):
    """functions / function_call in, message.function_call and finish_reason "function_call" out
    (whole and streamed), and the deprecated messages (an assistant's function_call, a function
    role answer) rendered as a tool call and a tool message."""
    legacy = {"messages": ASK["messages"], "functions": [WEATHER["function"], NOW["function"]]}
    engine.reply = CALL
    choice = client.post("/v1/chat/completions", json=legacy).json()["choices"][0]
    assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] is None
    assert choice["message"]["function_call"]["name"] == "get_weather"
    assert json.loads(choice["message"]["function_call"]["arguments"]) == {"city": "Paris"}
    assert engine.params[-1].grammar is None and "<tools>" in engine.detokenize(engine.prompts[-1])
    client.post("/v1/chat/completions", json={**legacy, "function_call": {"name": "get_weather"}})
    assert engine.params[-1].grammar is not None  # a named function forces the call, as tool_choice does
    chunks = sse_chunks(client.post("/v1/chat/completions", json={**legacy, "stream": True}))
    [call] = [c["choices"][0]["delta"]["function_call"] for c in chunks if "function_call" in c["choices"][0]["delta"]]
    assert call["name"] == "get_weather" and chunks[-1]["choices"][0]["finish_reason"] == "function_call"
    client.post("/v1/chat/completions", json={**legacy, "function_call": "none"})
    assert "<tools>" not in engine.detokenize(engine.prompts[-1])

    engine.reply = "It is sunny in Paris."
    history = [*ASK["messages"], {"role": "assistant", "content": None, "function_call": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}, {"role": "function", "name": "get_weather",
                                                                    "content": "sunny"}]
    answer = client.post("/v1/chat/completions", json={**legacy, "messages": history}).json()["choices"][0]
    assert answer["message"] == {"role": "assistant", "content": "It is sunny in Paris."}
    assert "<tool>sunny</tool>" in engine.detokenize(engine.prompts[-1])


@pytest.mark.parametrize("body, param", [
    ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions"),
    ({"function_call": "auto", "tool_choice": "auto", "tools": [WEATHER]}, "function_call"),
    ({"functions": {"name": "f"}}, "functions"),
    ({"functions": [WEATHER["function"]], "function_call": {"name": "nope"}}, "tool_choice"),
])
def test_the_deprecated_functions_api_refusals_name_a_field(client, body, param):
    error = client.post("/v1/chat/completions", json={"messages": ASK["messages"], **body}).json()["error"]
    assert error["param"] == param and error["code"] == "invalid_params"
