"""spec_method over the wire: websocket settings and per-turn params, OpenAI extra body field,
validation errors naming the field, and what the ready and done messages report."""

from __future__ import annotations

import pytest

from chatserve import openai_protocol as OP
from chatserve import protocol as P

from .conftest import chat
from .fake_engine import FakeEngine


def test_protocol_parses_and_validates_spec_method():
    assert P.build_sampling_params(P.parse_settings({"spec_method": "ngram"}), 100).spec_method == "ngram"
    assert P.build_sampling_params(P.parse_settings({"spec_method": None}), 100).spec_method is None
    for bad in ("medusa", 1, True, ["draft"]):
        with pytest.raises(P.ProtocolError) as e:
            P.parse_settings({"spec_method": bad})
        assert e.value.code == P.INVALID_PARAMS and e.value.param == "spec_method"
    with pytest.raises(P.ProtocolError) as e:  # OpenAI bodies go through SamplingParams' own check
        OP.parse_chat_completion_request({"messages": [{"role": "user", "content": "x"}], "spec_method": "medusa"}, 10, 10)
    assert e.value.param == "spec_method"
    draft = P.build_sampling_params({"spec_method": "draft"}, 100)
    P.check_spec_method(draft, ("draft", "ngram"))
    with pytest.raises(P.ProtocolError, match="offers only ngram") as e:
        P.check_spec_method(draft, ("ngram",))
    assert e.value.param == "spec_method"
    with pytest.raises(P.ProtocolError, match="without speculation"):
        P.check_spec_method(draft, ())


def test_ready_lists_methods_and_turns_carry_them(make_client):
    engine = FakeEngine("one two three four five", tokens_per_delta=3, draft_name="tiny-draft")
    with make_client(engine).websocket_connect("/ws") as ws:
        ready = ws.receive_json()
        assert ready["spec_methods"] == ["draft", "ngram"] and ready["draft"] == "tiny-draft"
        ws.send_json({"type": "settings", "params": {"spec_method": "ngram"}})
        assert ws.receive_json()["params"] == {"spec_method": "ngram"}
        by_settings = chat(ws, content="a")[-1]
        by_turn = chat(ws, content="b", params={"spec_method": "draft"})[-1]
        back_to_settings = chat(ws, content="c")[-1]
    assert [p.spec_method for p in engine.params] == ["ngram", "draft", "ngram"]
    assert by_settings["stats"]["spec_method"] == "ngram" and by_settings["stats"]["drafted"] > 0
    assert by_turn["stats"]["spec_method"] == "draft" and by_turn["stats"]["drafted"] > 0
    assert back_to_settings["stats"]["spec_method"] == "ngram"


def test_unavailable_or_bad_method_is_an_error_and_the_connection_stays_usable(make_client):
    engine = FakeEngine("ok")  # an n-gram server: no draft model
    with make_client(engine).websocket_connect("/ws") as ws:
        ws.receive_json()
        ws.send_json({"type": "settings", "params": {"spec_method": "draft"}})
        error = ws.receive_json()
        assert error["type"] == "error" and error["code"] == P.INVALID_PARAMS
        assert error["message"].startswith("spec_method:") and "offers only ngram" in error["message"]
        error = chat(ws, content="hi", id="t1", params={"spec_method": "draft"})[-1]
        assert error["type"] == "error" and error["id"] == "t1" and error["message"].startswith("spec_method:")
        error = chat(ws, content="hi", params={"spec_method": "fast"})[-1]
        assert error["type"] == "error" and error["message"].startswith("spec_method:")
        assert chat(ws, content="hi", params={"spec_method": "ngram"})[-1]["type"] == "done"
        assert chat(ws, content="hi")[-1]["type"] == "done"  # the bad settings were not stored
    assert [p.spec_method for p in engine.params] == ["ngram", None]


def test_openai_extra_body_field(make_client):
    engine = FakeEngine("ok", draft_name="tiny-draft")
    client = make_client(engine)
    body = {"messages": [{"role": "user", "content": "x"}], "spec_method": "ngram"}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert engine.params[-1].spec_method == "ngram"
    no_spec = make_client(FakeEngine("ok", draft_name=None))
    response = no_spec.post("/v1/completions", json={"prompt": "x", "spec_method": "draft"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "spec_method" and "without speculation" in error["message"]
    assert no_spec.post("/v1/completions", json={"prompt": "x"}).status_code == 200
