"""Tests for swarm.wire.prefix_pages: the pages' digests, the summary a server announces in its record (bounded,
versioned, strict) and reading it back; the record field `ServerInfo.prefixes` (a summary this release does not read
is dropped, the record still counts; only the span's last block's record carries it)."""
from __future__ import annotations

import hashlib

import pytest
import torch
from hivemind.utils.serializer import MSGPackSerializer
from pydantic import ValidationError

from server.compute.prefix_cache import page_digests as server_page_digests
from swarm.wire.prefix_pages import (
    DIGEST_HEX,
    DIGEST_VERSION,
    MAX_PAGES,
    MAX_RANGES,
    PrefixSummary,
    held_pages,
    page_digests,
    summarize,
)
from swarm.wire.records import ServerInfo, record_values

TOKENS = list(range(100, 164))  # four pages of 16


def _torch_digests(salt, adapter, first, last, size, tokens):
    """The chain as the server computed it before it moved here (torch's int64 bytes)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(DIGEST_VERSION)
    for part in (salt, adapter or "", f"{first}:{last}:{size}"):
        h.update(len(part).to_bytes(4, "little") + part.encode())
    digest, out = h.digest(), []
    for i in range(len(tokens) // size):
        page = torch.tensor(tokens[i * size:(i + 1) * size], dtype=torch.int64)
        digest = hashlib.blake2b(digest + page.numpy().tobytes(), digest_size=16).digest()
        out.append(digest)
    return out


def test_digests_are_the_servers_and_unchanged():
    assert server_page_digests is page_digests  # one definition for servers and clients
    assert page_digests("s", "lora", 0, 4, 16, TOKENS) == _torch_digests("s", "lora", 0, 4, 16, TOKENS)
    assert len(page_digests("s", None, 0, 4, 16, TOKENS[:47])) == 2  # full pages only


def _keys(first, last, digests):
    return [(first, last, d) for d in digests]


def test_summary_lists_held_pages_and_a_client_counts_its_leading_ones():
    mine = page_digests("salt", None, 0, 4, 16, TOKENS)
    summary = summarize(_keys(0, 4, mine[:3]), 16)
    assert summary is not None and summary.page_tokens == 16
    assert summary.ranges[0].pages == tuple(d.hex()[:DIGEST_HEX] for d in mine[:3])
    assert held_pages(summary, 0, 4, mine) == 3
    # a chain that differs from page 2 on holds one page; other ranges, salts and adapters hold none
    other = TOKENS[:16] + [7] * 48
    assert held_pages(summary, 0, 4, page_digests("salt", None, 0, 4, 16, other)) == 1
    assert held_pages(summary, 0, 3, page_digests("salt", None, 0, 3, 16, TOKENS)) == 0
    assert held_pages(summary, 0, 4, page_digests("pepper", None, 0, 4, 16, TOKENS)) == 0
    assert held_pages(summary, 0, 4, page_digests("salt", "lora", 0, 4, 16, TOKENS)) == 0
    assert held_pages(None, 0, 4, mine) == 0
    # a hole in the chain (page 1 evicted) holds nothing past it
    assert held_pages(summarize(_keys(0, 4, [mine[0], mine[2]]), 16), 0, 4, mine) == 1
    assert summarize([], 16) is None


def test_summary_is_bounded_to_the_most_recently_used():
    many = [(r, r + 1, hashlib.blake2b(f"{r}-{i}".encode(), digest_size=16).digest())
            for r in range(MAX_RANGES + 4) for i in range(40)]
    summary = summarize(many, 64)
    assert summary is not None
    assert len(summary.ranges) <= MAX_RANGES and sum(len(r.pages) for r in summary.ranges) == MAX_PAGES
    assert summary.ranges[0].pages[0] == many[0][2].hex()[:DIGEST_HEX]  # the most recently used first
    encoded = ServerInfo(state="online", start=0, end=4, prefixes=summary).model_dump(mode="json")
    assert len(MSGPackSerializer.dumps(encoded["prefixes"])) <= 2600  # bytes in the DHT's encoding, at most
    assert ServerInfo.model_validate(encoded).prefixes == summary


@pytest.mark.parametrize("bad", [
    {"v": 2, "page_tokens": 16, "ranges": []},  # a newer summary
    {"v": 1, "page_tokens": 16, "ranges": [], "bloom": "00"},  # a field this release does not know
    {"v": 1, "page_tokens": 16, "ranges": [{"first": 0, "last": 4, "pages": ["not-hex!"]}]},
    {"v": 1, "page_tokens": 16, "ranges": [{"first": 4, "last": 4, "pages": ["00112233"]}]},
    {"v": 1, "page_tokens": 0, "ranges": []},
    {"v": 1, "page_tokens": 16, "ranges": [{"first": 0, "last": 4, "pages": ["00112233"] * (MAX_PAGES + 1)}]},
    {"v": 1, "page_tokens": 16, "ranges": [{"first": i, "last": i + 1, "pages": ["00112233"] * 40}
                                           for i in range(MAX_RANGES)]},  # too many pages in all
    {"v": 1, "page_tokens": 16, "ranges": [{"first": 0, "last": 4, "pages": ["00112233"]}] * 2},
    "a string",
])
def test_a_summary_this_release_does_not_read_is_dropped_and_the_record_kept(bad):
    with pytest.raises(ValidationError):
        PrefixSummary.model_validate(bad)
    info = ServerInfo.model_validate({"state": "online", "start": 0, "end": 4, "throughput": 3.0, "prefixes": bad})
    assert info.prefixes is None and info.throughput == 3.0


def test_records_without_the_field_parse_and_only_the_last_block_carries_it():
    assert ServerInfo.model_validate({"state": "online", "start": 0, "end": 4}).prefixes is None
    summary = summarize(_keys(0, 4, page_digests("s", None, 0, 4, 16, TOKENS)), 16)
    info = ServerInfo(state="online", start=0, end=4, prefixes=summary, next_pings={"x": 0.1})
    values = record_values(info, range(4))
    assert [v["prefixes"] is not None for v in values] == [False, False, False, True]
    assert ServerInfo.model_validate(values[3]).prefixes == summary
