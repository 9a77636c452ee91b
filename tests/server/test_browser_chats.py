"""The web UI's kept conversations, editing, rendering and speculation view, in chromium.

Every page here runs in a fresh browser context (its own IndexedDB) whose requests all pass a
route that fails the test for any host but the server: the UI must work offline but for it.
"""

from __future__ import annotations

import json
import re
from urllib.parse import urlparse

import pytest

from .conftest import LiveServer
from .fake_engine import FakeEngine

pytestmark = pytest.mark.browser
expect = pytest.importorskip("playwright.sync_api").expect

PYTHON = "Here:\n\n```python\ndef greet(name):\n    return f\"Hello, {name}!\"  # <b>not bold</b>\n```\n"
XSS = ("<script>window.pwned = 'script'</script>\n\n<img src=x onerror=\"window.pwned = 'img'\">\n\n"
       "[click me](javascript:window.pwned='link') <a href=\"javascript:window.pwned='a'\">raw</a> "
       "and a [real link](https://example.com/docs)")


def scripted_replies():
    """A reply_fn: the Python block, the XSS text, "Answer <n>" counting the calls, or for a
    continuation "er, continued." """
    calls = []

    def reply(prompt: str, params) -> str:
        calls.append(prompt)
        if not prompt.endswith("<assistant>"):  # a continuation: the prompt ends inside the reply
            return "er, continued."
        last_user = re.findall(r"<user>(.*?)</user>", prompt, re.S)[-1].lower()
        if "python" in last_user:
            return PYTHON
        if "xss" in last_user:
            return XSS
        return f"Answer {len(calls)}"
    return reply


@pytest.fixture
def open_page(browser):
    """open_page(server, **context options) -> a page in a new context; at teardown, no request
    may have gone to another host and no script error may have happened."""
    contexts, off_host, errors = [], [], []

    def open_(server: LiveServer, **options):
        context = browser.new_context(viewport={"width": 1100, "height": 850}, **options)
        contexts.append(context)

        def guard(route):
            if urlparse(route.request.url).hostname == "127.0.0.1":
                return route.continue_()
            off_host.append(route.request.url)
            route.abort()
        context.route("**/*", guard)
        page = context.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url)
        expect(page.locator("#status")).to_have_attribute("data-state", "online")
        return page

    yield open_
    for context in contexts:
        context.close()
    assert off_host == [] and errors == []


@pytest.fixture
def scripted(open_page):
    """(engine, server, page): scripted_replies() behind a live server, and a page on it."""
    engine = FakeEngine(reply_fn=scripted_replies())
    with LiveServer(engine) as server:
        yield engine, server, open_page(server)


def send(page, text: str) -> None:
    num_replies = page.locator(".msg.assistant .stats").count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    expect(page.locator(".msg.assistant .stats")).to_have_count(num_replies + 1)


def fill_settings(page, values: dict[str, str]) -> None:
    """Fill settings inputs by id ("" empties one), then close the panel (inputs save on change)."""
    page.click("#settings-toggle")
    for input_id, value in values.items():
        page.fill(f"#{input_id}", value)
    page.click("#messages")


def expect_texts(page, role: str, texts: list[str]) -> None:
    """The user bubbles or reply contents, in order (waiting for them, as an open is asynchronous)."""
    expect(page.locator(f".msg.{role} :is(.bubble, .content)")).to_have_text(texts)


def test_conversations_are_kept_across_reloads_and_listed(scripted):
    engine, _, page = scripted
    fill_settings(page, {"system-prompt": "Be brief."})
    send(page, "Tell me about zebras")
    send(page, "And their stripes?")
    assert engine.detokenize(engine.prompts[-1]) == (
        "<system>Be brief.</system><user>Tell me about zebras</user><assistant>Answer 1</assistant>"
        "<user>And their stripes?</user><assistant>")

    page.fill("#input", "an unsent draft")
    page.reload()  # a new connection: the page resumes the open conversation and sends it whole
    expect(page.locator("#status")).to_have_attribute("data-state", "online")
    expect_texts(page, "user", ["Tell me about zebras", "And their stripes?"])
    expect_texts(page, "assistant", ["Answer 1", "Answer 2"])
    expect(page.locator("#input")).to_have_value("an unsent draft")
    expect(page.locator("#system-prompt")).to_have_value("Be brief.")
    send(page, "Thanks")
    assert engine.detokenize(engine.prompts[-1]).startswith("<system>Be brief.</system><user>Tell me about zebras")

    page.keyboard.press("Control+Shift+O")  # a new chat
    expect(page.locator(".msg")).to_have_count(0)
    expect(page.locator("#system-prompt")).to_have_value("")
    send(page, "What about lions?")
    assert engine.detokenize(engine.prompts[-1]) == "<user>What about lions?</user><assistant>"
    titles = page.locator("[data-testid=conversation] .conv-open")
    expect(titles).to_have_text(["What about lions?", "Tell me about zebras"])  # newest first

    page.fill("#search", "stripes")  # searches the messages too
    expect(titles).to_have_text(["Tell me about zebras"])
    page.fill("#search", "")
    first = page.locator("[data-testid=conversation]").nth(1)
    page.once("dialog", lambda dialog: dialog.accept("Zebra notes"))
    first.locator("button.rename").click()
    expect(titles).to_have_text(["What about lions?", "Zebra notes"])
    titles.nth(1).click()  # open it
    expect_texts(page, "assistant", ["Answer 1", "Answer 2", "Answer 3"])

    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("[data-testid=conversation]").nth(1).locator("button.delete").click()
    expect(titles).to_have_text(["What about lions?"])
    expect(page.locator(".msg")).to_have_count(0)  # the open chat was deleted: a new one
    page.reload()
    expect(titles).to_have_text(["What about lions?"])


def test_regenerate_edit_and_resend(scripted):
    engine, _, page = scripted
    send(page, "first")
    send(page, "second")
    regenerate = page.locator('.msg.assistant [data-action="regenerate"]')
    expect(regenerate).to_have_count(2)
    expect(regenerate.nth(0)).to_be_hidden()  # only the last reply can be regenerated
    regenerate.nth(1).click()
    expect(page.locator(".msg.assistant").nth(1).locator(".content")).to_have_text("Answer 3")
    expect_texts(page, "assistant", ["Answer 1", "Answer 3"])
    assert engine.prompts[-1] == engine.prompts[-2]  # the same conversation, asked again

    page.locator('.msg.user [data-action="edit"]').nth(0).click()
    editor = page.locator(".msg.user textarea.editor")
    expect(editor).to_be_focused()
    editor.fill("first, edited")
    editor.press("Enter")
    expect(page.locator(".msg.assistant .stats")).to_have_count(1)
    expect_texts(page, "user", ["first, edited"])
    expect_texts(page, "assistant", ["Answer 4"])
    assert engine.detokenize(engine.prompts[-1]) == "<user>first, edited</user><assistant>"

    page.focus("#input")
    page.keyboard.press("ArrowUp")  # on an empty composer: edit the last user message
    expect(editor).to_be_focused()
    editor.press("Escape")
    expect(editor).to_have_count(0)
    page.reload()
    expect_texts(page, "user", ["first, edited"])
    expect_texts(page, "assistant", ["Answer 4"])


def test_continue_a_cut_off_reply(scripted):
    engine, _, page = scripted
    fill_settings(page, {"set-max-tokens": "4"})
    send(page, "cut me off")
    reply = page.locator(".msg.assistant").nth(0)
    expect(reply.locator(".stats")).to_contain_text("max tokens")
    expect(reply.locator(".content")).to_have_text("Answ")
    fill_settings(page, {"set-max-tokens": ""})
    reply.locator('[data-action="continue"]').click()
    expect(reply.locator(".content")).to_have_text("Answer, continued.")
    assert engine.detokenize(engine.prompts[-1]) == "<user>cut me off</user><assistant>Answ"
    expect(reply.locator(".stats")).not_to_contain_text("max tokens")
    expect(reply.locator('[data-action="continue"]')).to_be_hidden()  # nothing left to continue
    page.reload()
    expect_texts(page, "assistant", ["Answer, continued."])
    send(page, "next")
    assert "<assistant>Answer, continued.</assistant><user>next</user>" in engine.detokenize(engine.prompts[-1])


def test_a_refused_turn_gives_the_message_back(scripted):
    engine, _, page = scripted
    fill_settings(page, {"set-top-p": "5"})  # the server refuses it (top_p is in (0, 1])
    page.fill("#input", "hello?")
    page.press("#input", "Enter")
    expect(page.locator(".msg-error")).to_contain_text("top_p")
    expect(page.locator(".msg.user.failed")).to_have_count(1)
    expect(page.locator("#input")).to_have_value("hello?")  # back in the composer, to send again
    fill_settings(page, {"set-top-p": ""})
    page.press("#input", "Enter")
    expect_texts(page, "user", ["hello?"])  # the failed attempt is gone
    expect_texts(page, "assistant", ["Answer 1"])
    assert engine.detokenize(engine.prompts[-1]) == "<user>hello?</user><assistant>"


def test_export_and_import(scripted, open_page, tmp_path):
    engine, server, page = scripted
    send(page, "kept in a file")
    with page.expect_download() as download:
        page.click("#export")
    path = tmp_path / "chats.json"
    download.value.save_as(path)
    data = json.loads(path.read_text())
    (conv,) = data["conversations"]
    assert [(m["role"], m["content"]) for m in conv["messages"]] == [("user", "kept in a file"),
                                                                      ("assistant", "Answer 1")]

    fresh = open_page(server)  # another context: an empty IndexedDB
    expect(fresh.locator("[data-testid=conversation]")).to_have_count(0)
    fresh.set_input_files("#import-file", str(path))
    expect(fresh.locator("[data-testid=conversation] .conv-open")).to_have_text(["kept in a file"])
    fresh.click("[data-testid=conversation] .conv-open")
    expect_texts(fresh, "assistant", ["Answer 1"])
    send(fresh, "and on")
    assert "<user>kept in a file</user><assistant>Answer 1</assistant>" in engine.detokenize(engine.prompts[-1])

    bad = tmp_path / "bad.json"
    bad.write_text('{"nothing": 1}')
    fresh.set_input_files("#import-file", str(bad))
    expect(fresh.locator("#error")).to_contain_text("Import failed")


def test_markdown_highlighting_and_inert_html(scripted):
    engine, _, page = scripted
    send(page, "show me python")
    code = page.locator(".msg.assistant pre code.language-python")
    expect(code.locator(".hljs-keyword").first).to_have_text("def")
    expect(code.locator(".hljs-string").first).to_contain_text("Hello")
    expect(code).to_contain_text("# <b>not bold</b>")  # code stays text
    expect(page.locator(".msg.assistant .code-head button.copy")).to_have_text("Copy")

    send(page, XSS + " (xss from the user)")  # the user's text carries it, and so does the reply
    reply, user = page.locator(".msg.assistant").nth(1), page.locator(".msg.user").nth(1)
    expect(user.locator(".bubble")).to_contain_text("<script>window.pwned")
    expect(reply.locator(".content")).to_contain_text("<img src=x onerror=")
    messages = page.locator("#messages")
    assert messages.locator("script, img, iframe, [onerror]").count() == 0
    assert messages.locator("a[href^='javascript' i]").count() == 0
    link = reply.locator("a", has_text="real link")
    expect(link).to_have_attribute("href", "https://example.com/docs")
    expect(link).to_have_attribute("rel", "noopener noreferrer")
    page.reload()  # rendered again from IndexedDB
    expect(page.locator(".msg.assistant")).to_have_count(2)
    assert messages.locator("script, img, [onerror], a[href^='javascript' i]").count() == 0
    assert page.evaluate("window.pwned") is None


def test_speculation_view(open_page):
    reply = "The quick brown fox jumps over the lazy dog."
    engine = FakeEngine(reply, tokens_per_delta=3)  # steps of 3: the first from the prompt, then 2 accepted + 1
    with LiveServer(engine) as server:
        page = open_page(server)
        send(page, "go")
        node = page.locator(".msg.assistant").nth(0)
        expect(node.locator(".stats")).to_contain_text("% accepted")
        link = node.locator(".stats button.spec-link")
        link.click()
        expect(link).to_have_attribute("aria-pressed", "true")
        tokens = node.locator(".tokens .tok")
        expect(tokens).to_have_count(len(reply))  # FakeEngine: a token per character
        assert "".join(tokens.all_text_contents()) == reply
        num_steps = -(-len(reply) // 3)
        assert node.locator(".tokens .tok.target").count() == 3
        assert node.locator(".tokens .tok.recovered").count() == num_steps - 1
        assert node.locator(".tokens .tok.accepted").count() == len(reply) - 3 - (num_steps - 1)
        expect(node.locator("[data-testid=legend]")).to_contain_text(
            f"accepted draft: {len(reply) - 3 - (num_steps - 1)}")
        link.click()  # back to the rendered reply
        expect(node.locator(".tokens")).to_have_count(0)
        expect(node.locator(".content")).to_have_text(reply)
        page.reload()  # the origins are kept with the conversation
        page.locator(".msg.assistant .stats button.spec-link").click()
        expect(page.locator(".msg.assistant .tokens .tok")).to_have_count(len(reply))


def test_keyboard_labels_and_settings(open_page):
    engine = FakeEngine("tick " * 300, token_delay=0.02, sampling_defaults={"temperature": 0.6})
    with LiveServer(engine) as server:
        page = open_page(server)
        page.fill("#input", "count")
        page.press("#input", "Enter")
        expect(page.locator(".msg.assistant .content")).to_contain_text("tick")
        page.keyboard.press("Escape")  # stops the reply
        expect(page.locator(".msg.assistant .stats")).to_contain_text("stopped")

        page.click("#settings-toggle")
        expect(page.locator("#set-temperature")).to_have_attribute("placeholder", "default: 0.6")  # the model's
        expect(page.locator("#set-max-tokens")).to_have_attribute("placeholder", "default: 256")
        page.fill("#set-top-k", "5")
        page.fill("#set-seed", "42")
        page.fill("#set-stop", "tock\nEND")
        page.fill("#set-repetition-penalty", "1.1")
        page.keyboard.press("Escape")  # closes the panel (its inputs saved on change)
        expect(page.locator("#settings-panel")).to_be_hidden()
        engine.token_delay = 0
        send(page, "again")
        params = engine.params[-1]
        assert (params.top_k, params.seed, params.stop, params.repetition_penalty) == (5, 42, ("tock", "END"), 1.1)
        assert params.temperature == 0.6  # not set: the server's
        page.reload()
        page.click("#settings-toggle")
        expect(page.locator("#set-top-k")).to_have_value("5")  # the settings are kept
        page.fill("#set-top-k", "")
        page.click("#messages")
        send(page, "and again")
        assert engine.params[-1].top_k == 0

        nameless = page.evaluate("""() => [...document.querySelectorAll('button, input, textarea, select')]
            .filter((e) => e.type !== 'hidden' && e.type !== 'file')
            .filter((e) => !(e.getAttribute('aria-label') || e.labels?.[0]?.textContent.trim()
                             || e.textContent.trim() || e.title))
            .map((e) => e.outerHTML.slice(0, 80))""")
        assert nameless == []
        assert page.evaluate("[...document.querySelectorAll('[tabindex]')].filter((e) => e.tabIndex > 0).length") == 0
        page.keyboard.press("Control+k")
        expect(page.locator("#search")).to_be_focused()


def test_speculation_view_on_the_real_server(open_page, drafted_server):
    """The tiny model drafted by the tiny draft model (a real `chatserve serve`): every token of
    the reply has an origin, and each verification step ends in one recovered or bonus token."""
    server = LiveServer.__new__(LiveServer)
    server.url = drafted_server
    page = open_page(server)
    fill_settings(page, {"set-temperature": "0", "set-max-tokens": "24"})
    page.fill("#input", "Hello there")
    page.press("#input", "Enter")
    node = page.locator(".msg.assistant").nth(0)
    expect(node.locator(".stats")).to_contain_text("% accepted", timeout=60_000)
    num_tokens = int(re.search(r"(\d+) tokens", node.locator(".stats").inner_text()).group(1))
    node.locator(".stats button.spec-link").click()
    tokens = node.locator(".tokens .tok")
    expect(tokens).to_have_count(num_tokens)
    assert node.locator(".tokens .tok.target").count() >= 1  # the first token: no drafts yet
    assert node.locator(".tokens :is(.tok.recovered, .tok.bonus)").count() >= 1
