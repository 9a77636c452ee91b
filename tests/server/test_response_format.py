"""response_format against a real `chatserve serve` subprocess (tiny model, draft model): the
openai client's json_schema reply parses and validates, json_object on /v1/completions, the
websocket setting, a 400 naming response_format for a bad schema, and the pool free after."""

import json

import openai
import pytest

from tests.chatserve.test_structured_output import Person

from .real_server import wait_pool_free, ws_connect

RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_completion_reply_validates(drafted_server, drafted_client, temperature):
    reply = drafted_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Who are you?"}],
                                           max_tokens=300, temperature=temperature, seed=3,
                                           response_format=RESPONSE_FORMAT)
    assert reply.choices[0].finish_reason == "stop"
    Person.model_validate_json(reply.choices[0].message.content)
    wait_pool_free(drafted_server)


def test_streamed_chat_completion_validates(drafted_server, drafted_client):
    chunks = drafted_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=300, temperature=0, response_format=RESPONSE_FORMAT,
                                            stream=True)
    Person.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    wait_pool_free(drafted_server)


def test_completion_json_object_and_text(drafted_server, drafted_client):
    reply = drafted_client.completions.create(model="tiny", prompt="{", max_tokens=48, temperature=0,
                                      extra_body={"response_format": {"type": "json_object"}})
    assert reply.choices[0].text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].text), dict)
    plain = drafted_client.completions.create(model="tiny", prompt="{", max_tokens=8, temperature=0,
                                      extra_body={"response_format": {"type": "text"}})
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 8  # unconstrained
    wait_pool_free(drafted_server)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
    {"type": "yaml"},
])
def test_bad_response_format_is_a_400_naming_it(drafted_client, response_format):
    with pytest.raises(openai.BadRequestError) as info:
        drafted_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format=response_format)
    assert info.value.body["param"] == "response_format" and "response_format" in info.value.body["message"]


def test_websocket_setting(drafted_server):
    with ws_connect(drafted_server) as ws:
        ws.send(json.dumps({"type": "settings", "params": {"response_format": RESPONSE_FORMAT, "max_tokens": 300,
                                                           "temperature": 0}}))
        assert json.loads(ws.recv(timeout=60))["params"]["response_format"] == RESPONSE_FORMAT
        ws.send(json.dumps({"type": "chat", "content": "Hello"}))
        text = ""
        while (msg := json.loads(ws.recv(timeout=60)))["type"] == "delta":
            text += msg["text"]
        assert msg["type"] == "done" and msg["finish_reason"] == "stop", msg
        Person.model_validate_json(text)
        ws.send(json.dumps({"type": "settings", "params": {"response_format": {"type": "json_schema"}}}))
        error = json.loads(ws.recv(timeout=60))
        assert error["type"] == "error" and "response_format" in error["message"]
    wait_pool_free(drafted_server)
