"""Websocket chat: framing, conversation across turns, settings, cancel, reset and disconnect."""

from __future__ import annotations

import dataclasses
import time

import pytest

from chatserve.server.websocket import SETTING_DEFAULTS

from .conftest import chat, receive_until, wait_for
from .fake_engine import FakeEngine

DONE_STATS = {"ttft_ms", "tpot_ms", "queue_ms", "prompt_tokens", "cached_tokens", "generated_tokens", "drafted",
              "accepted", "acceptance_rate", "mean_accepted_length", "spec_method"}


def test_ready_then_deltas_then_done(client, engine):
    with client.websocket_connect("/ws") as ws:
        ready = ws.receive_json()
        assert ready == {"type": "ready", "model": "fake-model", "draft": "ngram", "spec_methods": ["ngram"],
                         "spec_method_labels": {"ngram": "n-gram"},
                         "max_model_len": 2048, "max_tokens_limit": 4096, "settings": {},
                         "defaults": {**SETTING_DEFAULTS, "max_tokens": 256, "temperature": 1.0}}
        messages = chat(ws, content="hi", id="m1")
    *deltas, done = messages
    assert deltas and all(m["type"] == "delta" and m["id"] == "m1" and m["num_tokens"] >= 1 for m in deltas)
    assert "".join(m["text"] for m in deltas) == engine.reply
    assert done["type"] == "done" and done["id"] == "m1" and done["finish_reason"] == "stop"
    assert set(done["stats"]) == DONE_STATS
    assert done["stats"]["generated_tokens"] == len(engine.reply) == sum(m["num_tokens"] for m in deltas)
    assert done["stats"]["prompt_tokens"] == len(engine.prompts[0]) and done["stats"]["ttft_ms"] >= 0


def test_speculative_bursts_count_tokens(make_client):
    engine = FakeEngine("one two three four five", tokens_per_delta=4)
    with make_client(engine).websocket_connect("/ws") as ws:
        ws.receive_json()
        *deltas, done = chat(ws, content="go")
    assert sum(m["num_tokens"] for m in deltas) == done["stats"]["generated_tokens"] == len(engine.reply)
    assert done["stats"]["drafted"] > 0 and 0 < done["stats"]["acceptance_rate"] <= 1
    assert done["stats"]["mean_accepted_length"] > 1
    assert isinstance(done["id"], str)  # the server names turns the client did not name


def test_deltas_carry_each_tokens_text_and_origin(make_client):
    """`tokens`: per token, [its text, how it came]; tokens whose text is held (here the first
    two, as if half a character) arrive with the next delta that has text."""
    class HoldingEngine(FakeEngine):
        async def generate(self, prompt_token_ids, params, request_id=None, prompt_source_id=None):
            async for delta in super().generate(prompt_token_ids, params, request_id, prompt_source_id):
                if delta.token_ids == [ord("a"), ord("b")]:
                    delta = dataclasses.replace(delta, text="", pieces=["", ""])
                elif delta.token_ids[:2] == [ord("c"), ord("d")]:
                    delta = dataclasses.replace(delta, text="ab" + delta.text, pieces=["ab" + delta.pieces[0],
                                                                                      *delta.pieces[1:]])
                yield delta

    engine = HoldingEngine("xyabcdef", tokens_per_delta=2)
    with make_client(engine).websocket_connect("/ws") as ws:
        ws.receive_json()
        *deltas, done = chat(ws, content="go")
    assert [(m["text"], m["num_tokens"], m["tokens"]) for m in deltas] == [
        ("xy", 2, [["x", "target"], ["y", "target"]]),  # the first step has no drafts
        ("abcd", 4, [["", "accepted"], ["", "recovered"], ["abc", "accepted"], ["d", "recovered"]]),
        ("ef", 2, [["e", "accepted"], ["f", "recovered"]]),
    ]
    assert done["stats"]["accepted"] == 3


def test_continue_extends_the_last_reply(make_client):
    engine = FakeEngine(" upon a time")
    with make_client(engine).websocket_connect("/ws") as ws:
        ws.receive_json()
        messages = [{"role": "user", "content": "A story?"}, {"role": "assistant", "content": "Once"}]
        *deltas, done = chat(ws, messages=messages, **{"continue": True})
        assert done["type"] == "done" and "".join(m["text"] for m in deltas) == " upon a time"
        assert engine.detokenize(engine.prompts[0]) == "<user>A story?</user><assistant>Once"  # left open
        chat(ws, content="More")  # the history holds the joined reply
        assert engine.detokenize(engine.prompts[1]) == ("<user>A story?</user><assistant>Once upon a time</assistant>"
                                                        "<user>More</user><assistant>")
        for bad in ({"content": "x"}, {"messages": messages[:1]}, {"messages": messages, "continue": 1}):
            (error,) = chat(ws, **{"continue": True, **bad})
            assert error["type"] == "error" and error["code"] == "bad_message" and "continue" in error["message"]


def test_second_turn_resends_history_with_first_reply(make_client):
    engine = FakeEngine(reply_fn=lambda prompt, params: f"reply-{prompt.count('<user>')}")
    with make_client(engine).websocket_connect("/ws") as ws:
        ws.receive_json()
        first = chat(ws, content="hello there")[-1]
        second = chat(ws, content="and again")[-1]
    turn2 = engine.detokenize(engine.prompts[1])
    assert turn2 == "<user>hello there</user><assistant>reply-1</assistant><user>and again</user><assistant>"
    assert first["stats"]["cached_tokens"] == 0
    assert second["stats"]["cached_tokens"] > 0  # the prefix cache reused turn 1


def test_messages_replace_the_conversation(make_client):
    engine = FakeEngine("ok")
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
               {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    with make_client(engine).websocket_connect("/ws") as ws:
        ws.receive_json()
        chat(ws, content="forgotten")
        assert chat(ws, messages=history)[-1]["type"] == "done"
        chat(ws, content="d")
    assert "forgotten" not in engine.detokenize(engine.prompts[2])
    assert engine.detokenize(engine.prompts[2]).endswith(
        "<user>c</user><assistant>ok</assistant><user>d</user><assistant>")


def test_settings_apply_to_later_turns_and_params_to_one(client, engine):
    with client.websocket_connect("/ws") as ws:
        ws.receive_json()
        ws.send_json({"type": "settings", "params": {"temperature": 0.5, "max_tokens": 5, "speculation": False,
                                                     "stop": ["xyz"], "seed": 7}})
        ack = ws.receive_json()
        assert ack["type"] == "settings" and ack["params"]["max_tokens"] == 5
        done = chat(ws, content="hi")[-1]
        assert done["finish_reason"] == "length" and done["stats"]["generated_tokens"] == 5
        chat(ws, content="hi", params={"max_tokens": 3, "speculation": True})
        chat(ws, content="hi")
    first, once, after = engine.params
    assert first.temperature == 0.5 and first.num_draft_tokens == 0 and first.stop == ("xyz",) and first.seed == 7
    assert once.max_tokens == 3 and once.num_draft_tokens is None
    assert after.max_tokens == 5 and after.num_draft_tokens == 0


def test_cancel_stops_promptly_and_keeps_partial_reply(make_client):
    engine = FakeEngine("x" * 500, token_delay=0.01)
    with make_client(engine).websocket_connect("/ws") as ws:
        ws.receive_json()
        ws.send_json({"type": "chat", "content": "write a lot", "id": 1})
        assert ws.receive_json()["type"] == "delta"
        start = time.monotonic()
        ws.send_json({"type": "cancel", "id": 1})
        *deltas, done = receive_until(ws, "done")
        assert time.monotonic() - start < 0.5
        assert done["id"] == 1 and done["finish_reason"] == "abort"
        assert 1 <= done["stats"]["generated_tokens"] < 500
        wait_for(lambda: engine.num_free_blocks == engine.num_blocks)
        assert len(engine.abort_calls) == 1 and engine.num_running == 0
        engine.reply = "short"
        assert chat(ws, content="next")[-1]["finish_reason"] == "stop"
    partial = "x" * len("".join(m["text"] for m in deltas)) + "x"  # + the first delta read above
    assert f"<assistant>{partial}</assistant>" in engine.detokenize(engine.prompts[1])  # what the user saw


def test_cancel_races_and_unknown_ids(make_client):
    engine = FakeEngine("y" * 300, token_delay=0.01)
    with make_client(engine).websocket_connect("/ws") as ws:
        ws.receive_json()
        ws.send_json({"type": "cancel"})  # nothing running: ignored
        ws.send_json({"type": "chat", "content": "go", "id": "a"})
        ws.send_json({"type": "cancel", "id": "b"})
        messages = receive_until(ws, "error")
        assert messages[-1] == {"type": "error", "code": "unknown_id", "message": messages[-1]["message"], "id": "b"}
        ws.send_json({"type": "cancel"})
        assert receive_until(ws, "done")[-1]["finish_reason"] == "abort"


def test_disconnect_aborts_and_frees_the_pool(make_client):
    engine = FakeEngine("z" * 1000, token_delay=0.01)
    client = make_client(engine)
    with client.websocket_connect("/ws") as ws:
        ws.receive_json()
        ws.send_json({"type": "chat", "content": "long one"})
        ws.receive_json()
        assert engine.num_free_blocks < engine.num_blocks
    wait_for(lambda: engine.num_free_blocks == engine.num_blocks and engine.num_running == 0)
    assert len(engine.abort_calls) == 1 and engine.num_cancelled_streams == 1
    with client.websocket_connect("/ws") as ws:  # the server is fine afterwards
        ws.receive_json()
        engine.reply, engine.token_delay = "fine", 0.0
        assert chat(ws, content="hi")[-1]["type"] == "done"


def test_second_chat_while_running_is_busy(make_client):
    engine = FakeEngine("w" * 50, token_delay=0.005)
    with make_client(engine).websocket_connect("/ws") as ws:
        ws.receive_json()
        ws.send_json({"type": "chat", "content": "first", "id": "one"})
        ws.send_json({"type": "chat", "content": "second", "id": "two"})
        messages = receive_until(ws, "done")
        errors = [m for m in messages if m["type"] == "error"]
        assert [(e["code"], e["id"]) for e in errors] == [("busy", "two")]
        assert messages[-1]["id"] == "one" and messages[-1]["finish_reason"] == "stop"
        assert chat(ws, content="third")[-1]["type"] == "done"
    assert len(engine.prompts) == 2


def test_reset_starts_a_new_conversation(make_client):
    engine = FakeEngine("v" * 200, token_delay=0.005)
    with make_client(engine).websocket_connect("/ws") as ws:
        ws.receive_json()
        ws.send_json({"type": "chat", "content": "remember me"})
        ws.receive_json()
        ws.send_json({"type": "reset"})
        messages = receive_until(ws, "reset")
        assert messages[-2]["type"] == "done" and messages[-2]["finish_reason"] == "abort"
        wait_for(lambda: engine.num_free_blocks == engine.num_blocks)
        engine.token_delay = 0.0
        chat(ws, content="fresh")
    assert engine.detokenize(engine.prompts[-1]) == "<user>fresh</user><assistant>"


@pytest.mark.parametrize("style", ["delta", "raise"])
def test_engine_error_is_reported_and_connection_survives(client, engine, style):
    with client.websocket_connect("/ws") as ws:
        ws.receive_json()
        engine.error, engine.error_style = "kv pool on fire", style
        error = chat(ws, content="hi", id=5)[-1]
        assert error == {"type": "error", "code": "engine_error", "message": "generation failed: kv pool on fire",
                         "id": 5}
        engine.error = None
        assert chat(ws, content="hi")[-1]["type"] == "done"
    assert engine.num_free_blocks == engine.num_blocks
