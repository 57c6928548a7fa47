"""The gateway's chat page: `GET /chat` (and `GET /` for a browser, which is sent there), one self-contained HTML page
to talk to the swarm through the gateway's own OpenAI API.

The page lists `/v1/models` (each model the gateway serves, marked when its swarm lacks blocks, and their served LoRA
adapters) to choose from, and keeps the conversation
in the browser: each turn sends the whole message history to `POST /v1/chat/completions` with `stream: true` and
`stream_options.include_usage`, as OpenAI clients do, and the gateway's session pool finds the session that already
holds the conversation's prefix, so only the new tokens travel (the reply shows the prompt tokens served from the
pool, `usage.prompt_tokens_details.cached_tokens`). Text is appended as the SSE chunks arrive; Stop aborts the
fetch, which cancels the generation on the gateway (its session closes), and keeps the text received so far in
the conversation. Each reply shows its tokens, tokens per second (completion tokens over the time from the first
token to the last), the cached prompt tokens and the servers that served it: the usage chunk's `swarm.servers`
(swarmgate's extension, `gateway.schemas.SwarmInfo`), named and placed with `/status.json` where it answers.
Temperature, top-p and max tokens are the request's; an API key, when the gateway wants one, is typed into the page
and sent as a bearer token (kept in the tab's sessionStorage only).

Like `/status`, the page has inline CSS and JS only, no external assets, the same Content-Security-Policy, and
builds its DOM with `textContent`: model output and server names are never parsed as HTML. The route is public;
the API calls it makes are checked like any other client's.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from gateway.api.status import PAGE_HEADERS


def add_chat_routes(app: FastAPI, root_json) -> None:
    """`/chat`, and `/`: the page for a browser (Accept: text/html), else `root_json()` as before."""

    @app.get("/chat", response_class=HTMLResponse)
    async def chat_page():
        return HTMLResponse(PAGE, headers=PAGE_HEADERS)

    @app.get("/")
    async def root(request: Request) -> Response:
        if "text/html" in request.headers.get("accept", ""):
            return RedirectResponse("/chat", status_code=307)
        return root_json()


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>swarmgate chat</title>
<style>
*{box-sizing:border-box}
body{font:15px/1.45 system-ui,sans-serif;margin:0;color:#222;background:#fafafa;display:flex;flex-direction:column;
  height:100vh}
header{display:flex;flex-wrap:wrap;gap:.6em 1.2em;align-items:center;padding:.6em 1em;background:#fff;
  border-bottom:1px solid #ddd}
header h1{font-size:1.15em;margin:0} header label{font-size:13px;color:#555}
header input,header select{font:inherit;font-size:13px;margin-left:.3em}
header input[type=number]{width:5.5em} #key{width:10em}
#log{flex:1;overflow-y:auto;padding:1em;display:flex;flex-direction:column;gap:.8em}
.msg{max-width:52em;padding:.55em .8em;border-radius:8px;white-space:pre-wrap;word-wrap:break-word}
.user{align-self:flex-end;background:#dbeafe} .assistant{align-self:flex-start;background:#fff;border:1px solid #ddd}
.meta{display:block;margin-top:.35em;font-size:12px;color:#777;white-space:normal}
.assistant[data-state=streaming] .text::after{content:"\\25CF";color:#2e7d32;margin-left:.2em}
.assistant[data-state=stopped] .meta::before{content:"stopped \\00B7  ";color:#b26a00}
.assistant[data-state=error]{border-color:#b00020} .err{color:#b00020;font-weight:600}
form{display:flex;gap:.6em;padding:.7em 1em;background:#fff;border-top:1px solid #ddd}
textarea{flex:1;font:inherit;min-height:2.8em;max-height:10em;resize:vertical;padding:.4em}
button{font:inherit;padding:.3em 1.1em;border-radius:6px;border:1px solid #888;background:#f3f3f3;cursor:pointer}
button.primary{background:#1d4ed8;border-color:#1d4ed8;color:#fff} button:disabled{opacity:.45;cursor:default}
#status{font-size:12px;color:#777;padding:0 1em .4em;background:#fff}
</style></head>
<body>
<header>
<h1>swarmgate chat</h1>
<label>model <select id="model"></select></label>
<label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="0.7"></label>
<label>top-p <input id="top_p" type="number" min="0" max="1" step="0.05" value="0.95"></label>
<label>max tokens <input id="max_tokens" type="number" min="1" step="1" value="256"></label>
<label>API key <input id="key" type="password" placeholder="if required" autocomplete="off"></label>
<button id="new" type="button">New chat</button>
</header>
<div id="log" aria-live="polite"></div>
<form id="form">
<textarea id="input" placeholder="Message the swarm (Enter sends, Shift+Enter: a new line)"></textarea>
<button id="send" class="primary" type="submit">Send</button>
<button id="stop" type="button" disabled>Stop</button>
</form>
<div id="status">loading models…</div>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const messages = [];  // the conversation as OpenAI messages, sent whole each turn
let controller = null, names = {};
function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}
function headers() {
  const h = {"Content-Type": "application/json"}, key = $("key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}
function status(text, error) { $("status").textContent = text; $("status").className = error ? "err" : ""; }
async function loadModels() {
  try {
    const response = await fetch("/v1/models", {headers: headers()});
    const data = await response.json();
    if (!response.ok) throw new Error(data.error ? data.error.message : response.statusText);
    const select = $("model"), keep = select.value;
    select.replaceChildren();
    for (const m of data.data) {
      const c = m.coverage, partial = c && c.blocks_served < c.blocks;  // a model whose swarm lacks blocks
      const label = m.parent ? m.id + " (adapter of " + m.parent + ")"
                  : partial ? m.id + " (" + c.blocks_served + "/" + c.blocks + " blocks served)" : m.id;
      const option = el("option", label);
      option.value = m.id; select.appendChild(option);
    }
    if (keep) select.value = keep;
    status(data.data.length + " model(s) served");
    document.body.dataset.ready = "1";
  } catch (e) { status("cannot list models: " + e.message, true); }
}
async function loadNames() {  // peer id -> "name (blocks a:b)", from the public status snapshot
  try {
    const data = await (await fetch("/status.json", {cache: "no-store"})).json();
    for (const s of data.servers || []) {
      names[s.peer_id] = (s.public_name ? s.public_name + " " : "") + s.peer_id.slice(-6) + " (" + s.start + ":" +
        s.end + ")";
    }
  } catch (e) { /* the page works without names */ }
}
function bubble(role, text) {
  const box = el("div", null, "msg " + role), body = el("span", text, "text");
  box.appendChild(body); $("log").appendChild(box); $("log").scrollTop = $("log").scrollHeight;
  return box;
}
function describe(box, r) {
  const seconds = r.last && r.first ? (r.last - r.first) / 1000 : 0;
  const tokens = r.usage ? r.usage.completion_tokens : r.chunks;
  const rate = seconds > 0 && tokens > 1 ? ((tokens - 1) / seconds).toFixed(1) + " tokens/s" : "";
  const parts = [tokens + " tokens" + (r.usage ? "" : " (chunks)"), rate];
  if (r.usage) {
    const cached = (r.usage.prompt_tokens_details || {}).cached_tokens || 0;
    parts.push("prompt " + r.usage.prompt_tokens + " tokens, " + cached + " from the session pool");
    box.dataset.cached = cached; box.dataset.promptTokens = r.usage.prompt_tokens;
    box.dataset.completionTokens = r.usage.completion_tokens;
  }
  if (r.servers) {
    const chain = r.servers.map((p) => names[p] || p.slice(-6)).join(" \\u2192 ");
    parts.push("served by " + (chain || "-"));
    box.dataset.servers = r.servers.join(",");
  }
  if (r.first) parts.push("first token after " + ((r.first - r.start) / 1000).toFixed(2) + " s");
  let meta = box.querySelector(".meta");
  if (!meta) { meta = el("span", null, "meta"); box.appendChild(meta); }
  meta.textContent = parts.filter(Boolean).join(" \\u00b7 ");
}
async function send(text) {
  messages.push({role: "user", content: text});
  bubble("user", text);
  const box = bubble("assistant", ""), body = box.querySelector(".text");
  box.dataset.state = "streaming";
  const r = {start: performance.now(), first: 0, last: 0, chunks: 0, usage: null, servers: null};
  const request = {model: $("model").value, messages: messages, stream: true, stream_options: {include_usage: true},
    temperature: Number($("temperature").value), top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value)};
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  status("generating…");
  let reply = "", outcome = "done";
  try {
    const response = await fetch("/v1/chat/completions", {method: "POST", headers: headers(),
      body: JSON.stringify(request), signal: controller.signal});
    if (!response.ok) {
      const data = await response.json().catch(() => ({}));
      throw new Error(data.error ? data.error.message : response.status + " " + response.statusText);
    }
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let buffer = "", done = false;
    while (!done) {
      const part = await reader.read();
      if (part.done) break;
      buffer += decoder.decode(part.value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\\n")) >= 0) {
        const line = buffer.slice(0, end).replace(/\\r$/, ""); buffer = buffer.slice(end + 1);
        if (!line.startsWith("data:")) continue;  // SSE comments (keep-alives), blank separators
        const data = line.slice(5).trim();
        if (data === "[DONE]") { done = true; break; }
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices && chunk.choices[0] ? chunk.choices[0].delta : null;
        if (delta && delta.content) {
          const now = performance.now();
          if (!r.first) r.first = now;
          r.last = now; r.chunks += 1; reply += delta.content; body.textContent = reply;
          $("log").scrollTop = $("log").scrollHeight;
        }
        if (chunk.usage) r.usage = chunk.usage;
        if (chunk.swarm) r.servers = chunk.swarm.servers;
      }
    }
    status("ready");
  } catch (e) {
    if (e.name === "AbortError") { outcome = "stopped"; status("stopped"); }
    else { outcome = "error"; box.appendChild(el("span", e.message, "meta err")); status(e.message, true); }
  } finally {
    controller = null;
    $("send").disabled = false; $("stop").disabled = true;
  }
  if (reply) messages.push({role: "assistant", content: reply});  // a stopped reply's text stays in the chat
  else if (outcome !== "done") messages.pop();  // nothing came back: the turn is not kept
  if (r.servers) await loadNames();
  describe(box, r);
  box.dataset.state = outcome;  // last: the reply's figures are all shown
}
$("form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("form").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("new").addEventListener("click", () => {
  if (controller) controller.abort();
  messages.length = 0; $("log").replaceChildren(); status("new conversation");
});
$("key").value = sessionStorage.getItem("swarmgate-key") || "";
$("key").addEventListener("change", () => { sessionStorage.setItem("swarmgate-key", $("key").value); loadModels(); });
loadModels();
loadNames();
</script></body></html>
"""
