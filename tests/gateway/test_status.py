"""The swarm status page: the snapshot (`swarm.client.transport.status`), `/status.json` and `/status` of a real gateway
over a real swarm, the `swarmgate status` command, and the page rendered by headless Chromium (coverage, servers, an
HTML-injection peer name shown as text, a stopped server gone from the page)."""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import httpx
import pytest

from gateway.api.status import PAGE, TokenRate
from launch import topology
from launch.topology import REPO
from swarm.client.transport.status import build_status, coverage_bar, format_table
from swarm.wire.records import ServerInfo, ServerState
from tests.fixtures.browser import render
from tests.fixtures.gateway_fixtures import SPANS

EVIL_NAME = '<img src=x onerror="document.body.dataset.pwned=1"><b>evil</b>'
PEERS = ["12D3KooWJkawrUGDBkU3Ses29pZVnhtnm2Hjy1rvW2Rkyww4RLXU", "12D3KooWKyvZ8PZyN8UiKdm4TSNsAN4QxBb6JBpSQxR2LTjtBMaL",
         "12D3KooWRhh7DPUTp58wttRuj9Lngr1etsNBifwh6Diu6JWnEAip", "12D3KooWHdTbFRgYvUcm4cWbBk4QVWKSJ5RmfW7ZnE5cS8PkU2Pz"]


def _records(num_blocks: int, servers: Dict[str, ServerInfo]):
    return [{peer: info for peer, info in servers.items() if info.start <= i < info.end} for i in range(num_blocks)]


# ---- the snapshot, without processes --------------------------------------------------------------------------------
def test_build_status_counts_online_reachable_servers():
    servers = {
        PEERS[0]: ServerInfo(state=ServerState.ONLINE, start=0, end=4, throughput=10.0, cache_tokens_left=100,
                             public_name=EVIL_NAME, adapters=("lora-a",)),
        PEERS[1]: ServerInfo(state=ServerState.ONLINE, start=2, end=6, throughput=5.0),
        PEERS[2]: ServerInfo(state=ServerState.JOINING, start=4, end=6, throughput=7.0),
        PEERS[3]: ServerInfo(state=ServerState.OFFLINE, start=0, end=6, throughput=9.0),
    }
    status = build_status(_records(8, servers), "m", "p", rtts={PEERS[0]: 0.0125, PEERS[1]: float("inf")}, now=1.0)
    by_peer = {s.peer_id: s for s in status.servers}
    assert set(by_peer) == set(PEERS[:3])  # the offline one has left
    assert by_peer[PEERS[0]].state == "online" and by_peer[PEERS[0]].rtt_ms == 12.5
    assert by_peer[PEERS[0]].public_name == EVIL_NAME and by_peer[PEERS[0]].adapters == ["lora-a"]
    assert by_peer[PEERS[1]].state == "unreachable" and by_peer[PEERS[1]].rtt_ms is None
    assert by_peer[PEERS[2]].state == "joining" and by_peer[PEERS[2]].rtt_ms is None
    # only online, reachable servers cover blocks: PEERS[0] holds 0:4
    assert [b.servers for b in status.blocks] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert [b.throughput for b in status.blocks][:4] == [10.0] * 4
    assert status.missing == [4, 5, 6, 7] and status.blocks_covered == 4
    assert coverage_bar(status) == "1111...."


def test_block_throughput_is_summed_over_servers():
    servers = {PEERS[0]: ServerInfo(state=ServerState.ONLINE, start=0, end=3, throughput=2.5),
               PEERS[1]: ServerInfo(state=ServerState.ONLINE, start=1, end=3, throughput=4.0)}
    status = build_status(_records(3, servers), "m", "p")
    assert [(b.servers, b.throughput) for b in status.blocks] == [(1, 2.5), (2, 6.5), (2, 6.5)]
    assert status.missing == [] and coverage_bar(status) == "122"


def test_terminal_table_neutralizes_control_characters():
    name = "evil\x1b[2J\x1b]0;title\x07name"
    servers = {PEERS[0]: ServerInfo(state=ServerState.ONLINE, start=0, end=2, public_name=name)}
    table = format_table(build_status(_records(2, servers), "m", "p"))
    assert "\x1b" not in table and "\x07" not in table
    assert PEERS[0] in table and "evil?[2J" in table


def test_page_is_self_contained_and_never_parses_record_text_as_html():
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", PAGE), "no external assets"
    assert "<link" not in PAGE and "@import" not in PAGE
    assert "innerHTML" not in PAGE and "insertAdjacentHTML" not in PAGE and "document.write" not in PAGE
    assert "textContent" in PAGE and "status.json" in PAGE and "setInterval" in PAGE


def test_token_rate_over_a_window():
    rate = TokenRate(window=10)
    assert rate.observe(0, now=0.0) == 0.0
    assert rate.observe(50, now=5.0) == pytest.approx(10.0)
    assert rate.observe(100, now=10.0) == pytest.approx(10.0)
    assert rate.observe(100, now=30.0) == pytest.approx(0.0)  # idle for longer than the window


def test_browser_tests_say_why_they_skip_without_chromium(monkeypatch):
    """Without a browser the set-up installs Debian's chromium as root; otherwise the skip names the reason."""
    from tests.fixtures import apt, browser

    monkeypatch.setattr(browser, "find_chromium", lambda: None)
    monkeypatch.setattr(browser, "_install", {})
    monkeypatch.setattr(browser.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match="not running as root"):
        browser.ensure_chromium()
    monkeypatch.setattr(browser, "_install", {})
    monkeypatch.setattr(browser.os, "geteuid", lambda: 0)
    monkeypatch.setattr(browser.shutil, "which", lambda name: None)  # no apt-get either
    with pytest.raises(pytest.skip.Exception, match="no apt-get"):
        browser.ensure_chromium()
    calls = []
    monkeypatch.setattr(browser, "_install", {})
    monkeypatch.setattr(browser.shutil, "which", lambda name: "/usr/bin/apt-get")

    def failing_apt(*args):
        calls.append(args)
        raise RuntimeError("`apt-get update` exited with 100: E: Could not resolve host")

    monkeypatch.setattr(apt, "apt", failing_apt)
    for _ in range(2):  # tried once per session
        with pytest.raises(pytest.skip.Exception, match="apt-get failed: .*Could not resolve"):
            browser.ensure_chromium()
    assert calls == [("update",)]


# ---- a real swarm ---------------------------------------------------------------------------------------------------
def _rows(dom: str) -> Dict[str, str]:
    """peer id -> the row's HTML, from the rendered servers table."""
    body = dom.split('<tbody id="servers">', 1)[1].split("</tbody>", 1)[0]
    return {m.group(1): m.group(0) for m in re.finditer(r'<tr data-peer="([^"]+)".*?</tr>', body, re.S)}


def _coverage(dom: str) -> list:
    """Servers per block, from the rendered coverage bar's cells."""
    return [int(n) for n in re.findall(r'data-block="\d+" data-servers="(\d+)"', dom)]


@pytest.fixture(scope="module")
def status_swarm(swarms, shared_gateways, model_path):
    """The session's ("0:15", "15:30") swarm and its shared gateway, with one more 0:15 server of a hostile public
    name beside them for this module (the test stops it: a graceful stop announces it offline)."""
    swarm = swarms.get(SPANS)
    gateway = shared_gateways.get()
    extra = topology.start_server(model_path, swarm["initial_peers"], "0:15", swarm["prefix"],
                                  ["--public_name", EVIL_NAME, "--update_period", "15"], name="server-status-evil",
                                  threads=1)  # records that live 30 s: one whose offline store failed on a loaded
                                              # machine is gone well within the test's wait all the same
    try:
        extra.wait_ready(180)
        yield {"prefix": swarm["prefix"], "servers": swarm["servers"], "extra": extra, "url": gateway.url,
               "initial_peers": swarm["initial_peers"]}
    finally:
        extra.terminate()


def _wait_status(url: str, predicate, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    data: dict = {}
    while time.monotonic() < deadline:
        response = httpx.get(url + "/status.json", timeout=30)
        if response.status_code == 200:
            data = response.json()
            if predicate(data):
                return data
        time.sleep(1)
    raise AssertionError(f"status never matched; last: {json.dumps(data)[:2000]}")


def test_status_json_and_cli_and_browser(status_swarm, model_path, tmp_path):
    url, prefix = status_swarm["url"], status_swarm["prefix"]
    everyone = {p.peer_id for p in [*status_swarm["servers"], status_swarm["extra"]]}
    data = _wait_status(url, lambda d: {s["peer_id"] for s in d["servers"]} == everyone)
    assert data["num_blocks"] == 30 and data["blocks_covered"] == 30 and data["missing"] == []
    by_peer = {s["peer_id"]: s for s in data["servers"]}
    evil, first, second = (by_peer[p.peer_id] for p in [status_swarm["extra"], *status_swarm["servers"]])
    assert evil["public_name"] == EVIL_NAME and (evil["start"], evil["end"]) == (0, 15)
    assert all(s["state"] == "online" and s["rtt_ms"] is not None and s["rtt_ms"] > 0 for s in data["servers"])
    assert [b["servers"] for b in data["blocks"]] == [2] * 15 + [1] * 15
    assert data["blocks"][0]["throughput"] == pytest.approx(evil["throughput"] + first["throughput"], rel=1e-3)
    assert data["blocks"][29]["throughput"] == pytest.approx(second["throughput"], rel=1e-3)
    assert {"sessions_pooled", "requests_running", "requests_queued", "tokens_per_second"} <= set(data["gateway"])

    page = httpx.get(url + "/status", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert EVIL_NAME not in page.text  # the page is static: record text only arrives as JSON

    # the same snapshot in a terminal, without the gateway
    cli = subprocess.run([sys.executable, "-m", "launch.cli", "status", model_path, "--initial_peers",
                          *status_swarm["initial_peers"], "--dht_prefix", prefix], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert cli.returncode == 0, cli.stderr
    assert "30/30 blocks served by 3 server(s)" in cli.stdout and "[" + "2" * 15 + "1" * 15 + "]" in cli.stdout
    assert all(peer in cli.stdout for peer in everyone) and "<img src=x" in cli.stdout

    # the page in a real browser: coverage, the three servers, the hostile name as text
    screenshot = tmp_path / "status.png"
    dom = render(url + "/status", screenshot)
    assert 'data-loaded="1"' in dom, dom[-2000:]
    assert _coverage(dom) == [2] * 15 + [1] * 15
    assert 'data-covered="30"' in dom
    rows = _rows(dom)
    assert set(rows) == everyone
    assert html.escape(EVIL_NAME, quote=False) in rows[status_swarm["extra"].peer_id]
    assert "<img" not in dom and "data-pwned" not in dom
    assert screenshot.stat().st_size > 10_000
    if os.environ.get("SWARMGATE_STATUS_SCREENSHOT"):  # `make docs-screenshot`-style refresh of docs/status.png
        shutil.copy(screenshot, os.environ["SWARMGATE_STATUS_SCREENSHOT"])

    # a stopped server leaves the page
    status_swarm["extra"].terminate()
    _wait_status(url, lambda d: len(d["servers"]) == 2 and d["blocks"][0]["servers"] == 1)
    dom = render(url + "/status")
    assert set(_rows(dom)) == everyone - {status_swarm["extra"].peer_id}
    assert _coverage(dom) == [1] * 30
