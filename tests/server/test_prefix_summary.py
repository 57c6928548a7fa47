"""What a server announces of its prefix cache (issue 47), without processes: the handler's summary of the pages held
(most recently used first, a client's digests match it), in the online record only, and a re-announcement due when
other pages are held (not when held ones are only used). The real swarm: tests/e2e/test_prefix_routing.py."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from server.compute.cache import CacheBudget, SessionKV
from server.compute.prefix_cache import PrefixCache
from server.placement.announce import Announcer
from server.rpc.prefix import PrefixHandler
from swarm.wire.prefix_pages import held_pages, page_digests
from swarm.wire.records import ServerState

TOKENS = list(range(100, 164))


def _cache_with(keys) -> PrefixCache:
    cache = PrefixCache(CacheBudget(4096), page_tokens=16)
    filled = SessionKV(2, 1, 2, 8, 64, torch.float32, torch.device("cpu"))
    for key in keys:
        assert cache.store(key, cache.cut(filled, 0, 16, torch.randn(1, 64, 8)))
    return cache


def _summary(cache):
    return PrefixHandler.prefix_summary(SimpleNamespace(prefix_cache=cache))  # type: ignore[arg-type]


def test_the_handler_summarizes_what_its_cache_holds():
    digests = page_digests("salt", None, 0, 4, 16, TOKENS)
    other = page_digests("salt", None, 4, 8, 16, TOKENS)
    cache = _cache_with([(0, 4, d) for d in digests[:3]] + [(4, 8, other[0])])
    summary = _summary(cache)
    assert summary is not None and summary.page_tokens == 16
    assert [(r.first, r.last) for r in summary.ranges] == [(4, 8), (0, 4)]  # the most recently used first
    assert held_pages(summary, 0, 4, digests) == 3 and held_pages(summary, 4, 8, other) == 1
    cache.held([(0, 4, digests[0])])
    assert [(r.first, r.last) for r in _summary(cache).ranges] == [(0, 4), (4, 8)]
    assert _summary(_cache_with([])) is None
    assert _summary(None) is None  # (the cache is off)


def test_the_online_record_carries_it_and_a_change_is_announced():
    digests = page_digests("salt", None, 0, 4, 16, TOKENS)
    cache = _cache_with([(0, 4, digests[0])])
    record = Announcer("m", 60.0, 4, torch.float32, lambda: 1000)
    record.start, record.end = 0, 4
    assert record.info(ServerState.ONLINE).prefixes is None and not record.prefixes_changed()
    record.prefix_summary = lambda: _summary(cache)
    assert record.prefixes_changed()
    info = record.info(ServerState.ONLINE)
    assert info.prefixes == _summary(cache)
    assert record.info(ServerState.OFFLINE).prefixes is None and record.info(ServerState.JOINING).prefixes is None
    record.announced_pages = record._pages(info.prefixes)  # (what `announce` notes after storing the record)
    assert not record.prefixes_changed()
    cache.store((0, 4, digests[1]), cache.pages[(0, 4, digests[0])])
    assert record.prefixes_changed()
    record.announced_pages = record._pages(record.info(ServerState.ONLINE).prefixes)
    cache.held([(0, 4, digests[0])])  # used again: the same pages, reordered
    assert not record.prefixes_changed()
