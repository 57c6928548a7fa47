"""The gateway's swarm status page: `GET /status` (HTML) and `GET /status.json` (the same data). The data is the
swarm's snapshot (`swarm.client.transport.status.SwarmStatus`: a coverage entry per block, a row per server with its RTT
from this gateway) read through the client model (`ClientModel.swarm_status`), plus this gateway's own figures: sessions
pooled, requests running and queued, and generated tokens per second over the last minute, and with `--verify_rate`
the spot-checks' counters (`verification`; null when off), each server marked `distrusted` when the checks outvoted
it (the page shows its state as "distrusted"). Snapshots are cached for `CACHE_SECONDS` so that many open pages cost
one DHT read and one round of pings. The page is one self-contained HTML document (inline CSS and JS, no external
assets) that fetches `/status.json` every few seconds and builds the DOM with `textContent` only: peer names and
every other string from the records are untrusted and never parsed as HTML. Both routes are public, like `/health`
and `/metrics`.
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Deque, Dict, Optional, Tuple

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

CACHE_SECONDS = 2.0
RATE_WINDOW = 60.0  # seconds over which tokens/s is averaged
REFRESH_MS = 3000  # the page's refresh period


class TokenRate:
    """Generated tokens per second over the last `window` seconds, from samples of a running total."""

    def __init__(self, window: float = RATE_WINDOW):
        self.window = window
        self.samples: Deque[Tuple[float, float]] = collections.deque()

    def observe(self, total: float, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()
        first_time, first_total = self.samples[0]
        return 0.0 if now - first_time <= 0 else max(0.0, total - first_total) / (now - first_time)


class StatusSource:
    """Builds `/status.json` for one gateway (`gateway.api.state.GatewayState`), caching the swarm snapshot."""

    def __init__(self, state):
        self.state = state
        self.rate = TokenRate()
        self._cached: Optional[Tuple[float, Dict[str, Any]]] = None
        self._lock = asyncio.Lock()

    def gateway_figures(self) -> Dict[str, Any]:
        metrics, admission = self.state.metrics, self.state.admission
        total = metrics.registry.get_sample_value("swarmgate_completion_tokens_total") or 0.0
        return {"sessions_pooled": len(metrics.pool) if metrics.pool is not None else 0,
                "requests_running": admission.running, "requests_queued": admission.waiting,
                "tokens_per_second": round(self.rate.observe(total), 2), "tokens_generated": int(total)}

    async def snapshot(self) -> Dict[str, Any]:
        async with self._lock:  # one refresh at a time; concurrent pages share it
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] > CACHE_SECONDS:
                swarm = await run_in_threadpool(self.state.model.swarm_status, self.state.config.model_name)
                self._cached = (time.monotonic(), swarm.model_dump(mode="json"))
            swarm_data = self._cached[1]
        stats = self.state.model.verify_stats()
        distrusted = set(stats.distrusted) if stats is not None else set()
        servers = [{**server, "distrusted": server.get("peer_id") in distrusted}
                   for server in swarm_data.get("servers", [])]
        verification = None if stats is None else {k: v for k, v in stats.as_dict().items()}
        return {**swarm_data, "servers": servers, "gateway": self.gateway_figures(), "verification": verification}


def add_status_routes(app: FastAPI, state) -> None:
    source = StatusSource(state)

    @app.get("/status.json")
    async def status_json():
        try:
            return await source.snapshot()
        except Exception as e:
            return JSONResponse({"error": {"message": f"cannot read the swarm's state: {e}",
                                           "type": "swarm_unavailable"}}, status_code=503)

    @app.get("/status", response_class=HTMLResponse)
    async def status_page():
        return HTMLResponse(PAGE, headers=PAGE_HEADERS)


# the gateway's pages (this one, `gateway.api.chat_page`): inline CSS and JS only, requests to this origin only
PAGE_HEADERS = {"Cache-Control": "no-store",
                "Content-Security-Policy": "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'"}


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>swarmgate status</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .2em} h2{font-size:1.05em;margin:1.4em 0 .4em}
.muted{color:#777} .err{color:#b00020;font-weight:600}
#coverage{display:flex;gap:2px;margin:.4em 0;max-width:100%}
.block{flex:1 1 0;min-width:6px;height:34px;border-radius:2px;position:relative}
.block span{position:absolute;bottom:1px;left:0;right:0;text-align:center;font-size:10px;color:#fff}
.b0{background:#d32f2f}.b1{background:#f9a825}.b2{background:#7cb342}.b3{background:#2e7d32}
table{border-collapse:collapse;background:#fff;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;white-space:nowrap}
th{background:#f0f0f0} td.num{text-align:right} td.peer{font-family:monospace}
td.name{max-width:16em;overflow:hidden;text-overflow:ellipsis}
.online{color:#2e7d32}.joining{color:#f57f17}.unreachable{color:#b00020}
.distrusted{color:#fff;background:#b00020;font-weight:600}
.figures{display:flex;gap:1.5em;flex-wrap:wrap}.figures div{background:#fff;border:1px solid #ddd;padding:.4em .8em}
.figures b{display:block;font-size:1.3em}
</style></head>
<body>
<h1>swarmgate <span id="model" class="muted"></span></h1>
<div id="summary" class="muted">loading…</div>
<div id="error" class="err"></div>
<h2>Coverage <span class="muted">(servers per block; hover for throughput)</span></h2>
<div id="coverage" data-covered="" data-total=""></div>
<div class="muted"><span id="cov-text"></span></div>
<h2>Servers</h2>
<table><thead><tr><th>peer id</th><th>name</th><th>blocks</th><th>state</th><th>reach</th><th>steps/s</th>
<th>free cache tokens</th><th>quant</th><th>adapters</th><th>release</th><th>protocol</th><th>RTT ms</th>
<th>prefix pages hit / computed / evicted</th></tr></thead>
<tbody id="servers"></tbody></table>
<h2>This gateway</h2>
<div class="figures" id="figures"></div>
<p class="muted">Refreshes every REFRESH_S s · <a href="status.json">status.json</a> · <span id="updated"></span></p>
<script>
"use strict";
function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}
function fmt(x, digits) { return (typeof x === "number") ? x.toFixed(digits) : "-"; }
function render(data) {
  document.getElementById("error").textContent = "";
  document.getElementById("model").textContent = data.model;
  document.getElementById("summary").textContent = data.blocks_covered + "/" + data.num_blocks +
    " blocks served by " + data.servers.length + " server(s); DHT prefix " + data.prefix;
  const cov = document.getElementById("coverage");
  cov.replaceChildren();
  cov.dataset.covered = data.blocks_covered; cov.dataset.total = data.num_blocks;
  for (const b of data.blocks) {
    const cell = el("div", null, "block b" + Math.min(b.servers, 3));
    cell.dataset.block = b.index; cell.dataset.servers = b.servers;
    cell.title = "block " + b.index + ": " + b.servers + " server(s), " + fmt(b.throughput, 1) + " steps/s";
    cell.appendChild(el("span", b.servers));
    cov.appendChild(cell);
  }
  document.getElementById("cov-text").textContent = data.missing.length ?
    "missing blocks: " + data.missing.join(", ") : "every block is served";
  const body = document.getElementById("servers");
  body.replaceChildren();
  for (const s of data.servers) {
    const state = s.distrusted ? "distrusted" : s.state;
    const row = el("tr"); row.dataset.peer = s.peer_id; row.dataset.state = state;
    const peer = el("td", s.peer_id.length > 20 ? s.peer_id.slice(0, 12) + "…" + s.peer_id.slice(-6) : s.peer_id,
      "peer");
    const name = el("td", s.public_name, "name");
    peer.title = s.peer_id; name.title = s.public_name;
    row.append(peer, name, el("td", s.start + ":" + s.end),
      el("td", state, state), el("td", s.reachable), el("td", fmt(s.throughput, 1), "num"),
      el("td", s.cache_tokens_left, "num"),
      el("td", s.quant_type + " / " + s.dtype), el("td", s.adapters.length ? s.adapters.join(", ") : "-"),
      el("td", s.version), el("td", s.protocol), el("td", s.rtt_ms === null ? "-" : fmt(s.rtt_ms, 1), "num"),
      el("td", s.prefix_pages ? s.prefix_pages.hit + " / " + s.prefix_pages.computed + " / " + s.prefix_pages.evicted
        : "-", "num"));
    body.appendChild(row);
  }
  const g = data.gateway, figures = document.getElementById("figures");
  figures.replaceChildren();
  const items = [["sessions pooled", g.sessions_pooled], ["requests running", g.requests_running],
    ["requests queued", g.requests_queued], ["tokens/s (1 min)", fmt(g.tokens_per_second, 1)],
    ["tokens generated", g.tokens_generated]];
  const v = data.verification;
  if (v) items.push(["spot-checks passed / done", v.passed + " / " + v.checks],
    ["unverifiable (one server per span)", v.unverifiable], ["servers distrusted", v.distrusted.length]);
  for (const [label, value] of items) {
    const box = el("div"); box.append(el("b", value), el("span", label)); figures.appendChild(box);
  }
  document.getElementById("updated").textContent = "updated " + new Date(data.updated * 1000).toLocaleTimeString();
  document.body.dataset.loaded = "1";
}
async function refresh() {
  try {
    const response = await fetch("status.json", {cache: "no-store"});
    const data = await response.json();
    if (!response.ok) throw new Error(data.error ? data.error.message : response.statusText);
    render(data);
  } catch (e) {
    document.getElementById("error").textContent = "cannot refresh: " + e.message;
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
</script></body></html>
""".replace("REFRESH_MS", str(REFRESH_MS)).replace("REFRESH_S", str(REFRESH_MS // 1000))
