"""Nothing silently ignored: every OpenAI field chatserve does not implement is a 400 naming it;
the values that ask for nothing, and metadata, are accepted."""

from __future__ import annotations

import pytest

from chatserve.openai_fields import UNSUPPORTED_FIELDS

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "Once upon"}

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ASKING = {  # a value of each unsupported field that asks for something
    "best_of": 3, "echo": True,
    "suffix": "and they lived",
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "reasoning_effort": "low",
    "verbosity": "low",
}
NEUTRAL = {"logit_bias": {},
           "logprobs": False, "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0.0,
           "modalities": ["text"], "audio": None, "prediction": None, "reasoning_effort": None}


def test_every_unsupported_field_has_a_case():
    assert set(ASKING) == set(UNSUPPORTED_FIELDS)


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("name", sorted(ASKING))
def test_unsupported_field_is_refused_by_name(client, engine, path, base, name):
    response = client.post(path, json={**base, name: ASKING[name]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error == {"message": error["message"], "type": "invalid_request_error", "param": name,
                     "code": "unsupported_parameter"}
    assert error["message"].startswith(f"{name}: ")
    assert engine.prompts == []  # refused before anything ran


@pytest.mark.parametrize("value", [True, 1.0, 6, "1"])
def test_logprobs_and_n_keep_booleans_apart_from_numbers(client, value):
    response = client.post("/v1/chat/completions", json={**CHAT, "n": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    logprobs = client.post("/v1/completions", json={**COMPLETION, "logprobs": value})
    assert logprobs.status_code == 400 and logprobs.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_values_that_ask_for_nothing_are_accepted(client, path, base):
    assert client.post(path, json={**base, **NEUTRAL}).status_code == 200
    assert client.post(path, json={**base, **{name: None for name in ASKING}}).status_code == 200


def test_metadata_is_accepted(client):
    metadata = {"user": "u-1", "metadata": {"app": "x"}, "store": True, "service_tier": "auto",
                "prompt_cache_key": "k", "safety_identifier": "s"}
    assert client.post("/v1/chat/completions", json={**CHAT, **metadata}).status_code == 200
    assert client.post("/v1/completions", json={**COMPLETION, **metadata}).status_code == 200


@pytest.mark.parametrize("path,body,name", [
    ("/v1/chat/completions", {**CHAT, "temprature": 0.2}, "temprature"),
    ("/v1/chat/completions", {**CHAT, "prompt": "hi"}, "prompt"),
    ("/v1/completions", {**COMPLETION, "messages": CHAT["messages"]}, "messages"),
    ("/v1/completions", {**COMPLETION, "chat_template_kwargs": {}}, "chat_template_kwargs"),
])
def test_unknown_fields_are_refused(client, path, body, name):
    response = client.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == name and error["code"] == "unsupported_parameter" and name in error["message"]
    assert "not a field of" in error["message"]


def test_the_first_refused_field_is_named_in_sorted_order(client):
    response = client.post("/v1/chat/completions", json={**CHAT, "suffix": "x", "best_of": 2})
    assert response.json()["error"]["param"] == "best_of"


@pytest.mark.parametrize("name, value", [("tools", [TOOL]), ("tool_choice", "none"), ("parallel_tool_calls", False),
                                         ("functions", []), ("function_call", "none")])
def test_tool_fields_are_read_on_chat_and_not_fields_of_completions(client, name, value):
    assert client.post("/v1/chat/completions", json={**CHAT, name: value}).status_code == 200
    error = client.post("/v1/completions", json={**COMPLETION, name: value}).json()["error"]
    assert error["param"] == name and "not a field of /v1/completions" in error["message"]
