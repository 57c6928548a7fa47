"""The load generator of bench_load: concurrent streaming chat completions over HTTP (httpx, asyncio), each
stream's chunk arrival times, and the statistics made from them (TTFT, inter-token latency, aggregate rate).

Not a benchmark itself (run_all runs only bench_*.py).

    async with httpx.AsyncClient(...) as http:
        streams = await asyncio.gather(*(stream_chat(http, url, body(i)) for i in range(8)))
    print(wave_stats(streams))
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import httpx
import numpy as np


@dataclass
class Stream:
    """One request: its send time, the arrival time of each chunk carrying text, and what the gateway said."""
    sent: float
    status: int = 0
    times: List[float] = field(default_factory=list)  # perf_counter of each chunk with content
    text: str = ""
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    ended: float = 0.0
    answered: float = 0.0  # when the response's status line and headers came (after admission)
    headers: Dict[str, str] = field(default_factory=dict)
    error: Optional[str] = None

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent

    @property
    def gaps(self) -> List[float]:
        return list(np.diff(self.times)) if len(self.times) > 1 else []


async def stream_chat(http: httpx.AsyncClient, url: str, body: dict, progress: Optional[Stream] = None) -> Stream:
    """POST a streaming chat completion and read it to the end (`progress`: a Stream to fill while it runs,
    so that a scenario can watch it)."""
    s = progress or Stream(sent=time.perf_counter())
    s.sent = time.perf_counter()
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as response:
            s.status, s.headers, s.answered = response.status_code, dict(response.headers), time.perf_counter()
            if response.status_code != 200:
                await response.aread()
                s.error = response.text[:300]
                return s
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("error"):  # a failure mid-stream: an error object, then [DONE]
                    s.error = json.dumps(chunk["error"])[:300]
                if chunk.get("usage"):
                    s.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        s.times.append(now)
                        s.text += content
                    if choice.get("finish_reason"):
                        s.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        s.error = repr(e)
    finally:
        s.ended = time.perf_counter()
    return s


def percentiles(values: Sequence[float], scale: float = 1000.0) -> Dict[str, Optional[float]]:
    """p50/p95/p99 (ms by default) of `values`."""
    if not len(values):
        return {"p50": None, "p95": None, "p99": None}
    p = np.percentile(np.asarray(values) * scale, [50, 95, 99])
    return {"p50": round(float(p[0]), 1), "p95": round(float(p[1]), 1), "p99": round(float(p[2]), 1)}


def wave_stats(streams: Sequence[Stream]) -> dict:
    """Aggregate completion tokens/s over the wave's wall time (first send to last end), TTFT and inter-token
    latency percentiles (ms) over all streams' chunks."""
    ok = [s for s in streams if s.status == 200 and s.error is None and s.times]
    tokens = sum(s.completion_tokens for s in ok)
    wall = max(s.ended for s in ok) - min(s.sent for s in ok) if ok else float("nan")
    return {"streams": len(streams), "failed": len(streams) - len(ok), "completion_tokens": tokens,
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2) if ok else 0.0,
            "ttft_ms": percentiles([s.ttft for s in ok]),
            "itl_ms": percentiles([g for s in ok for g in s.gaps])}


def gaps_in(streams: Sequence[Stream], start: float, end: float) -> List[float]:
    """Inter-chunk gaps of `streams` that overlap the interval [start, end]."""
    out = []
    for s in streams:
        for a, b in zip(s.times, s.times[1:]):
            if b > start and a < end:
                out.append(b - a)
    return out


def chunks_in(streams: Sequence[Stream], start: float, end: float) -> int:
    """Chunks with text that `streams` received in [start, end)."""
    return sum(1 for s in streams for t in s.times if start <= t < end)


async def wait_for(predicate, timeout: float = 300.0, interval: float = 0.05) -> bool:
    deadline = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(interval)
    return True
