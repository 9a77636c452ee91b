"""vLLM's /tokenize, /detokenize and /version, and /v1/models/{id}, against a real `chatserve serve`
on the tiny model with an API key: shapes, round trips, the chat template's count, errors, the key."""

import json
import tomllib
from pathlib import Path

import httpx
import pytest

from chatserve.tokenizer import Tokenizer

from .fake_engine import FakeEngine
from .real_server import RealServer

KEY = {"authorization": "Bearer sekret"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = RealServer(tiny_llama_dir, "--api-key", "sekret", "--max-message-bytes", "4096")
    yield srv.base
    srv.stop()


@pytest.fixture(scope="module")
def vocab_size(tiny_llama_dir) -> int:
    return Tokenizer(tiny_llama_dir).vocab_size


def post(server: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(server + path, content=content, headers={**KEY, "content-type": "application/json"})


def test_tokenize_then_detokenize_round_trips(server):
    text = "Hello, wörld! 123"
    body = post(server, "/tokenize", {"prompt": text}).json()
    max_model_len = httpx.get(server + "/v1/models", headers=KEY).json()["data"][0]["max_model_len"]
    assert set(body) == {"tokens", "count", "max_model_len"} and body["max_model_len"] == max_model_len
    assert body["count"] == len(body["tokens"]) >= len(text) and all(isinstance(t, int) for t in body["tokens"])
    assert post(server, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": text}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_chat_tokenize_counts_what_the_chat_completion_reports(server):
    with_prompt = post(server, "/tokenize", {"messages": MESSAGES}).json()
    completion = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()
    assert with_prompt["count"] == completion["usage"]["prompt_tokens"]
    without = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without["count"] < with_prompt["count"] and with_prompt["tokens"][:without["count"]] == without["tokens"]


def test_version_is_the_package_version(server):
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert httpx.get(server + "/version", headers=KEY).json() == {"version": pyproject["project"]["version"]}


def test_model_by_id(server):
    listed = httpx.get(server + "/v1/models", headers=KEY).json()["data"]
    assert httpx.get(server + "/v1/models/tiny", headers=KEY).json() == listed[0]
    response = httpx.get(server + "/v1/models/gpt-9", headers=KEY)
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "model 'gpt-9' does not exist; this server serves 'tiny'",
                                         "type": "not_found_error", "param": "model", "code": "model_not_found"}}


def test_model_id_with_a_slash(make_client):
    client = make_client(FakeEngine(), served_model_name="org/my-model")
    assert client.get("/v1/models/org/my-model").json()["id"] == "org/my-model"
    assert client.get("/v1/models/org").status_code == 404


BAD_TOKENIZE = [
    ({}, "prompt"),
    ({"prompt": "a", "messages": MESSAGES}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a"]}, "prompt"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]"),
    ({"messages": MESSAGES, "add_generation_prompt": "yes"}, "add_generation_prompt"),
    ([1, 2], None),
]


@pytest.mark.parametrize("body,param", BAD_TOKENIZE)
def test_tokenize_refuses_bad_bodies(server, body, param):
    response = post(server, "/tokenize", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "bad_message" and error["param"] == param
    assert param is None or param.split("[")[0] in error["message"]


@pytest.mark.parametrize("tokens", [None, "1 2", [1, "2"], [1.0], [True], [-1], "vocab", [10 ** 12]])
def test_detokenize_refuses_bad_tokens(server, vocab_size, tokens):
    tokens = [0, vocab_size] if tokens == "vocab" else tokens
    response = post(server, "/detokenize", {} if tokens is None else {"tokens": tokens})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "bad_message" and error["param"] == "tokens" and "tokens" in error["message"]


def test_detokenize_accepts_the_last_id(server, vocab_size):
    assert post(server, "/detokenize", {"tokens": [vocab_size - 1]}).status_code == 200


def test_limits_and_shapes_of_refusals(server):
    response = post(server, "/tokenize", {"prompt": "x" * 5000})  # over --max-message-bytes 4096
    assert response.status_code == 413 and response.json()["error"]["code"] == "too_large"
    assert post(server, "/detokenize", b"{not json").json()["error"]["code"] == "bad_json"
    response = httpx.get(server + "/tokenize", headers=KEY)  # falls through to the static UI's mount
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    response = httpx.post(server + "/version", headers=KEY)
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/version", None), ("GET", "/v1/models/tiny", None)])
def test_api_key_is_required(server, method, path, body):
    for headers in ({}, {"authorization": "Bearer nope"}):
        response = httpx.request(method, server + path, json=body, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert httpx.request(method, server + path, json=body, headers=KEY).status_code == 200
