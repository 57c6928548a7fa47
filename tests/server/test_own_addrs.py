"""A server whose own addresses come late (issue 52) keeps starting and serves: on loopback, a real server process
(`tests.fixtures.late_addrs_server`) whose first asks for its visible addresses raise hivemind's `No multiaddrs
found for peer <own id>` (what p2pd answers while a relayed peer's reservation is not in place) and whose first
record stores fail the same way. The server waits (one line), retries its placing with back-off (one line), prints
its readiness line with its addresses, and its record is in the DHT, online. Before the fix it exited 1 with
"server failed: No multiaddrs found for peer ...". The relayed case itself, in network namespaces, is
tests/e2e/test_nat.py (extended)."""
from __future__ import annotations

import time

import hivemind

from launch.topology import start_server
from swarm.wire.records import ServerState, fetch_block_records
from tests.fixtures.late_addrs_server import INJECTED, INJECTED_STORE

PREFIX = "tlateaddrs"
NO_ADDRS_FOR = 3  # asks for the server's own addresses that fail, on each p2pd handle
FAIL_ANNOUNCES = 2  # stores of its record that fail


def test_a_server_whose_addresses_come_late_waits_and_serves(model_path, bootstrap):
    proc = start_server(model_path, [bootstrap.maddr], "0:2", PREFIX,
                        ["--throughput", "1", "--update_period", "10", "--no_addrs_for", str(NO_ADDRS_FOR),
                         "--fail_announces", str(FAIL_ANNOUNCES)],
                        name="late-addrs", threads=1, module="tests.fixtures.late_addrs_server")
    reader = None
    try:
        ready = proc.wait_ready(180)
        log = proc.log_path.read_text(errors="replace")
        # it went through the failures (its p2pd handle answered NO_ADDRS_FOR asks with "No multiaddrs").
        assert log.count(INJECTED) >= NO_ADDRS_FOR and log.count(INJECTED_STORE) == FAIL_ANNOUNCES, log
        # ...with one line each, and it never gave up nor restarted its serving loop
        assert log.count("no address to announce yet") == 1, log
        assert log.count("placing this server's blocks failed") == 1, log
        assert "server failed" not in log and "serving loop died" not in log, log
        assert ready["maddrs"] and all(m.endswith(f"/p2p/{proc.peer_id}") for m in ready["maddrs"]), ready
        assert ready["reachable"] == "direct"
        # its record is in the DHT, online, under both blocks
        reader = hivemind.DHT(initial_peers=[bootstrap.maddr], client_mode=True, start=True)
        deadline = time.monotonic() + 60
        while True:
            records = fetch_block_records(reader, PREFIX, 30, blocks=[0, 1])
            states = [records[i].get(proc.peer_id) for i in (0, 1)]
            if all(info is not None and info.state == ServerState.ONLINE for info in states):
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.5)
        assert proc.proc.poll() is None  # still serving
    finally:
        if reader is not None:
            reader.shutdown()
        proc.kill()
