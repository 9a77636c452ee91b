"""OpenAI-compatible HTTP: SSE framing, whole responses, error shapes; plus /health, /metrics, the UI."""

from __future__ import annotations

import json

import pytest

from .fake_engine import FakeEngine

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def sse_events(response) -> list:
    """Parse an SSE body into JSON objects (and the final "[DONE]"), checking the framing."""
    body = response.text if hasattr(response, "text") else response
    assert body.endswith("data: [DONE]\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return events[:-1]


def test_chat_completion_whole(client, engine):
    response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 50, "temperature": 0})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": engine.reply},
                                "logprobs": None, "finish_reason": "stop"}]
    n = len(engine.prompts[0])
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": len(engine.reply),
                             "total_tokens": n + len(engine.reply), "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.params[0].temperature == 0 and engine.params[0].max_tokens == 50


def test_stream_events_are_one_line_for_every_line_splitter(make_client):
    """Generated text may hold characters that str.splitlines() (httpx's aiter_lines, which the
    soak client reads with) breaks lines at: each event is still one line, and its JSON the text."""
    reply = "a\u2028b\u2029c\x85d\x1ce\x0bf\x0cg\nh\ri"
    client = make_client(FakeEngine(reply=reply))
    response = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    lines = [line for line in response.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == reply


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_completion_stream(client, engine, include_usage):
    body = {**CHAT, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    if include_usage:
        usage_event = events.pop()
        assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == len(engine.reply)
        assert all(e["usage"] is None for e in events)
    else:
        assert all("usage" not in e for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == engine.reply
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "stop"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])


def test_completion_whole_and_stream(client, engine):
    whole = client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 5}).json()
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == engine.reply[:5]
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["prompt_tokens"] == 9
    events = sse_events(client.post("/v1/completions", json={"prompt": [72, 105], "stream": True,
                                                             "stream_options": {"include_usage": True}}))
    assert engine.prompts[-1] == [72, 105]
    usage = events.pop()
    assert usage["object"] == "text_completion" and usage["usage"]["prompt_tokens"] == 2
    assert "".join(e["choices"][0]["text"] for e in events) == engine.reply[:16]  # OpenAI's default max_tokens


@pytest.mark.parametrize("style", ["delta", "raise"])
def test_engine_error_mid_stream(client, engine, style):
    engine.error, engine.error_style = "ran out of blocks", style
    events = sse_events(client.post("/v1/chat/completions", json={**CHAT, "stream": True}))
    assert events[-1] == {"error": {"message": "generation failed: ran out of blocks", "type": "server_error",
                                    "param": None, "code": "engine_error"}}
    response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
    assert engine.num_free_blocks == engine.num_blocks
    engine.error = None
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", 400, "bad_json"),
    ("/v1/chat/completions", b"[]", 400, "bad_message"),
    ("/v1/chat/completions", json.dumps({"model": "fake-model"}), 400, "bad_message"),
    ("/v1/chat/completions", json.dumps({**CHAT, "messages": []}), 400, "empty_messages"),
    ("/v1/chat/completions", json.dumps({**CHAT, "model": "gpt-9"}), 404, "model_not_found"),
    ("/v1/chat/completions", json.dumps({**CHAT, "n": 17}), 400, "invalid_params"),
    ("/v1/chat/completions", json.dumps({**CHAT, "max_tokens": 10 ** 6}), 400, "invalid_params"),
    ("/v1/chat/completions", json.dumps({**CHAT, "temperature": "warm"}), 400, "invalid_params"),
    ("/v1/chat/completions", json.dumps({**CHAT, "stream_options": {"include_usage": True}}), 400, "bad_message"),
    ("/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 3000}]}), 400,
     "prompt_too_long"),
    ("/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 9000}]}), 413,
     "too_large"),
    ("/v1/completions", json.dumps({"prompt": ""}), 400, "empty_messages"),
    ("/v1/completions", json.dumps({"prompt": ["a", "b"]}), 400, "bad_message"),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": [1]}), 400, "invalid_params"),
]


@pytest.mark.parametrize("path,body,status,code", BAD_REQUESTS, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD_REQUESTS)])
def test_openai_error_shape(make_client, path, body, status, code):
    client = make_client(FakeEngine(max_model_len=2048), max_message_bytes=8192, max_prompt_tokens=1000)
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code and error["message"]
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200  # and the server still serves


def test_max_tokens_up_to_the_context_is_cut_to_what_the_prompt_leaves(make_client):
    engine = FakeEngine(max_model_len=2048)
    client = make_client(engine, max_tokens_limit=100)
    for field in ("max_tokens", "max_completion_tokens"):
        assert client.post("/v1/chat/completions", json={**CHAT, field: 1000}).status_code == 200
        assert client.post("/v1/chat/completions", json={**CHAT, field: 2048}).status_code == 200
        refused = client.post("/v1/chat/completions", json={**CHAT, field: 2049})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
        assert "2048 (the model's context)" in refused.json()["error"]["message"]
    client.post("/v1/chat/completions", json=CHAT)  # no max_tokens: the server's max_tokens_limit
    client.post("/v1/completions", json={"prompt": "x" * 2000, "max_tokens": 500})
    num_prompt_tokens = len(engine.prompts[1])
    assert [p.max_tokens for p in engine.params] == [1000, 2048 - num_prompt_tokens] * 2 + [100, 48]


def test_unknown_route_and_method_are_openai_shaped(client):
    assert client.get("/v1/nope").json()["error"]["code"] == "not_found"
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"


def test_api_key_for_http(make_client):
    client = make_client(FakeEngine(), api_key="sekret")
    for path, method in (("/v1/chat/completions", "post"), ("/v1/completions", "post"), ("/v1/models", "get")):
        response = client.request(method, path, json=CHAT)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        bad = client.request(method, path, json=CHAT, headers={"authorization": "Bearer nope"})
        assert bad.status_code == 401
    good = client.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sekret"})
    assert good.status_code == 200
    assert client.get("/health").status_code == 200  # health and metrics stay open for probes


def test_cross_origin_http_post_is_refused(client):
    response = client.post("/v1/chat/completions", json=CHAT, headers={"origin": "http://evil.example"})
    assert response.status_code == 403 and response.json()["error"]["code"] == "forbidden_origin"
    assert client.post("/v1/chat/completions", json=CHAT, headers={"origin": "http://testserver"}).status_code == 200


def test_models(client):
    assert client.get("/v1/models").json() == {"object": "list", "data": [
        {"id": "fake-model", "object": "model", "created": pytest.approx(0, abs=1e10), "owned_by": "chatserve",
         "max_model_len": 2048}]}


def test_served_model_name(make_client):
    client = make_client(FakeEngine(), served_model_name="my-model")
    assert client.get("/v1/models").json()["data"][0]["id"] == "my-model"
    assert client.post("/v1/chat/completions", json={**CHAT, "model": "my-model"}).json()["model"] == "my-model"


def test_health(client, engine):
    body = client.get("/health").json()
    assert body["status"] == "ok" and body["model"] == "fake-model" and body["draft"] == "ngram"
    assert body["num_free_blocks"] == body["num_blocks"] == engine.num_blocks and body["kv_usage"] == 0


def test_health_reports_a_broken_engine(client, engine):
    engine.stats = lambda: 1 / 0
    response = client.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "error"
    assert client.get("/metrics").status_code == 200


METRIC_NAMES = [
    "chatserve:time_to_first_token_seconds_bucket", "chatserve:inter_token_latency_seconds_bucket",
    "chatserve:e2e_request_latency_seconds_bucket", "chatserve:request_queue_time_seconds_bucket",
    "chatserve:num_requests_running", "chatserve:num_requests_waiting", "chatserve:kv_cache_usage_perc",
    "chatserve:prefix_cache_queries_total", "chatserve:prefix_cache_hits_total",
    "chatserve:spec_decode_num_drafts_total", "chatserve:spec_decode_num_draft_tokens_total",
    "chatserve:spec_decode_num_accepted_tokens_total", "chatserve:prompt_tokens_total",
    "chatserve:generation_tokens_total", "chatserve:num_preemptions_total",
    'chatserve:request_success_total{finished_reason="stop",model_name="fake-model"}',
    'chatserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="fake-model",position="0"}',
]


def test_metrics(make_client):
    engine = FakeEngine(tokens_per_delta=3)
    client = make_client(engine)
    client.post("/v1/chat/completions", json=CHAT)
    client.post("/v1/chat/completions", json=CHAT)
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in METRIC_NAMES:
        assert name in text, name
    assert 'chatserve:request_success_total{finished_reason="stop",model_name="fake-model"} 2.0' in text
    assert f'chatserve:generation_tokens_total{{model_name="fake-model"}} {2.0 * len(engine.reply)}' in text
    assert 'chatserve:time_to_first_token_seconds_count{model_name="fake-model"} 2.0' in text


def test_every_metric_carries_the_served_model_name(make_client):
    client = make_client(FakeEngine(), served_model_name="org/my-model")
    client.post("/v1/chat/completions", json={**CHAT, "model": "org/my-model"})
    samples = [line for line in client.get("/metrics").text.splitlines() if line.startswith("chatserve:")]
    assert len(samples) > len(METRIC_NAMES)
    for line in samples:
        assert 'model_name="org/my-model"' in line, line


def test_static_ui(client):
    page = client.get("/")
    assert page.status_code == 200 and 'id="input"' in page.text and "chat.js" in page.text
    assert client.get("/chat.js").status_code == 200 and client.get("/style.css").status_code == 200
