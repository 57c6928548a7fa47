"""The gateway's chat page (`gateway.api.chat_page`): the page is self-contained, `/` sends a browser there, and in
headless Chromium against a real gateway over a real swarm a typed message streams its reply token by token (the
greedy text equal to local transformers'), a second turn is served from the session pool (cached tokens), each
reply names the servers that served it, and Stop aborts a reply mid-stream (the gateway's run ends)."""
from __future__ import annotations

import os
import re
import shutil
import time

import httpx
import pytest

from gateway.api.chat_page import PAGE
from gateway.api.status import PAGE_HEADERS
from tests.fixtures.browser import Page
from tests.fixtures.gateway_fixtures import gateway, one_torch_thread, reference_text, wait_until  # noqa: F401

LAST = "[...document.querySelectorAll('.assistant')].pop()"


def test_page_is_self_contained_and_never_parses_text_as_html():
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", PAGE), "no external assets"
    assert "<link" not in PAGE and "@import" not in PAGE and "http" not in PAGE
    assert "innerHTML" not in PAGE and "insertAdjacentHTML" not in PAGE and "document.write" not in PAGE
    assert "textContent" in PAGE and "/v1/chat/completions" in PAGE and "include_usage" in PAGE


def _reply(page: Page, timeout: float = 240) -> dict:
    """Wait for the last reply to end; what it showed while streaming (text lengths seen) and at the end."""
    lengths, deadline = [], time.monotonic() + timeout
    while True:
        state, text = page.evaluate(f"[{LAST}.dataset.state, {LAST}.querySelector('.text').textContent]")
        if state == "streaming":
            if text and (not lengths or lengths[-1] != len(text)):
                lengths.append(len(text))
        else:
            break
        assert time.monotonic() < deadline, f"the reply still streams after {timeout}s: {text!r}"
        time.sleep(0.05)
    info = page.evaluate(f"(() => {{ const b = {LAST}; return {{state: b.dataset.state, "
                         "text: b.querySelector('.text').textContent, cached: b.dataset.cached, "
                         "tokens: b.dataset.completionTokens, prompt: b.dataset.promptTokens, "
                         "servers: b.dataset.servers, "
                         "meta: (b.querySelector('.meta') || {}).textContent}; })()")
    return {**info, "lengths": lengths}


def _say(page: Page, text: str) -> None:
    page.type("#input", text)
    page.click("#send")
    page.wait_for(f"document.querySelectorAll('.user').length > 0 && "
                  f"[...document.querySelectorAll('.user')].pop().textContent === {text!r}", timeout=30)


def test_chat_in_a_browser(gateway, tokenizer, reference_model, tmp_path):  # noqa: F811
    url = gateway.url
    page_response = httpx.get(url + "/chat", timeout=30)
    assert page_response.status_code == 200 and page_response.headers["content-type"].startswith("text/html")
    for name, value in PAGE_HEADERS.items():  # the same CSP as /status
        assert page_response.headers[name] == value
    browser_root = httpx.get(url + "/", headers={"Accept": "text/html"}, timeout=30)
    assert browser_root.status_code == 307 and browser_root.headers["location"] == "/chat"
    assert httpx.get(url + "/", timeout=30).json()["chat"] == "/chat"  # API clients still get JSON
    servers = {p.peer_id for p in gateway.swarm["servers"]}
    reply = httpx.post(url + "/v1/chat/completions", json={"model": gateway.proc.ready["model"], "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "Hi"}]},
                       timeout=180).json()
    assert set(reply["swarm"]["servers"]) == servers  # swarmgate's extension: who served the reply

    with Page(url + "/") as page:  # through the redirect
        page.wait_for("document.body.dataset.ready === '1'", timeout=60)
        assert page.evaluate("[...document.querySelectorAll('#model option')].map(o => o.value)") == \
            [gateway.proc.ready["model"]]
        page.evaluate("document.getElementById('temperature').value = '0';"
                      "document.getElementById('max_tokens').value = '12'")
        first = "Name three colors."
        _say(page, first)
        turn1 = _reply(page)
        assert turn1["state"] == "done", turn1
        assert len(turn1["lengths"]) >= 2, f"the text did not grow while streaming: {turn1['lengths']}"
        expected = reference_text(tokenizer, reference_model, [{"role": "user", "content": first}], 12)
        assert turn1["text"] == expected
        assert int(turn1["tokens"]) > 1 and int(turn1["prompt"]) > 0
        assert set(turn1["servers"].split(",")) == servers and "served by" in turn1["meta"]

        second = "And three animals?"
        _say(page, second)
        turn2 = _reply(page)
        assert turn2["state"] == "done", turn2
        history = [{"role": "user", "content": first}, {"role": "assistant", "content": turn1["text"]},
                   {"role": "user", "content": second}]
        assert turn2["text"] == reference_text(tokenizer, reference_model, history, 12)
        # the pooled session of turn 1 held the conversation's prefix: at least turn 1's whole prompt
        assert int(turn2["cached"]) >= int(turn1["prompt"]), (turn1, turn2)
        assert "from the session pool" in turn2["meta"] and "tokens/s" in turn2["meta"]
        screenshot = tmp_path / "chat.png"
        page.screenshot(screenshot)
        assert screenshot.stat().st_size > 10_000
        if os.environ.get("SWARMGATE_CHAT_SCREENSHOT"):  # a refresh of docs/chat.png
            shutil.copy(screenshot, os.environ["SWARMGATE_CHAT_SCREENSHOT"])

        # Stop mid-stream: the fetch is aborted, the text so far stays, the gateway's run ends
        page.evaluate("document.getElementById('max_tokens').value = '400'")
        _say(page, "Write a long story about a lighthouse keeper.")
        page.wait_for(f"{LAST}.dataset.state === 'streaming' && {LAST}.querySelector('.text').textContent.length > 0",
                      timeout=240)
        page.click("#stop")
        turn3 = _reply(page, timeout=30)
        assert turn3["state"] == "stopped" and turn3["text"], turn3
        assert page.evaluate("document.getElementById('stop').disabled && !document.getElementById('send').disabled")
        assert wait_until(lambda: httpx.get(url + "/status.json", timeout=30).json()["gateway"]["requests_running"]
                          == 0, timeout=60)
