"""Tests for swarm.client.transport.prefix_routing on synthetic swarms (no network): routing prefers the servers whose
records announce a session's leading prompt pages when that is not slower, never a much slower one, never for pages
of another salt or adapter, and reads records without a summary as holding nothing. (The real-process side:
tests/e2e/test_prefix_routing.py.)"""
from __future__ import annotations

from typing import Optional, Sequence

import pytest

from swarm.client.transport.prefix_routing import PrefixCosts, find_prefix_chain
from swarm.client.transport.routing import RoutingError, chain_cost, find_inference_chain
from swarm.wire import protocol as P
from swarm.wire.prefix_pages import page_digests, summarize
from swarm.wire.records import ServerInfo, ServerSpan, ServerState
from tests.fixtures.synthetic_swarm import fake_manager, make_span

PAGE = 16
PROMPT = list(range(1000, 1000 + 4 * PAGE + 5))  # four full pages and a tail
SALT = "tenant-a"


def holder(peer: str, start: int, end: int, *, tokens: Sequence[int] = PROMPT, salt: str = SALT,
           adapter: Optional[str] = None, first: Optional[int] = None, last: Optional[int] = None,
           pages: Optional[int] = None, throughput: float = 1.0, adapters: Sequence[str] = (),
           **info) -> ServerSpan:
    """A server over [start, end) whose record announces the leading `pages` pages (all: None) of `tokens` for sessions
    over blocks [first, last) (default: its span)."""
    first = start if first is None else first
    last = end if last is None else last
    digests = page_digests(salt, adapter, first, last, PAGE, tokens)[:pages]
    record = ServerInfo(state=ServerState.ONLINE, start=start, end=end, throughput=throughput,
                        cache_tokens_left=100_000, adapters=tuple(adapters),
                        prefixes=summarize([(first, last, d) for d in digests], PAGE), **info)
    return ServerSpan(peer, start, end, record)


def decl(tokens: Sequence[int] = PROMPT, salt: str = SALT) -> P.PrefixDecl:
    return P.PrefixDecl(salt=salt, tokens=list(tokens))


def route(spans, start=0, end=30, session_length=len(PROMPT) + 32, **kwargs):
    return [(h.peer_id, h.start, h.end) for h in find_prefix_chain(spans, start, end, session_length=session_length,
                                                                   **kwargs)]


def test_prefers_a_holder_when_equal():
    # "a" wins every tie without prefixes (peer id order); "b" holds the prompt
    spans = [make_span("a", 0, 30), holder("b", 0, 30)]
    assert route(spans) == [("a", 0, 30)]
    assert route(spans, prefix=decl()) == [("b", 0, 30)]
    assert route(spans, prefix=decl(salt="tenant-b")) == [("a", 0, 30)]  # another tenant's pages: no holder
    # the holder of more pages wins among holders
    spans = [holder("a", 0, 30, pages=1), holder("b", 0, 30, pages=3), holder("c", 0, 30, pages=2)]
    assert route(spans, prefix=decl()) == [("b", 0, 30)]


def test_a_split_chain_of_holders_and_the_least_of_its_hops():
    spans = [make_span("a", 0, 30), holder("x", 0, 15), holder("y", 15, 30, pages=2), make_span("z", 15, 30)]
    # a one-hop chain is faster than two hops: x + y save 2 pages (the least of theirs) of prefill over 32 steps
    fast = route(spans)
    assert fast == [("a", 0, 30)]
    assert route(spans, prefix=decl(), session_length=len(PROMPT) + 1) == [("x", 0, 15), ("y", 15, 30)]
    # when the session decodes long enough the extra hop per step costs more than the prefill saved
    assert route(spans, prefix=decl(), session_length=len(PROMPT) + 10_000) == fast


def test_does_not_pick_a_much_slower_holder():
    spans = [make_span("a", 0, 30, throughput=10.0), holder("b", 0, 30, throughput=2.0)]
    assert route(spans, prefix=decl()) == [("a", 0, 30)]
    # ... even for a one-step session whose saved prefill outweighs it: never past prefix_max_slowdown per step
    assert route(spans, prefix=decl(), session_length=len(PROMPT) + 1) == [("a", 0, 30)]
    lenient = PrefixCosts(prefix_max_slowdown=10.0)
    assert route(spans, prefix=decl(), session_length=len(PROMPT) + 1, prefix_costs=lenient) == [("b", 0, 30)]
    # a slightly slower holder is taken while the prefill it saves outweighs its extra decode time
    spans = [make_span("a", 0, 30, throughput=10.0), holder("b", 0, 30, throughput=9.5)]
    assert chain_cost(find_inference_chain(spans[1:], 0, 30), spans) > chain_cost(find_inference_chain(spans, 0, 30),
                                                                                    spans)
    assert route(spans, prefix=decl(), session_length=len(PROMPT) + 8) == [("b", 0, 30)]
    assert route(spans, prefix=decl(), session_length=len(PROMPT) + 5_000) == [("a", 0, 30)]


def test_ignores_other_salts_adapters_and_ranges():
    spans = [make_span("a", 0, 30), holder("b", 0, 30, salt="tenant-b"), holder("c", 0, 30, adapter="lora"),
             holder("d", 0, 30, first=0, last=20)]  # pages of sessions over blocks 0:20 only
    assert route(spans, prefix=decl()) == [("a", 0, 30)]
    # a session over 0:20 adopts "d"'s pages
    assert route(spans, end=20, prefix=decl()) == [("d", 0, 20)]
    # the adapter's session holds "c"'s pages (only servers holding the adapter are routed to)
    spans = [make_span("a", 0, 30), holder("c", 0, 30, adapter="lora", adapters=["lora"]),
             holder("e", 0, 30, adapters=["lora"])]
    spans[0] = ServerSpan("a", 0, 30, spans[0].info.model_copy(update={"adapters": ("lora",)}))
    assert route(spans, prefix=decl(), adapter="lora") == [("c", 0, 30)]
    assert route(spans, prefix=decl()) == [("e", 0, 30)]  # no adapter: the pages of no adapter


def test_tolerates_records_without_the_field_and_prompts_too_short():
    spans = [make_span("a", 0, 30), make_span("b", 0, 30)]
    assert route(spans, prefix=decl()) == route(spans) == [("a", 0, 30)]
    spans = [make_span("a", 0, 30), holder("b", 0, 30)]
    assert route(spans, prefix=decl(PROMPT[:PAGE - 1])) == [("a", 0, 30)]  # not one full page
    assert route(spans, prefix=decl([]), session_length=8) == [("a", 0, 30)]
    # a full page of a one-page prompt: all but its last token adopted
    assert route(spans, prefix=decl(PROMPT[:PAGE])) == [("b", 0, 30)]


def test_banned_and_uncovered_holders_are_not_used():
    spans = [make_span("a", 0, 30), holder("b", 0, 30)]
    assert route(spans, prefix=decl(), banned=["b"]) == [("a", 0, 30)]
    with pytest.raises(RoutingError):
        route([holder("b", 0, 20)], prefix=decl())  # blocks 20:30 uncovered, as without a prefix


def test_the_manager_routes_a_declared_prompt_to_its_holders():
    manager = fake_manager([make_span("a", 0, 30), holder("b", 0, 30)], None)
    timings = []
    manager.on_route = timings.append
    assert [h.peer_id for h in manager.make_inference_chain(session_length=len(PROMPT) + 32)] == ["a"]
    assert [h.peer_id for h in manager.make_inference_chain(session_length=len(PROMPT) + 32,
                                                            prefix=decl())] == ["b"]
    assert len(timings) == 2  # routes with a prefix are timed too
