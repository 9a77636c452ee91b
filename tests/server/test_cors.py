"""CORS for --allowed-origins: preflight and response headers for a listed origin, none for others."""

from __future__ import annotations

import pytest

from .fake_engine import FakeEngine

APP = "http://app.example"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
KEY = {"authorization": "Bearer sekret"}


def preflight(client, origin: str, path: str = "/v1/chat/completions", method: str = "POST"):
    return client.options(path, headers={"origin": origin, "access-control-request-method": method,
                                         "access-control-request-headers": "authorization, content-type, x-stainless-os"})


def cors_headers(response) -> dict:
    return {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}


@pytest.fixture
def client(make_client):
    return make_client(FakeEngine(), allowed_origins=(APP,), api_key="sekret")


@pytest.mark.parametrize("path,method", [("/v1/chat/completions", "POST"), ("/v1/completions", "POST"),
                                         ("/v1/models", "GET"), ("/tokenize", "POST")])
def test_preflight_from_an_allowed_origin(client, path, method):
    response = preflight(client, APP, path, method)
    assert response.status_code == 200
    headers = response.headers
    assert headers["access-control-allow-origin"] == APP
    assert {"GET", "POST"} <= set(headers["access-control-allow-methods"].replace(" ", "").split(","))
    allowed = {h.strip().lower() for h in headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os"} <= allowed
    assert "access-control-allow-credentials" not in headers  # the key is a header, never a cookie


def test_responses_to_an_allowed_origin_carry_allow_origin(client):
    origin = {"origin": APP}
    whole = client.post("/v1/chat/completions", json=CHAT, headers={**KEY, **origin})
    streamed = client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={**KEY, **origin})
    refused = client.post("/v1/chat/completions", json=CHAT, headers=origin)  # no key: the app can read why
    for response, status in ((whole, 200), (streamed, 200), (refused, 401)):
        assert response.status_code == status
        assert response.headers["access-control-allow-origin"] == APP
        assert "Retry-After" in response.headers["access-control-expose-headers"]
    assert client.get("/v1/models", headers={**KEY, **origin}).headers["access-control-allow-origin"] == APP


def test_a_foreign_origin_gets_no_cors_headers(client):
    response = preflight(client, "http://evil.example")
    assert response.status_code == 403 and response.json()["error"]["code"] == "forbidden_origin"
    assert cors_headers(response) == {}
    post = client.post("/v1/chat/completions", json=CHAT, headers={**KEY, "origin": "http://evil.example"})
    assert post.status_code == 403 and cors_headers(post) == {}  # access.py's Origin check still refuses


def test_no_allowed_origins_means_no_cross_origin_preflight(make_client):
    client = make_client(FakeEngine())
    response = preflight(client, APP)
    assert response.status_code == 403 and cors_headers(response) == {}
    assert client.post("/v1/chat/completions", json=CHAT, headers={"origin": "http://testserver"}).status_code == 200


def test_any_origin(make_client):
    client = make_client(FakeEngine(), allowed_origins=("*",))
    response = preflight(client, "http://anywhere.example")
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"
    post = client.post("/v1/chat/completions", json=CHAT, headers={"origin": "http://anywhere.example"})
    assert post.status_code == 200 and post.headers["access-control-allow-origin"] == "*"
