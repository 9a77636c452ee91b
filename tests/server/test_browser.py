"""The web UI in Debian's chromium (playwright, sync API) against uvicorn + FakeEngine.

Streams a reply, stops one mid-stream, renders a code block, survives a server restart (the page
re-sends its conversation), starts a new chat, and takes a screenshot (into tmp_path: the docs'
screenshots are real conversations, from scripts/ui_screenshots.py). test_browser_chats.py tests
the kept conversations, editing, rendering and the speculation view.
"""

from __future__ import annotations

import re

import pytest

from .conftest import LiveServer, wait_for
from .fake_engine import FakeEngine

pytestmark = pytest.mark.browser

REPLIES = {
    "speculative": "Speculative decoding lets a small **draft** model propose a few tokens, and the large "
                   "model checks them all in one forward pass. Accepted tokens are free speed; a rejected "
                   "one is replaced by the target's own choice, so the output distribution is unchanged.",
    "poem": "Silicon rivers hum beneath the floor,\nwhere tensors dream of tokens yet to come;\n" * 12,
    "python": "Sure, here is a tiny example:\n\n```python\ndef greet(name: str) -> str:\n"
              "    return f\"Hello, {name}!\"\n\nprint(greet(\"<world>\"))\n```\n\n"
              "`greet` returns a string; the `<world>` tag is shown as text, not HTML.\n\n"
              "1. define it\n2. call it",
}


def reply_for(prompt: str, params) -> str:
    last_user = re.findall(r"<user>(.*?)</user>", prompt, re.S)[-1].lower()
    return next((text for key, text in REPLIES.items() if key in last_user), "Hello again!")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def test_chat_ui(browser, tmp_path):
    from playwright.sync_api import expect

    engine = FakeEngine(reply_fn=reply_for, token_delay=0.004, tokens_per_delta=3)
    page = browser.new_page(viewport={"width": 1000, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    with LiveServer(engine) as server:
        page.goto(server.url)
        expect(page.locator("#status")).to_have_attribute("data-state", "online")
        expect(page.locator("#model")).to_have_text("fake-model + ngram")

        send(page, "What is speculative decoding?")
        first = page.locator(".msg.assistant").nth(0)
        expect(first.locator(".stats")).to_contain_text("TTFT")
        expect(first.locator(".stats")).to_contain_text("% accepted")
        expect(first.locator(".content strong")).to_have_text("draft")
        settings = engine.params[0]  # nothing set in the page: the server's defaults
        assert (settings.temperature, settings.top_p, settings.max_tokens) == (1.0, 1.0, 256)
        assert settings.num_draft_tokens is None

        engine.token_delay = 0.03
        send(page, "Write a long poem about servers")
        poem = page.locator(".msg.assistant").nth(1)
        expect(poem.locator(".content")).to_contain_text("Silicon rivers")  # streamed text shows up
        expect(page.locator("#stop")).to_be_visible()
        page.click("#stop")
        expect(poem.locator(".stats")).to_contain_text("stopped")
        expect(page.locator("#send")).to_be_visible()
        wait_for(lambda: engine.num_free_blocks == engine.num_blocks)
        assert len(engine.abort_calls) == 1

        engine.token_delay = 0.004
        page.fill("#input", "Show me some python")
        page.press("#input", "Shift+Enter")
        page.type("#input", "please")
        page.press("#input", "Enter")
        code_turn = page.locator(".msg.assistant").nth(2)
        expect(code_turn.locator(".stats")).to_contain_text("tok/s")
        expect(code_turn.locator("pre code")).to_contain_text('print(greet("<world>"))')
        expect(code_turn.locator(".code-head")).to_contain_text("python")
        expect(code_turn.locator(".content ol li")).to_have_text(["define it", "call it"])
        prompt = engine.detokenize(engine.prompts[2])
        assert "<user>Show me some python\nplease</user>" in prompt
        assert "What is speculative decoding?" in prompt and "Silicon rivers" in prompt  # one conversation

        page.locator("#input").click()
        page.screenshot(path=str(tmp_path / "chat.png"))
        port = server.port

    # The server goes away and comes back: the page reconnects and re-sends its transcript.
    expect(page.locator("#status")).not_to_have_attribute("data-state", "online")
    restarted = FakeEngine(reply_fn=reply_for)
    with LiveServer(restarted, port=port):
        expect(page.locator("#status")).to_have_attribute("data-state", "online", timeout=8000)
        send(page, "Still there?")
        expect(page.locator(".msg.assistant").nth(3).locator(".stats")).to_contain_text("tokens")
        assert "Show me some python" in restarted.detokenize(restarted.prompts[0])

        page.click("#new-chat")
        expect(page.locator(".msg")).to_have_count(0)
        send(page, "Fresh start")
        expect(page.locator(".msg.assistant .stats")).to_contain_text("tokens")
        assert restarted.detokenize(restarted.prompts[-1]) == "<user>Fresh start</user><assistant>"
    assert errors == []
    page.close()


def test_server_shutdown_mid_reply_is_explained(browser):
    """A drain with no grace ends the streaming reply ("interrupted", not the user's "stopped") and
    closes with 1001; the page says the server is shutting down and keeps trying to reconnect."""
    from playwright.sync_api import expect

    engine = FakeEngine("tick " * 400, token_delay=0.02)
    page = browser.new_page(viewport={"width": 1000, "height": 900})
    with LiveServer(engine, shutdown_grace=0) as server:
        page.goto(server.url)
        expect(page.locator("#status")).to_have_attribute("data-state", "online")
        send(page, "Count for me")
        reply = page.locator(".msg.assistant").nth(0)
        expect(reply.locator(".content")).to_contain_text("tick")
        server.server.should_exit = True  # what SIGTERM sets
        expect(reply.locator(".stats")).to_contain_text("interrupted")
        expect(page.locator("#error")).to_contain_text("The server is shutting down")
        expect(page.locator("#status")).to_contain_text("Server shutting down")
    page.close()


def test_narrow_screen_layout(browser):
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 390, "height": 760})
    engine = FakeEngine("Short answer.")
    with LiveServer(engine) as server:
        page.goto(server.url)
        expect(page.locator("#status")).to_have_attribute("data-state", "online")
        send(page, "hi")
        expect(page.locator(".msg.assistant .stats")).to_be_visible()
        assert page.evaluate("document.documentElement.scrollWidth") <= 390  # no sideways scrolling
        page.click("#settings-toggle")
        expect(page.locator("#settings-panel")).to_be_visible()
        page.uncheck("#speculation")
        box = page.locator("#settings-panel").bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390
        page.locator("#input").click()  # closes the panel
        expect(page.locator("#settings-panel")).to_be_hidden()
        send(page, "again, without drafting")
        expect(page.locator(".msg.assistant").nth(1).locator(".stats")).to_be_visible()
        assert engine.params[-1].num_draft_tokens == 0
        expect(page.locator(".msg.assistant").nth(1).locator(".stats")).not_to_contain_text("accepted")

        expect(page.locator("#sidebar")).to_be_hidden()  # the conversation list is a drawer here
        page.click("#sidebar-toggle")
        expect(page.locator("#sidebar-toggle")).to_have_attribute("aria-expanded", "true")
        box = page.locator("#sidebar").bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390
        page.click("[data-testid=conversation] .conv-open")  # opening a chat closes the drawer
        expect(page.locator("#sidebar")).to_be_hidden()
        expect(page.locator(".msg.assistant")).to_have_count(2)
    page.close()


def test_spec_method_select(browser):
    from playwright.sync_api import expect

    import json

    page = browser.new_page(viewport={"width": 1000, "height": 800})
    sent = []  # every JSON frame the page sends
    page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(json.loads(payload))))
    engine = FakeEngine("A reply in a few words.", draft_name="tiny-draft", tokens_per_delta=3)
    with LiveServer(engine) as server:
        page.goto(server.url)
        expect(page.locator("#status")).to_have_attribute("data-state", "online")
        page.click("#settings-toggle")
        select = page.locator("#spec-method")
        expect(select).to_be_enabled()
        expect(select).to_have_value("draft")  # the server's default comes first in spec_methods
        page.locator("#input").click()
        send(page, "first")
        expect(page.locator(".msg.assistant").nth(0).locator(".stats")).to_contain_text("draft model")
        assert engine.params[-1].spec_method == "draft"

        page.click("#settings-toggle")
        select.select_option("ngram")
        page.locator("#input").click()
        send(page, "second")
        expect(page.locator(".msg.assistant").nth(1).locator(".stats")).to_contain_text("n-gram")
        assert engine.params[-1].spec_method == "ngram"

        page.click("#settings-toggle")
        page.uncheck("#speculation")
        expect(select).to_be_disabled()  # no method to choose while speculation is off
        page.locator("#input").click()
        send(page, "third")
        expect(page.locator(".msg.assistant").nth(2).locator(".stats")).to_be_visible()
        assert engine.params[-1].num_draft_tokens == 0
    turns = [m["params"] for m in sent if m["type"] == "chat"]  # each turn carries the choice itself
    assert turns == [{"speculation": True, "spec_method": "draft"}, {"speculation": True, "spec_method": "ngram"},
                     {"speculation": False, "spec_method": "ngram"}]

    # A server without a draft model offers n-gram only: the page never asks it for "draft".
    ngram_only = FakeEngine("ok", draft_name="ngram")
    with LiveServer(ngram_only) as server:
        page.goto(server.url)
        page.evaluate("localStorage.setItem('chatserve.settings', JSON.stringify({spec_method: 'draft'}))")
        page.reload()
        expect(page.locator("#status")).to_have_attribute("data-state", "online")
        expect(page.locator("#spec-method")).to_have_value("ngram")
        expect(page.locator("#spec-method")).to_be_disabled()
        send(page, "hi")
        expect(page.locator(".msg.assistant .stats")).to_be_visible()
        assert ngram_only.params[-1].spec_method == "ngram"
    page.close()
