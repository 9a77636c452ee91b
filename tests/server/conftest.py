"""Fixtures for server tests: a FakeEngine, a TestClient app, and a live uvicorn server in a thread."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from starlette.testclient import TestClient

from chatserve.config import ServerConfig
from chatserve.server import create_app, make_uvicorn_server

from .fake_engine import FakeEngine
from .real_server import RealServer


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def make_client():
    """make_client(engine, **ServerConfig fields) -> a started TestClient (closed after the test)."""
    clients = []

    def make(engine: FakeEngine, **config) -> TestClient:
        client = TestClient(create_app(engine, ServerConfig(**config)))
        clients.append(client.__enter__())
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(engine, make_client) -> TestClient:
    return make_client(engine)


def receive_until(ws, kind: str, limit: int = 10_000) -> list[dict]:
    """Messages up to and including the first of type `kind`."""
    messages = []
    for _ in range(limit):
        messages.append(ws.receive_json())
        if messages[-1]["type"] == kind:
            return messages
    raise AssertionError(f"no {kind!r} message in {limit}")


def chat(ws, **fields) -> list[dict]:
    """Send one chat message and return everything up to its `done` (or `error`)."""
    ws.send_json({"type": "chat", **fields})
    messages = []
    while True:
        messages.append(ws.receive_json())
        if messages[-1]["type"] in ("done", "error"):
            return messages


def wait_for(condition, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


class LiveServer:
    """uvicorn (uvloop, websockets-sansio) serving create_app(engine) on 127.0.0.1:<free port>."""

    def __init__(self, engine: FakeEngine, port: int | None = None, **config):
        self.port = port or _free_port()
        config.setdefault("shutdown_grace", 1.0)  # a test's leftover generation must not hold up __exit__
        self.server = make_uvicorn_server(engine, ServerConfig(port=self.port, **config), log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        wait_for(lambda: self.server.started, timeout=10)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def drafted_server(tiny_llama_dir, tiny_draft_dir):
    """A real `chatserve serve` on the tiny model with the tiny draft model (fixed draft length),
    shared by the modules that drive it with the official openai client; each leaves it idle."""
    srv = RealServer(tiny_llama_dir, "--draft-model", str(tiny_draft_dir), "--no-adaptive")
    yield srv.base
    srv.stop()


@pytest.fixture
def drafted_client(drafted_server):
    import openai

    return openai.OpenAI(base_url=drafted_server + "/v1", api_key="unused", max_retries=0)


CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium through playwright (`playwright install` cannot download browsers here).
    Per module, not per session: playwright's sync API keeps an event loop running in the main
    thread while it is open, and later modules call asyncio.run()."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()
