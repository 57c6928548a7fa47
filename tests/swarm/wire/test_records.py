"""Reading the swarm's records back from a real (one-node, in-process) DHT: keys that a read did not get at all
(a read that timed out on some keys of its batch, on a loaded machine) against keys read that lack a server."""
from __future__ import annotations

import hashlib

import hivemind
import pytest
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarm.wire.records import ServerInfo, ServerState, block_key, declare_blocks, fetch_block_records, online_spans

PREFIX, PARTIAL, NUM_BLOCKS = "records-test", "records-partial", 6


class Server:
    """What `declare_blocks` needs of a DHT, with a peer id of its own: several servers' records from one node."""

    def __init__(self, dht: hivemind.DHT, name: str):
        self.dht = dht
        self.peer_id = PeerID(b"\x12\x20" + hashlib.sha256(name.encode()).digest())  # a sha2-256 multihash

    def run_coroutine(self, coro, return_future=False):
        return self.dht.run_coroutine(coro, return_future=return_future)


class LossyReads:
    """The real DHT, except that the blocks in `lost` are missing from every read's reply."""

    def __init__(self, dht: hivemind.DHT, lost, prefix: str = PREFIX):
        self.dht, self.lost = dht, {block_key(prefix, i) for i in lost}

    def run_coroutine(self, coro):
        return {key: value for key, value in self.dht.run_coroutine(coro).items() if key not in self.lost}


def _declare(dht, name: str, prefix: str, span: tuple, blocks=None) -> None:
    info = ServerInfo(state=ServerState.ONLINE, start=span[0], end=span[1], throughput=1.0, cache_tokens_left=10)
    declare_blocks(Server(dht, name), prefix, range(*span) if blocks is None else blocks, info,
                   get_dht_time() + 600)


@pytest.fixture(scope="module")
def dht():
    node = hivemind.DHT(start=True)
    _declare(node, "a", PREFIX, (0, 3))
    _declare(node, "b", PREFIX, (3, 6))
    # a span announced as 0:6 whose record only keys 0..2 hold; keys 3..5 hold another server's
    _declare(node, "c", PARTIAL, (0, 6), blocks=range(3))
    _declare(node, "d", PARTIAL, (3, 6))
    yield node
    node.shutdown()


def _spans(records):
    return [(s.start, s.end) for s in online_spans(records)]


def test_every_key_read_gives_every_span(dht):
    assert _spans(fetch_block_records(dht, PREFIX, NUM_BLOCKS)) == [(0, 3), (3, 6)]


@pytest.mark.parametrize("lost", [[0], [1], [0, 4], [2, 3], [0, 1, 5]])
def test_keys_not_read_are_filled_from_the_spans_other_keys(dht, lost):
    records = fetch_block_records(LossyReads(dht, lost), PREFIX, NUM_BLOCKS)
    assert _spans(records) == [(0, 3), (3, 6)]
    assert [len(servers) for servers in records] == [1] * NUM_BLOCKS


def test_a_span_with_no_key_read_stays_unknown(dht):
    records = fetch_block_records(LossyReads(dht, [0, 1, 2]), PREFIX, NUM_BLOCKS)
    assert _spans(records) == [(3, 6)] and records[:3] == [{}, {}, {}]
    assert fetch_block_records(LossyReads(dht, range(NUM_BLOCKS)), PREFIX, NUM_BLOCKS) == [{}] * NUM_BLOCKS


def test_a_key_read_keeps_what_it_holds(dht):
    c, d = (Server(dht, name).peer_id.to_base58() for name in "cd")
    """Keys 3..5 were read and hold server d's record, not c's: c is not added there (a key that holds nothing at
    all reads as no entry, the same as a key not read, and is filled)."""
    for lost in ([], [1]):
        records = fetch_block_records(LossyReads(dht, lost, PARTIAL), PARTIAL, NUM_BLOCKS)
        assert _spans(records) == [(0, 3), (3, 6)], lost
        assert [sorted(servers) for servers in records] == [[c]] * 3 + [[d]] * 3, lost
