"""The chat page (``GET /``) in a real headless Chromium (Debian's /usr/bin/chromium driven by
Playwright; never ``playwright install``): type a message, see streamed text appear, press stop
(the request is aborted in the engine and its KV blocks freed), keep the conversation for a second
turn, show tokens/s. The screenshot is saved as a test artifact ($LMSTACK_ARTIFACTS, else pytest's
base temp dir / artifacts)."""

import os
import re
import shutil
import time
from pathlib import Path

import pytest
from serve_helpers import MODEL, all_blocks_free, live_server, tiny_engine, wait_idle

from lmstack.serve import Server
from lmstack.serve import server as server_module

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.slow


@pytest.fixture
def artifacts(tmp_path_factory) -> Path:
    d = Path(os.environ.get("LMSTACK_ARTIFACTS") or tmp_path_factory.getbasetemp() / "artifacts")
    d.mkdir(parents=True, exist_ok=True)
    return d


def test_chat_page_streams_stops_and_keeps_the_conversation(monkeypatch, artifacts):
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the browser test drives Chromium with Playwright"
    )
    if not os.path.exists(CHROMIUM):
        pytest.skip("needs Debian's chromium (`apt-get install chromium`; `make test` installs it)")
    real = server_module.Server.sampling

    def slow(
        output_ids, logits
    ):  # ~30 ms a token, so that a reply is still streaming when stop is pressed
        time.sleep(0.03)
        return logits

    def sampling(self, body, max_tokens, logprobs, index, processors=()):
        body.ignore_eos = True  # a random model may pick EOS at once; the page cannot ask for this
        return real(self, body, max_tokens, logprobs, index, list(processors) + [slow])

    monkeypatch.setattr(server_module.Server, "sampling", sampling)
    engine = tiny_engine()
    with live_server(Server(engine, MODEL)) as url, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            page.goto(url + "/")
            sync_api.expect(page.locator("#model")).to_have_text(MODEL)
            page.fill("#max_tokens", "200")
            page.fill("#input", "Hello, server!")
            page.click("#send")
            reply = page.locator(".msg.assistant").first
            # streamed text appears while the reply is still running
            page.wait_for_function(
                "parseInt(document.querySelector('.msg.assistant .meta')?.textContent) >= 5"
            )
            assert reply.get_attribute("data-done") is None
            assert page.is_enabled("#stop") and not page.is_enabled("#send")
            page.click("#stop")
            sync_api.expect(reply).to_have_attribute("data-done", "stopped")
            partial = reply.locator(".text").text_content()
            assert len(partial) >= 5
            meta = reply.locator(".meta").text_content()
            assert re.search(r"\d+ tokens · [\d.]+ tokens/s", meta) and "stopped" in meta, meta
            wait_idle(engine)  # the aborted fetch aborted the request in the engine
            assert all_blocks_free(engine)
            assert engine.stats["generated_tokens"] < 200
            # a second turn carries the conversation (user, the stopped reply, user)
            page.fill("#max_tokens", "4")
            page.fill("#input", "And again.")
            page.press("#input", "Enter")
            second = page.locator(".msg.assistant").nth(1)
            sync_api.expect(second).to_have_attribute("data-done", "length", timeout=30000)
            assert page.evaluate("conversation.map(m => m.role)") == [
                "user",
                "assistant",
                "user",
                "assistant",
            ]
            assert page.evaluate("conversation[1].content") == partial
            assert page.locator(".msg.user").all_text_contents() == ["Hello, server!", "And again."]
            page.screenshot(path=str(artifacts / "serve_chat_page.png"), full_page=True)
        finally:
            browser.close()
    assert (artifacts / "serve_chat_page.png").stat().st_size > 1000
