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


STALE = "records-stale"


def test_a_store_that_missed_some_keys_reads_as_the_newest_announcement():
    """A server announced JOINING on every key of its span, then ONLINE, but the second store reached only some keys
    (it timed out on the others on a loaded machine): the newest announcement (latest expiration) counts on every
    key of its span, so the span is not split; and a span that moved drops the older record's other blocks."""
    node = hivemind.DHT(start=True)
    try:
        mover, steady = Server(node, "mover"), Server(node, "steady")
        now = get_dht_time()
        joining = ServerInfo(state=ServerState.JOINING, start=0, end=6, throughput=1.0, cache_tokens_left=10)
        declare_blocks(steady, STALE, range(0, 6), joining, now + 600)
        declare_blocks(steady, STALE, range(0, 3), joining.model_copy(update={"state": ServerState.ONLINE}),
                       now + 700)  # (keys 3..5 still hold JOINING)
        records = fetch_block_records(node, STALE, NUM_BLOCKS)
        assert [servers[steady.peer_id.to_base58()].state for servers in records] == [ServerState.ONLINE] * 6
        assert _spans(records) == [(0, 6)]

        declare_blocks(mover, PARTIAL + "-moved", range(0, 6), joining.model_copy(
            update={"state": ServerState.ONLINE}), now + 600)
        declare_blocks(mover, PARTIAL + "-moved", range(3, 6), joining.model_copy(
            update={"state": ServerState.ONLINE, "start": 3}), now + 700)  # it moved to 3:6; keys 0..2 hold 0:6
        moved = fetch_block_records(node, PARTIAL + "-moved", NUM_BLOCKS)
        assert [sorted(servers) for servers in moved] == [[]] * 3 + [[mover.peer_id.to_base58()]] * 3
        assert _spans(moved) == [(3, 6)]
    finally:
        node.shutdown()
