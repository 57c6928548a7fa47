"""The DHT traffic counters (`swarm.runtime.dht_traffic`) and the routing time observer (`SwarmManager.on_route`,
`swarmgate_route_seconds`): the counter's arithmetic on real protobuf messages, and real DHT peers counting what
they send and serve."""
from __future__ import annotations

import time

from hivemind.proto import dht_pb2

from gateway.metrics import Metrics
from swarm.client.manager import RouteTiming
from swarm.runtime.dht_process import DHTProcess
from swarm.runtime.dht_traffic import DHTTraffic, TrafficCounter, read_dht_traffic


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
