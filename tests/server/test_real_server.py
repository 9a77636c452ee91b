"""End to end against a real `chatserve serve` subprocess on a tiny model with a draft model:
websocket streaming and multi-turn reuse, the openai client, cancel (mid-stream and during the
prefill), disconnect, /health latency under load, bad input, and after each the pool back to
all blocks free (read from /health).

The server steps at most 16 tokens at a time (--max-num-batched-tokens 16), so a long prompt's
prefill takes many engine steps and a cancel can land inside it."""

import json
import time

import httpx
import pytest

from chatserve.config import EngineConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams

from .real_server import RealServer, wait_pool_free, ws_connect


@pytest.fixture(scope="module")
def long_prompt(tiny_llama_dir):
    """A user message whose greedy reply runs 300 tokens without EOS (so cancel has time)."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20))
    for i in range(50):
        text = f"Tell me a story number {i}"
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        if engine.generate([ids], SamplingParams(max_tokens=300, temperature=0.0))[0]["finish_reason"] == "length":
            return text
    pytest.fail("no prompt without an early EOS")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tiny_draft_dir):
    srv = RealServer(tiny_llama_dir, "--draft-model", str(tiny_draft_dir), "--no-adaptive",
                     "--max-num-batched-tokens", "16")
    yield srv.base
    srv.stop()


def cancel_and_wait_done(ws, turn_id: str) -> dict:
    ws.send(json.dumps({"type": "cancel", "id": turn_id}))
    while (msg := json.loads(ws.recv(timeout=60)))["type"] == "delta":
        pass
    return msg


def run_turn(ws, content: str, **params) -> tuple[list[dict], dict]:
    ws.send(json.dumps({"type": "chat", "content": content, "params": {"temperature": 0, **params}}))
    deltas = []
    while True:
        msg = json.loads(ws.recv(timeout=60))
        if msg["type"] == "delta":
            deltas.append(msg)
        else:
            return deltas, msg


def test_websocket_streams_and_second_turn_reuses_prefix(server):
    with ws_connect(server) as ws:
        deltas, done = run_turn(ws, "Hello there, how are you today? " * 3, max_tokens=24)
        assert done["type"] == "done", done
        assert deltas and done["stats"]["generated_tokens"] == sum(d["num_tokens"] for d in deltas)
        assert done["stats"]["drafted"] > 0  # the draft model ran
        deltas2, done2 = run_turn(ws, "And again?", max_tokens=8)
        assert done2["type"] == "done" and done2["stats"]["cached_tokens"] > 0
    wait_pool_free(server)


def test_openai_client_whole_and_streamed(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Say something"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content is not None and whole.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: same text either way
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    wait_pool_free(server)


def test_cancel_mid_stream_frees_blocks(server, long_prompt):
    with ws_connect(server) as ws:
        ws.send(json.dumps({"type": "chat", "id": "c1", "content": long_prompt,
                            "params": {"temperature": 0, "max_tokens": 300}}))
        first = json.loads(ws.recv(timeout=60))
        assert first["type"] == "delta"
        msg = cancel_and_wait_done(ws, "c1")
        assert msg["type"] == "done" and msg["finish_reason"] == "abort"
        assert msg["stats"]["generated_tokens"] < 300
        _, again = run_turn(ws, "still there?", max_tokens=4)  # the connection stays usable
        assert again["type"] == "done"
    wait_pool_free(server)


def test_disconnect_mid_stream_aborts(server, long_prompt):
    with ws_connect(server) as ws:
        ws.send(json.dumps({"type": "chat", "content": long_prompt, "params": {"temperature": 0, "max_tokens": 300}}))
        assert json.loads(ws.recv(timeout=60))["type"] == "delta"
    # leaving the block closed the socket mid-stream
    health = wait_pool_free(server)
    assert health["status"] == "ok"


def test_bad_input_then_server_still_answers(server):
    with ws_connect(server) as ws:
        ws.send("{not json")
        assert json.loads(ws.recv(timeout=10))["code"] == "bad_json"
        ws.send(json.dumps({"type": "chat", "content": "x" * 5000, "params": {"max_tokens": 4}}))
        err = json.loads(ws.recv(timeout=30))
        assert err["type"] == "error" and err["code"] in ("prompt_too_long", "invalid_prompt")
        _, done = run_turn(ws, "ok?", max_tokens=4)
        assert done["type"] == "done"
    metrics = httpx.get(server + "/metrics").text
    for name in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "spec_decode_num_drafts_total",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 'spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}'):
        assert f"chatserve:{name}" in metrics, name  # vLLM's names, with our prefix
    wait_pool_free(server)


def test_cancel_during_prefill(server):
    prompt = "Summarize this. " + "The quick brown fox jumps over the lazy dog. " * 40  # ~1.8k tokens, ~115 steps
    with ws_connect(server) as ws, httpx.Client() as http:
        ws.send(json.dumps({"type": "chat", "id": "p1", "content": prompt, "params": {"max_tokens": 50}}))
        deadline = time.monotonic() + 30
        while http.get(server + "/health").json()["num_running"] == 0:  # admitted: its prefill has begun
            assert time.monotonic() < deadline, "the request was never scheduled"
        msg = cancel_and_wait_done(ws, "p1")
        assert msg["type"] == "done" and msg["finish_reason"] == "abort", msg
        assert msg["stats"]["generated_tokens"] == 0 and msg["stats"]["ttft_ms"] is None  # no token yet
        wait_pool_free(server)
        _, again = run_turn(ws, "still there?", max_tokens=4)
        assert again["type"] == "done"
    wait_pool_free(server)


def test_health_answers_within_100ms_during_a_long_generation(server, long_prompt):
    latencies = []
    with ws_connect(server) as ws, httpx.Client() as http:
        # 1,500 tokens: with the C++ decode ops the tiny model's 300 took less than 20 polls.
        ws.send(json.dumps({"type": "chat", "id": "h1", "content": long_prompt,
                            "params": {"temperature": 0, "max_tokens": 1500, "ignore_eos": True}}))
        assert json.loads(ws.recv(timeout=60))["type"] == "delta"
        for _ in range(20):
            start = time.perf_counter()
            health = http.get(server + "/health").json()
            latencies.append(time.perf_counter() - start)
            assert health["num_running"] == 1  # the generation was still running when /health answered
            time.sleep(0.01)
        cancel_and_wait_done(ws, "h1")
    # /health waits on no engine step: polls answer in milliseconds as a rule. One stall of the shared CI
    # machine (a 0.63 s poll, once, in a clean-clone run) is not the server's doing, so one slow poll of the
    # 20 is allowed, and none may wait as long as a second.
    shown = [f"{t * 1000:.1f} ms" for t in latencies]
    assert sorted(latencies)[-2] < 0.1 and max(latencies) < 1.0, shown
    wait_pool_free(server)


def test_every_bad_input_gets_an_error_and_the_next_turn_works(server):
    frames = [
        ("{not json", "bad_json"),
        (json.dumps({"type": "chat", "content": 42}), "bad_message"),
        (json.dumps({"type": "shout"}), "unknown_type"),
        (json.dumps({"type": "chat", "content": ""}), "empty_messages"),
        (json.dumps({"type": "chat", "messages": []}), "empty_messages"),
        (json.dumps({"type": "chat", "content": "hi", "params": {"max_tokens": 10 ** 6}}), "invalid_params"),
        (json.dumps({"type": "chat", "content": "x" * 5000}), "prompt_too_long"),
        (json.dumps({"type": "chat", "content": "x" * (2 << 20)}), "too_large"),  # > --max-message-bytes (1 MiB)
        (b"\x00binary", "binary_frame"),
    ]
    with ws_connect(server) as ws:
        for frame, code in frames:
            ws.send(frame)
            error = json.loads(ws.recv(timeout=30))
            assert error["type"] == "error" and error["code"] == code and error["message"], (code, error)
            _, done = run_turn(ws, "ok?", max_tokens=2)
            assert done["type"] == "done", (code, done)
    from websockets.sync.client import connect

    with connect(server.replace("http", "ws") + "/ws", origin="http://evil.example") as ws:
        assert json.loads(ws.recv(timeout=10))["code"] == "forbidden_origin"
    response = httpx.post(server + "/v1/chat/completions", content=b"{oops",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "bad_json"
    port = server.rsplit(":", 1)[1]
    with ws_connect(server, origin=f"http://127.0.0.1:{port}") as ws:  # the UI's own origin is fine
        assert run_turn(ws, "fine?", max_tokens=2)[1]["type"] == "done"
    wait_pool_free(server)


def run_messages(ws, messages: list[dict], **params) -> tuple[str, dict]:
    ws.send(json.dumps({"type": "chat", "messages": messages, "params": {"temperature": 0, **params}}))
    text = ""
    while (msg := json.loads(ws.recv(timeout=60)))["type"] == "delta":
        text += msg["text"]
    return text, msg


def test_spec_method_per_turn_draft_and_ngram(server):
    """One server with a draft model runs n-gram turns too; greedy text does not depend on the
    method, each done reports who drafted, and every turn reuses the previous turn's blocks
    whoever computed them (a draft turn catches its draft up on an n-gram turn's)."""
    from websockets.sync.client import connect

    messages = [{"role": "user", "content": "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3"}]
    with connect(server.replace("http", "ws") + "/ws") as ws:
        assert json.loads(ws.recv())["spec_methods"] == ["draft", "ngram", "suffix"]
        ngram_text, ngram = run_messages(ws, messages, max_tokens=32, spec_method="ngram")
        draft_text, draft = run_messages(ws, messages, max_tokens=32, spec_method="draft")
        again_text, again = run_messages(ws, messages, max_tokens=32, spec_method="ngram")
    for done in (ngram, draft, again):
        assert done["type"] == "done", done
        assert done["stats"]["generated_tokens"] == 32
    assert ngram_text == draft_text == again_text
    assert ngram["stats"]["spec_method"] == again["stats"]["spec_method"] == "ngram"
    assert draft["stats"]["spec_method"] == "draft" and draft["stats"]["drafted"] > 0
    assert ngram["stats"]["drafted"] > 0 and ngram["stats"]["acceptance_rate"] is not None
    assert draft["stats"]["cached_tokens"] > 0 and again["stats"]["cached_tokens"] > 0
    wait_pool_free(server)
