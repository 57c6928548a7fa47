"""Shared read-only prefix pages or a copy on adoption (issue 47: "whichever measures better here"), measured on the
bundled model's shapes for one server's span (15 of its 30 blocks), on this machine's CPU with one torch thread (as
the test and bench servers run).

A session that adopts P positions of prefix pages either copies them into its own cache buffers once
(`PrefixCache.adopt`, what the servers do) and then attends over one contiguous buffer per block at every step, or
keeps reading the pages where they are (no copy, no memory of its own for them) and attends over the pages and its own
buffer at every step: either by joining them per step (`torch.cat`, then the same attention) or with an attention over
each part and the two merged by their log-sum-exp (no copy at all, as paged attention would). Measured: the copy's
time and bytes per adopting session, and a decode step's attention time over all 15 blocks (one query token,
grouped-query heads as `swarm.modeling.layers` runs them) for each layout; `break_even_steps` is how many decode steps
of the shared layout's extra time the copy is worth (the copy wins for a session that decodes more).

Each is timed in turn within every repetition (a rotating order), so that a shared machine's load weighs on all alike.

Usage (from the repository root): .venv/bin/python bench/bench_prefix_pages.py [--prefix_tokens 1024] [--repeats 100]
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from server.compute.cache import CacheBudget, SessionKV  # noqa: E402
from server.compute.prefix_cache import PrefixCache  # noqa: E402

PAGE = 64
BLOCKS = 15  # one server's span of the bundled model (0:15 or 15:30)


def _interleaved_ms(fns: dict, repeats: int) -> dict:
    """The median time (ms) of each of `fns`, run in turn within each repetition (in a rotating order), so that the
    load of a shared machine weighs on all of them alike."""
    names = list(fns)
    times: dict = {name: [] for name in names}
    for name in names:
        fns[name]()  # warm-up
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            began = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - began)
    return {name: round(statistics.median(t) * 1000, 3) for name, t in times.items()}


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [1, heads, 1, dim] -> [1, kv_heads, heads / kv_heads, dim]: one query token's heads grouped per kv head."""
    return q.reshape(1, kv_heads, q.shape[1] // kv_heads, q.shape[-1])


def _part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Attention over one part of the keys: (unnormalized output, running max, sum of weights)."""
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # [1, kv_heads, groups, keys]
    peak = logits.amax(dim=-1, keepdim=True)
    weights = torch.exp(logits - peak)
    return torch.matmul(weights, v), peak, weights.sum(dim=-1, keepdim=True)


def _merged(q, parts, scale: float) -> torch.Tensor:
    (o1, m1, s1), (o2, m2, s2) = (_part(q, k, v, scale) for k, v in parts)
    peak = torch.maximum(m1, m2)
    a, b = torch.exp(m1 - peak), torch.exp(m2 - peak)
    return (o1 * a + o2 * b) / (s1 * a + s2 * b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix_tokens", type=int, default=1024)
    parser.add_argument("--own_tokens", type=int, default=48, help="positions the session computed after the prefix")
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from swarm.modeling.prepare import prepare_model

    with open(os.path.join(str(prepare_model()), "config.json")) as f:
        config = json.load(f)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    dim = config.get("head_dim", hidden // heads)
    pages_n = args.prefix_tokens // PAGE
    prefix, length = pages_n * PAGE, pages_n * PAGE + args.own_tokens
    scale = dim ** -0.5

    cache = PrefixCache(CacheBudget(1 << 30), PAGE)
    source = SessionKV(BLOCKS, 1, kv_heads, dim, length + 64, torch.float32, torch.device("cpu"))
    source.begin_step(0)
    for buf in source.keys + source.values:
        buf.normal_()
    source.end_step(length)
    outputs = torch.randn(1, prefix, hidden)
    pages = [cache.cut(source, i, PAGE, outputs) for i in range(pages_n)]

    def adopt() -> None:
        cache.adopt(SessionKV(BLOCKS, 1, kv_heads, dim, length + 64, torch.float32, torch.device("cpu")), pages, PAGE)

    # the session's cache after the copy: one buffer per block over [0, length)
    kv = SessionKV(BLOCKS, 1, kv_heads, dim, length + 64, torch.float32, torch.device("cpu"))
    cache.adopt(kv, pages, PAGE)
    own_k = [buf[:, :, prefix:length] for buf in source.keys]  # the positions after the prefix, its own
    own_v = [buf[:, :, prefix:length] for buf in source.values]
    for buf, own in zip(kv.keys + kv.values, own_k + own_v):  # (computed by the session after the adoption)
        buf[:, :, prefix:length].copy_(own)
    page_k = [torch.cat([p.keys[layer] for p in pages], dim=2) for layer in range(BLOCKS)]  # (read-only pages, joined
    page_v = [torch.cat([p.values[layer] for p in pages], dim=2) for layer in range(BLOCKS)]  # once: the best case)
    q = torch.randn(1, heads, 1, dim)
    g = _grouped(q, kv_heads)

    def contiguous() -> None:
        for layer in range(BLOCKS):
            F.scaled_dot_product_attention(g, kv.keys[layer][:, :, :length], kv.values[layer][:, :, :length],
                                           scale=scale)

    def shared_cat() -> None:
        for layer in range(BLOCKS):
            k = torch.cat([page_k[layer], own_k[layer]], dim=2)
            v = torch.cat([page_v[layer], own_v[layer]], dim=2)
            F.scaled_dot_product_attention(g, k, v, scale=scale)

    def shared_split() -> None:
        for layer in range(BLOCKS):
            _merged(g, [(page_k[layer], page_v[layer]), (own_k[layer], own_v[layer])], scale)

    # the layouts attend alike (the split's merge is exact up to rounding)
    ref = F.scaled_dot_product_attention(g, kv.keys[0][:, :, :length], kv.values[0][:, :, :length], scale=scale)
    split = _merged(g, [(page_k[0], page_v[0]), (own_k[0], own_v[0])], scale)
    assert torch.allclose(ref, split, atol=1e-5), (ref - split).abs().max()

    measured = _interleaved_ms({"adopt": adopt, "copy_then_contiguous": contiguous, "shared_cat_per_step": shared_cat,
                                "shared_split_lse": shared_split}, args.repeats)
    copy_ms = measured.pop("adopt")
    step = measured
    best_shared = min(step["shared_cat_per_step"], step["shared_split_lse"])
    extra = best_shared - step["copy_then_contiguous"]
    copy_bytes = sum(sum(t.numel() * t.element_size() for t in p.keys + (p.values or [])) for p in pages)
    result = {
        "benchmark": "prefix_pages_shared_vs_copy",
        "blocks": BLOCKS, "prefix_tokens": prefix, "own_tokens": args.own_tokens, "page_tokens": PAGE,
        "kv_heads": kv_heads, "heads": heads, "head_dim": dim, "torch_threads": 1,
        "copy_on_adoption_ms": copy_ms,
        "copy_bytes_per_session": copy_bytes,
        "attention_ms_per_decode_step": step,
        "shared_extra_ms_per_step": round(extra, 3),
        "break_even_steps": round(copy_ms / extra, 1) if extra > 0 else None,
        "better": "copy" if extra > 0 else "shared",
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
