"""Names of prompt-prefix pages, and the summary of them a server announces in its DHT record (issue 47).

A page of a server's prefix cache (`server.compute.prefix_cache`) is the KV of positions [i P, (i + 1) P) of one
session's blocks [first, last); it is named by a hash chain over the prompt's tokens (`page_digests`):
h_0 = H(version, salt, adapter, first, last, P), h_i+1 = H(h_i, token ids of page i). Servers and clients compute it
alike: a server keys its pages by it, a client computes it to read a server's summary.

`PrefixSummary` (the record's `prefixes` field, `swarm.wire.records.ServerInfo`): what a server holds, so that routing
can prefer servers that hold a session's leading prefix (`swarm.client.transport.prefix_routing`) without a round
trip. It lists, per block range [first, last) that pages are held for (at most `MAX_RANGES`), the first
`DIGEST_HEX` hex digits (4 bytes) of each held page's digest, most recently used first, at most `MAX_PAGES` pages in
all (`summarize`): about 2.5 KB at most, in the record under the span's last block only. A client counts the leading
pages of its own chain found there (`held_pages`). A wrong answer costs little: a digest prefix that matches by
chance (one in 2^32 a page), or a page evicted since the record was stored, only makes that session compute what it
expected to adopt. The digests say nothing about the tokens to whoever lacks the salt (the gateway's is per API key
by default); with a global salt, a summary tells what a probe (opening a session) would.

The summary is versioned (`v`, a digest scheme of its own: a new scheme is a new version) and strict (unknown fields,
too many entries or malformed digests are rejected); a record whose summary does not validate is read without it
(`ServerInfo`), and a record without one (an older server, or one whose prefix cache is off) holds no prefix.
"""
from __future__ import annotations

import hashlib
from functools import cached_property
from typing import Annotated, Dict, FrozenSet, Iterable, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

DIGEST_VERSION = b"swarmgate-prefix-v1"
SUMMARY_VERSION = 1
DIGEST_HEX = 8  # hex digits of a page digest a summary lists (4 bytes)
MAX_RANGES = 8  # block ranges in one summary
MAX_PAGES = 256  # pages in one summary, all ranges together
MAX_PAGE_TOKENS = 4096  # (the server's `--prefix_page_tokens` bound)

PageHex = Annotated[str, StringConstraints(pattern=f"^[0-9a-f]{{{DIGEST_HEX}}}$")]


def iter_page_digests(salt: str, adapter: Optional[str], first: int, last: int, page_tokens: int,
                      tokens: Union[Sequence[int], np.ndarray]) -> Iterator[bytes]:
    """The digests of the full pages of `tokens` (h_1 .. h_n, one per page of `page_tokens`), each computed when
    asked for (`tokens`: a list, or an int64 array)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(DIGEST_VERSION)
    for part in (salt, adapter or "", f"{first}:{last}:{page_tokens}"):
        h.update(len(part).to_bytes(4, "little") + part.encode())
    digest = h.digest()
    for i in range(len(tokens) // page_tokens):
        page = np.asarray(tokens[i * page_tokens:(i + 1) * page_tokens], dtype=np.int64)
        digest = hashlib.blake2b(digest + page.tobytes(), digest_size=16).digest()
        yield digest


def page_digests(salt: str, adapter: Optional[str], first: int, last: int, page_tokens: int,
                 tokens: Sequence[int]) -> List[bytes]:
    """The digests of the full pages of `tokens` (h_1 .. h_n, one per page of `page_tokens`)."""
    return list(iter_page_digests(salt, adapter, first, last, page_tokens, tokens))


class PrefixRange(BaseModel):
    """The held pages of sessions over blocks [first, last): their digests' first `DIGEST_HEX` hex digits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    first: int = Field(ge=0, le=1 << 16)
    last: int = Field(gt=0, le=1 << 16)
    pages: Tuple[PageHex, ...] = Field(min_length=1, max_length=MAX_PAGES)

    @model_validator(mode="after")
    def _ordered(self) -> "PrefixRange":
        if self.last <= self.first:
            raise ValueError(f"empty block range [{self.first}, {self.last})")
        return self


class PrefixSummary(BaseModel):
    """What a server's prefix cache holds, as its DHT record announces it (see the module doc)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = 1  # SUMMARY_VERSION
    page_tokens: int = Field(gt=0, le=MAX_PAGE_TOKENS)
    ranges: Tuple[PrefixRange, ...] = Field(max_length=MAX_RANGES)

    @model_validator(mode="after")
    def _bounded(self) -> "PrefixSummary":
        if sum(len(r.pages) for r in self.ranges) > MAX_PAGES:
            raise ValueError(f"a prefix summary lists at most {MAX_PAGES} pages")
        if len({(r.first, r.last) for r in self.ranges}) != len(self.ranges):
            raise ValueError("a prefix summary lists each block range once")
        return self

    @cached_property
    def _by_range(self) -> Dict[Tuple[int, int], FrozenSet[str]]:
        return {(held.first, held.last): frozenset(held.pages) for held in self.ranges}

    def pages_for(self, first: int, last: int) -> Optional[FrozenSet[str]]:
        """The page digests (hex prefixes) held for sessions over blocks [first, last) (None: no such range)."""
        return self._by_range.get((first, last))


def summarize(keys: Iterable[Tuple[int, int, bytes]], page_tokens: int) -> Optional[PrefixSummary]:
    """The summary of held pages `keys` ((first, last, digest), most recently used first): the first `MAX_RANGES`
    block ranges met and the first `MAX_PAGES` pages of those (None: no page)."""
    ranges: Dict[Tuple[int, int], List[str]] = {}
    count = 0
    for first, last, digest in keys:
        if count >= MAX_PAGES:
            break
        pages = ranges.get((first, last))
        if pages is None:
            if len(ranges) >= MAX_RANGES:
                continue
            pages = ranges[(first, last)] = []
        pages.append(digest.hex()[:DIGEST_HEX])
        count += 1
    if not ranges:
        return None
    return PrefixSummary(page_tokens=page_tokens,
                         ranges=tuple(PrefixRange(first=f, last=t, pages=tuple(p)) for (f, t), p in ranges.items()))


def held_pages(summary: Optional[PrefixSummary], first: int, last: int, digests: Iterable[bytes]) -> int:
    """How many leading pages of `digests` (a prompt's page digests for blocks [first, last) and the summary's
    `page_tokens`; read only up to the first page not held) `summary` says are held."""
    pages = summary.pages_for(first, last) if summary is not None else None
    if not pages:
        return 0
    count = 0
    for digest in digests:
        if digest.hex()[:DIGEST_HEX] not in pages:
            break
        count += 1
    return count
