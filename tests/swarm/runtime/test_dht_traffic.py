"""The DHT traffic counters (`swarm.runtime.dht_traffic`) and the routing time observer (`SwarmManager.on_route`,
`swarmgate_route_seconds`): the counter's arithmetic on real protobuf messages, and real DHT peers counting what
they send and serve; what keeps a read of the records small (`swarm.wire.records`); `rpc_dht_traffic`'s reply."""
from __future__ import annotations

import time
from functools import partial

import pytest
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from gateway.metrics import Metrics
from swarm.client.transport.manager import RouteTiming
from swarm.runtime.dht_process import DHTProcess
from swarm.runtime.dht_traffic import DHTTraffic, TrafficCounter, read_dht_traffic
from swarm.runtime.swarm_key import join_dht
from swarm.wire import protocol as P
from swarm.wire.records import (
    ServerInfo,
    ServerState,
    _get_records,
    block_key,
    declare_blocks,
    fetch_block_records,
    fetch_spans_at,
    online_spans,
)


def test_counter_counts_requests_and_responses_by_direction():
    counter = TrafficCounter()
    request = dht_pb2.FindRequest(keys=[b"k" * 20, b"q" * 20])
    response = dht_pb2.FindResponse(results=[dht_pb2.FindResult(value=b"v" * 100)])
    counter.count("find", served=False, request=request, response=response)  # a call made
    counter.count("store", served=True, request=dht_pb2.StoreRequest(keys=[b"s"]), response=None)  # served, refused
    traffic = counter.snapshot()
    assert traffic.sent_bytes == request.ByteSize() and traffic.sent_messages == 1
    assert traffic.received_bytes == response.ByteSize() + dht_pb2.StoreRequest(keys=[b"s"]).ByteSize()
    assert traffic.received_messages == 2
    assert traffic.calls_made == {"find": 1} and traffic.calls_served == {"store": 1}
    assert DHTTraffic.model_validate(traffic.model_dump()) == traffic


def test_real_dht_peers_count_the_calls_they_make_and_serve(bootstrap):
    first = DHTProcess(initial_peers=[bootstrap.maddr], start=True)
    second = DHTProcess(initial_peers=[*map(str, first.get_visible_maddrs())], client_mode=True, start=True)
    try:
        before = read_dht_traffic(second)
        value = "x" * 1000
        assert second.store("traffic-test", value, expiration_time=time.time() + 60)
        assert second.get("traffic-test", latest=True).value == value
        after, served = read_dht_traffic(second), read_dht_traffic(first)
        assert after.calls_made.get("store", 0) > before.calls_made.get("store", 0)
        assert after.calls_made.get("find", 0) > before.calls_made.get("find", 0)
        assert after.sent_bytes - before.sent_bytes > len(value)  # the stored value went out
        assert after.received_bytes - before.received_bytes > len(value)  # and came back on the get
        assert after.sent_messages > before.sent_messages and after.received_messages > before.received_messages
        assert not after.calls_served  # a client-mode peer serves nobody
        assert served.calls_served.get("store", 0) >= 1 and served.received_bytes > len(value)
    finally:
        second.shutdown()
        first.shutdown()


def test_route_seconds_histogram_renders_each_part():
    metrics = Metrics()
    metrics.observe_route(RouteTiming(view_s=0.004, search_s=0.0002))
    metrics.observe_route(RouteTiming(view_s=0.0, search_s=0.0003))
    text = metrics.render().decode()
    assert 'swarmgate_route_seconds_count{part="total"} 2.0' in text
    assert 'swarmgate_route_seconds_sum{part="view"} 0.004' in text
    assert 'swarmgate_route_seconds_bucket{le="0.0003",part="search"} 2.0' in text


async def _cached_values(_dht, node) -> int:
    return len(node.protocol.cache)


def test_records_read_lean(bootstrap):
    """A server's RTTs to its next servers go only under its span's last block (routing still sees them), a check
    of one block reads one key, and our DHT peers keep no cache of what they read."""
    server = join_dht(None, initial_peers=[bootstrap.maddr])  # a full peer, as a server's
    reader = join_dht(None, initial_peers=[bootstrap.maddr], client_mode=True)
    try:
        me = server.peer_id.to_base58()
        info = ServerInfo(state=ServerState.ONLINE, start=2, end=5, next_pings={"next-server": 0.012})
        # stores reach the keys' nodes asynchronously, and on a loaded machine one may time out: wait until all three
        # are read, storing them again now and then (a readiness wait: nothing here is timed). What was stored under
        # each key is read raw: `fetch_block_records` fills a key that a read timed out on from the span's other
        # keys (`_fill_unread`), which is not what that key holds
        keys = [block_key("lean-read", b) for b in (2, 3, 4)]
        for attempt in range(240):
            if attempt % 20 == 0:
                declare_blocks(server, "lean-read", range(2, 5), info, get_dht_time() + 120)
            found = reader.run_coroutine(partial(_get_records, keys=keys))
            if all(isinstance(getattr(found.get(k), "value", None), dict) and me in found[k].value for k in keys):
                break
            time.sleep(0.5)
        assert [found[k].value[me].value["next_pings"] for k in keys] == [{}, {}, {"next-server": 0.012}]
        for _ in range(20):  # routing sees the pings (a read that timed out on the last key: read again)
            [span] = online_spans(fetch_block_records(reader, "lean-read", 6))
            if span.info.next_pings:
                break
            time.sleep(0.5)
        assert (span.peer_id, span.start, span.end, span.info.next_pings) == (me, 2, 5, {"next-server": 0.012})
        for _ in range(20):  # (one key's read may reach a node its store has not reached yet: read it again)
            before = read_dht_traffic(reader)
            at = fetch_spans_at(reader, "lean-read", 6, 3)
            one = read_dht_traffic(reader)
            if at:
                break
            time.sleep(0.5)
        fetch_block_records(reader, "lean-read", 6)
        full = read_dht_traffic(reader)
        assert [(s.peer_id, s.start, s.end) for s in at] == [(me, 2, 5)]
        assert one.received_bytes - before.received_bytes < (full.received_bytes - one.received_bytes) / 2
        assert reader.run_coroutine(_cached_values) == 0 and server.run_coroutine(_cached_values) == 0
    finally:
        reader.shutdown()
        server.shutdown()


def test_dht_traffic_report_is_its_own_versioned_message():
    traffic = DHTTraffic(sent_messages=3, sent_bytes=300, calls_made={"store": 2})
    report = P.decode(P.encode(P.DHTTrafficReport(traffic=traffic)), P.DHTTrafficReport)
    assert report.traffic == traffic
    assert P.decode(P.encode(P.DHTTrafficReport()), P.DHTTrafficReport).traffic is None
    with pytest.raises(P.ProtocolError, match="dht_traffic"):  # a field ServerStats' readers do not know
        P.decode(b'{"v": 1, "type": "info", "version": "x", "model": "m", "start": 0, "end": 1, '
                 b'"num_blocks_total": 1, "dtype": "float32", "hidden_size": 8, "cache_tokens_total": 1, '
                 b'"cache_tokens_used": 0, "sessions_open": 0, "inference_tokens_processed": 0, '
                 b'"inference_steps": 0, "forward_tokens_processed": 0, "dht_traffic": {}}', P.ServerStats)
