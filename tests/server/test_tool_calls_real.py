"""Tool calls against a real `chatserve serve` subprocess (tiny random model, draft model on) with the
official openai client: a round trip (forced call, `tool` message, final answer), streamed and not;
the call parses and its arguments validate against the tool's schema."""

import json

import openai
import pytest

from tests.chatserve.test_tool_calls import Weather

from .real_server import wait_pool_free

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": Weather.model_json_schema()}},
         {"type": "function", "function": {"name": "now", "description": "The time."}}]
QUESTION = {"role": "user", "content": "What's the weather in Paris?"}


def assert_valid(name: str, arguments: str) -> None:
    if name == "get_weather":
        Weather.model_validate_json(arguments)
    else:
        assert name == "now" and json.loads(arguments) == {}


def streamed_call(client, **kwargs) -> tuple[dict, str]:
    """The streamed reply's assistant message (tool_calls put together from the deltas) and finish reason."""
    calls, content, finish_reason = {}, "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            call["id"] += delta.id or ""
            call["function"]["name"] += delta.function.name or ""
            call["function"]["arguments"] += delta.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    message = {"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}
    return message, finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_call_tool_message_answer(drafted_server, drafted_client, stream):
    ask = dict(model="tiny", messages=[QUESTION], tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
               temperature=0, max_tokens=300)
    if stream:
        assistant, finish_reason = streamed_call(drafted_client, **ask)
    else:
        reply = drafted_client.chat.completions.create(**ask)
        finish_reason = reply.choices[0].finish_reason
        assistant = reply.choices[0].message.model_dump(exclude_none=True)
    assert finish_reason == "tool_calls" and assistant.get("content") is None
    [call] = assistant["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert_valid(call["function"]["name"], call["function"]["arguments"])
    result = {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature_c": 21, "sky": "clear"}'}
    answer = drafted_client.chat.completions.create(model="tiny", messages=[QUESTION, assistant, result], tools=TOOLS,
                                            temperature=0, max_tokens=16)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert isinstance(answer.choices[0].message.content, str) and not answer.choices[0].message.tool_calls
    wait_pool_free(drafted_server)


def test_streamed_and_whole_give_the_same_call(drafted_client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask = dict(model="tiny", messages=[QUESTION], tools=TOOLS, tool_choice=named, temperature=0, max_tokens=300,
               parallel_tool_calls=False)
    whole = drafted_client.chat.completions.create(**ask).choices[0].message.tool_calls
    streamed, _ = streamed_call(drafted_client, **ask)
    assert [(c.function.name, c.function.arguments) for c in whole] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in streamed["tool_calls"]]
    assert whole[0].function.name == "get_weather"
    assert_valid("get_weather", whole[0].function.arguments)


def test_unknown_named_function_is_a_400(drafted_client):
    with pytest.raises(openai.BadRequestError) as info:
        drafted_client.chat.completions.create(model="tiny", messages=[QUESTION], tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"
