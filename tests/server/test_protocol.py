"""protocol.py on its own: parsing, settings -> SamplingParams, OpenAI request defaults."""

from __future__ import annotations

import pytest

from chatserve import openai_protocol as OP
from chatserve import protocol as P
from chatserve.sampling_params import RequestStats


def test_settings_to_sampling_params():
    params = P.build_sampling_params({"speculation": False, "stop": ["a", "b"], "top_k": -1, "temperature": 0}, 100)
    assert params.num_draft_tokens == 0 and params.stop == ("a", "b") and params.top_k == 0 and params.is_greedy
    assert P.build_sampling_params({"speculation": True, "num_draft_tokens": 3}, 100).num_draft_tokens == 3
    assert P.build_sampling_params({"speculation": True}, 100).num_draft_tokens is None
    with pytest.raises(P.ProtocolError) as e:
        P.build_sampling_params({"max_tokens": 101}, 100)
    assert e.value.code == P.INVALID_PARAMS and e.value.param == "max_tokens"
    with pytest.raises(P.ProtocolError) as e:
        P.build_sampling_params({"seed": -1}, 100)
    assert e.value.param == "seed"


def test_parse_client_messages():
    turn = P.parse_client_message('{"type": "chat", "id": 3, "content": "hi", "params": {"max_tokens": 5}}')
    assert turn == P.ChatTurn(3, None, "hi", {"max_tokens": 5})
    turn = P.parse_client_message('{"type": "chat", "messages": [{"role": "user", "content": '
                                  '[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}')
    assert turn.messages == [{"role": "user", "content": "ab"}]
    assert P.parse_client_message('{"type": "cancel"}') == P.Cancel(None)
    assert P.parse_client_message('{"type": "reset"}') == P.Reset()
    assert P.parse_client_message('{"type": "auth", "api_key": "k"}') == P.Auth("k")
    with pytest.raises(P.ProtocolError) as e:
        P.parse_client_message("[" * 100_000)  # deep nesting is refused before json.loads, not a crash
    assert e.value.code == P.TOO_DEEP and "32 levels" in e.value.message


@pytest.mark.parametrize("text,depth", [
    ("", 0), ("1", 0), ("[]", 1), ('{"a": [1, {"b": []}]}', 4), ('[[1], [2], [[3]]]', 3),
    ('["[[[[", "]"]', 1),  # brackets inside strings do not count
    ('["a\\"quote [[[", [2]]', 2),  # nor after an escaped quote
    ('["a\\\\", [["]"]]]', 3),  # an escaped backslash ends the string
    ("[" * 40 + "]" * 40, 40), ("[}" * 20, 1),  # not JSON: a number anyway, json.loads reports it
])
def test_json_depth(text, depth):
    assert P.json_depth(text) == depth


def test_json_depth_limit_is_exact_and_a_string_full_of_brackets_passes():
    nested = lambda n: '{"a": ' * n + "1" + "}" * n  # noqa: E731
    assert P.loads(nested(P.MAX_JSON_DEPTH), "x")
    with pytest.raises(P.ProtocolError) as e:
        P.loads(nested(P.MAX_JSON_DEPTH + 1), "x")
    assert e.value.code == P.TOO_DEEP
    assert P.loads('{"text": "' + "[" * 10_000 + '"}', "x") == {"text": "[" * 10_000}
    with pytest.raises(P.ProtocolError) as e:
        P.loads(b"\xff{}", "body")
    assert e.value.code == P.BAD_JSON


def test_openai_defaults():
    chat = OP.parse_chat_completion_request({"messages": [{"role": "user", "content": "x"}]}, 4096, 8192)
    assert chat.params.max_tokens == 4096 and not chat.stream and not chat.include_usage
    completion = OP.parse_completion_request({"prompt": ["hello"], "stream": True,
                                             "stream_options": {"include_usage": True}}, 4096, 8192)
    assert completion.prompt == "hello" and completion.params.max_tokens == 16 and completion.include_usage
    assert OP.parse_completion_request({"prompt": [[1, 2]]}, 10, 10).prompt_token_ids == [1, 2]


def test_done_stats_from_request_stats():
    stats = RequestStats(prompt_tokens=10, cached_tokens=8, num_generated=5, arrival_time=1.0,
                         first_scheduled_time=1.001, first_token_time=1.05, finish_time=1.09)
    stats.spec.update(4, 4)
    stats.spec.update(4, 2)
    done = P.done_message("x", "stop", P.DoneStats.from_request_stats(stats))
    assert done["stats"]["acceptance_rate"] == 0.75 and done["stats"]["mean_accepted_length"] == 4.0
    assert done["stats"]["ttft_ms"] == pytest.approx(50.0) and done["stats"]["tpot_ms"] == pytest.approx(10.0)
    assert done["stats"]["generated_tokens"] == 5 and done["stats"]["cached_tokens"] == 8


def test_ignore_eos_on_both_endpoints():
    """vLLM's `ignore_eos` extension (benchmarks use it for fixed-length replies)."""
    turn = P.parse_client_message('{"type": "chat", "content": "hi", "params": {"ignore_eos": true}}')
    assert P.build_sampling_params(turn.params, 100).ignore_eos
    chat = OP.parse_chat_completion_request({"messages": [{"role": "user", "content": "x"}], "ignore_eos": True}, 64, 64)
    assert chat.params.ignore_eos
    assert not OP.parse_chat_completion_request({"messages": [{"role": "user", "content": "x"}]}, 64, 64).params.ignore_eos
    with pytest.raises(P.ProtocolError) as e:
        OP.parse_chat_completion_request({"messages": [{"role": "user", "content": "x"}], "ignore_eos": "yes"}, 64, 64)
    assert e.value.code == P.INVALID_PARAMS and e.value.param == "ignore_eos"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("response_format, json_schema", [
    ({"type": "text"}, None),
    (None, None),
    ({"type": "json_object"}, {"type": "object"}),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}, SCHEMA),
])
def test_response_format_on_both_endpoints_and_the_websocket(response_format, json_schema):
    import json

    body = {"response_format": response_format}
    chat = OP.parse_chat_completion_request({"messages": [{"role": "user", "content": "x"}], **body}, 64, 64)
    completion = OP.parse_completion_request({"prompt": "x", **body}, 64, 64)
    turn = P.parse_client_message(json.dumps({"type": "chat", "content": "hi", "params": body}))
    for params in (chat.params, completion.params, P.build_sampling_params(turn.params, 64)):
        assert (params.json_schema and json.loads(params.json_schema)) == json_schema


@pytest.mark.parametrize("response_format", [
    "json", {"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": [1]}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}},
])
def test_bad_response_format_names_it(response_format):
    with pytest.raises(P.ProtocolError) as e:
        OP.parse_chat_completion_request({"messages": [{"role": "user", "content": "x"}],
                                         "response_format": response_format}, 64, 64)
    assert e.value.code == P.INVALID_PARAMS and e.value.param == "response_format" and e.value.status == 400
    assert e.value.message.startswith("response_format: ")
