"""Screenshots of the chat UI for docs/: the light and dark themes and the speculation view.

Run against a real server (by hand, not in the tests: it takes a real model's reply):
    .venv/bin/chatserve serve --model smollm2-135m-instruct --dtype float32 --quantization none \
        --kv-cache-memory 256M --port 8791 &
    .venv/bin/python scripts/ui_screenshots.py http://127.0.0.1:8791 docs/
Needs playwright and Debian's chromium (scripts/setup.sh test installs both).
"""

from __future__ import annotations

import sys
from pathlib import Path

from playwright.sync_api import expect, sync_playwright

CHROMIUM = "/usr/bin/chromium"
PROMPT = "Write a Python function that checks whether a string is a palindrome, with a short explanation."
FOLLOW_UP = "Now make it ignore case and punctuation."


def ask(page, text: str, num_replies: int) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")
    expect(page.locator(".msg.assistant .stats")).to_have_count(num_replies, timeout=600_000)


def main(url: str, out_dir: Path) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1280, "height": 860}, color_scheme="light")
        page = context.new_page()
        page.goto(url)
        expect(page.locator("#status")).to_have_attribute("data-state", "online", timeout=60_000)
        page.click("#settings-toggle")
        page.fill("#set-temperature", "0")
        page.fill("#set-max-tokens", "220")
        page.click("#messages")
        ask(page, PROMPT, 1)
        ask(page, FOLLOW_UP, 2)
        page.locator("#input").focus()
        page.screenshot(path=str(out_dir / "ui-light.png"))
        page.emulate_media(color_scheme="dark")
        page.screenshot(path=str(out_dir / "ui-dark.png"))
        page.emulate_media(color_scheme="light")
        page.locator(".msg.assistant").nth(1).locator(".spec-link").click()
        page.locator(".msg.assistant").nth(1).scroll_into_view_if_needed()
        page.screenshot(path=str(out_dir / "ui-speculation.png"))
        browser.close()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
