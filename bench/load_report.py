"""bench_load's report: the py-spy profile summary (top functions and files by share of busy samples) and the
markdown section written to docs/benchmarks.md (tables of the waves, continuous batching, early finishers,
memory, overload, profile). Not a benchmark itself."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import List

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*)(?::(?P<line>\d+))?\)$")
PROJECT = ("gateway/", "swarm/", "server/")
# leaves where a thread waits (py-spy's --nonblocking sampling may still count them as active): reported apart
WAITING = ("Condition.wait (threading.py)", "Event.wait (threading.py)", "EpollSelector.select (selectors.py)",
           "CpuTurns.__enter__ (swarm/runtime/cpu_turns.py)")


def _frame(frame: str):
    m = FRAME.match(frame.strip())
    return (m["func"], m["file"]) if m else (frame.strip(), "")


def _short(file: str) -> str:
    for marker in PROJECT:
        if marker in file:
            return marker + file.split(marker, 1)[1]
    for marker in ("site-packages/", "lib/python3"):
        if marker in file:
            return file.split(marker, 1)[1].lstrip("/0123456789.").split("/", 1)[-1]
    return file


def profile_summary(raw: str, wall_s: float, rate: int, top: int = 12) -> dict:
    """From py-spy's raw output (`frame;frame;... count`, root first): busy samples (those whose leaf is a wait
    in `WAITING` counted apart), the gateway's busy share of one core, top functions by self share (the leaf
    frame), project functions (gateway/, swarm/, server/) by inclusive share, files by self share."""
    leaf, inclusive, files = Counter(), Counter(), Counter()
    total = waiting = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        func, file = frames[-1]
        if f"{func} ({_short(file)})" in WAITING:
            waiting += n
            continue
        total += n
        leaf[f"{func} ({_short(file)})"] += n
        files[_short(file)] += n
        for key in {f"{f} ({_short(p)})" for f, p in frames if any(m in p for m in PROJECT)}:
            inclusive[key] += n

    def shares(counter: Counter) -> List[list]:
        return [[k, round(100 * v / total, 1)] for k, v in counter.most_common(top)] if total else []

    return {"busy_samples": total, "busy_share_of_one_core": round(total / (wall_s * rate), 2),
            "waiting_samples": waiting,
            "top_self_pct": shares(leaf), "top_project_inclusive_pct": shares(inclusive),
            "top_files_self_pct": shares(files)}


def _pct(d: dict) -> str:
    return " / ".join("-" if d[k] is None else f"{d[k]:g}" for k in ("p50", "p95", "p99"))


def markdown(r: dict) -> List[str]:
    local = r["local_transformers"]
    out = ["", f"Gateway under load (issue 17): 2 servers (0:15, 15:30), float32, {r['tokens']} completion tokens "
           f"per request, temperature 1, distinct seeds and prompts, `ignore_eos`; load average "
           f"{r['load_average_at_start']} at start, {r['load_average_at_end']} at end ({r['cpu_count']} cores "
           f"shared with the servers, the gateway and this client). Local limit: transformers `generate` in one "
           f"process ({local['threads']} threads), greedy, KV cache; 'e2e' counts the prompt's prefill, "
           f"'decode' only the steps after the first token.", "",
           "| streams | gateway tok/s | local batch tok/s (e2e / decode) | ratio (e2e / decode) | TTFT ms "
           "p50/p95/p99 | inter-chunk ms p50/p95/p99 | gateway CPU ms/token (process / with DHT) | servers CPU "
           "ms/token | gateway RSS peak MB |", "|---|---|---|---|---|---|---|---|---|"]
    for n, w in r["waves"].items():
        loc = local.get(n)
        local_s = f"{loc['e2e']} / {loc['decode']}" if loc else "-"
        ratio = f"{w['ratio_to_local_e2e']} / {w['ratio_to_local_decode']}" if loc else "-"
        out.append(f"| {n} | {w['tokens_per_s']} | {local_s} | {ratio} | {_pct(w['ttft_ms'])} | {_pct(w['itl_ms'])} "
                   f"| {w['gateway_cpu_ms_per_token']} / {w['gateway_tree_cpu_ms_per_token']} | "
                   f"{w['servers_cpu_ms_per_token']} | {w['gateway_rss_peak_mb']} |")
    batches = ", ".join(f"batch {k}: {v['e2e']} / {v['decode']}" for k, v in local.items() if k != "threads")
    out += ["", f"Local transformers tokens/s (e2e / decode): {batches}.",
            "", "Continuous batching: a 9th request arriving while 8 stream.", "",
            "| 9th request | idle TTFT ms | TTFT amid 8 ms | ratio | others' inter-chunk ms before | during its "
            "prefill (mean / max) | ratio |", "|---|---|---|---|---|---|---|"]
    for label, key in (("short prompt", "join_short_prompt"), (f"{r['long_prompt_tokens']}-token prompt",
                                                               "join_long_prompt")):
        j = r[key]
        out.append(f"| {label} | {j['idle_ttft_ms']} | {j['ttft_amid_8_ms']} | {j['ttft_ratio']} | "
                   f"{j['others_itl_before_ms']} | {j['others_itl_during_prefill_ms']} / "
                   f"{j['others_itl_max_during_prefill_ms']} | {j['itl_ratio']} |")
    e = r["early_finishers"]
    out += ["", f"Early finishers: 4 long streams with 4 short ones ({', '.join(e['short_finishes'])}): the long "
            f"ones' aggregate rate {e['long_rate_while_short_run']} chunks/s while the short ones run, "
            f"{e['long_rate_after_short_done']} after (x{e['rate_ratio_after_vs_during']}).", "",
            f"Gateway RSS: {r['gateway_rss_at_start_mb']} MB at start, {r['gateway_rss_after_warmup_mb']} MB after "
            f"warm-up, peak {r['gateway_rss_peak_mb']} MB (largest wave: {max(r['waves'], key=int)} streams)."]
    o = r["overload"]
    out += ["", f"Overload (a gateway with --max_concurrent 2 --max_queue 2): {o['requests']} requests at once: "
            f"{o['ok']} served ({o['ok_complete']} complete), {o['http_429']} got 429 ({o['with_retry_after']} "
            f"with Retry-After) in {_pct(o['latency_429_ms'])} ms (p50/p95/p99), {o['other']} other, "
            f"{o['hung']} hung; healthy after: {o['gateway_up_after']}."]
    p = r.get("profile_8_streams")
    if p and "error" not in p:
        out += ["", f"Profile of the gateway process during 8 streams (py-spy, 100 Hz, {p['busy_samples']} busy "
                f"samples, {p['busy_share_of_one_core']} of one core busy, {p.get('waiting_samples', 0)} more samples "
                f"waiting on a condition, the event loop's select or the CPU turn; {p['tokens']} tokens):", "",
                "| top functions (self) | % | project functions (inclusive) | % | files (self) | % |",
                "|---|---|---|---|---|---|"]
        rows = max(len(p["top_self_pct"]), len(p["top_project_inclusive_pct"]))
        for i in range(rows):
            cells = []
            for key in ("top_self_pct", "top_project_inclusive_pct", "top_files_self_pct"):
                item = p[key][i] if i < len(p[key]) else ["", ""]
                cells += [f"`{item[0]}`" if item[0] else "", str(item[1])]
            out.append("| " + " | ".join(cells) + " |")
    elif p:
        out += ["", f"Profile: {p['error']}"]
    return out + [""]


def write_section(path: Path, name: str, lines: List[str]) -> None:
    """Replace (or append) the `## name` section of a markdown file."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = "\n".join([f"## {name}", *lines]) + "\n"
    pattern = re.compile(rf"^## {re.escape(name)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
