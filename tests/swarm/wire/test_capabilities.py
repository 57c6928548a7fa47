"""Releases that mix (issue 45): what a record says about a server's release, protocol and capabilities, how the
previous release reads this release's records (and the other way), and what routing and a client do with it."""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from swarm.client.transport.manager import needs_for
from swarm.client.transport.routing import RouteHop, RoutingError, choose_training_chain, find_inference_chain
from swarm.client.transport.span_stream import SpanStream
from swarm.wire import capabilities as C
from swarm.wire.records import ServerInfo, ServerSpan, ServerState

REPO = Path(__file__).resolve().parents[3]
PREVIOUS = (REPO / "compat" / "previous_release").read_text().strip()


def _previous_records() -> types.ModuleType:
    """The previous release's `swarm/wire/records.py`, read from git (its imports are the same libraries)."""
    try:
        source = subprocess.run(["git", "-C", str(REPO), "show", f"{PREVIOUS}:swarm/wire/records.py"],
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"the previous release's tree is not in this checkout's git history: {e}")
    spec = importlib.util.spec_from_loader("previous_records", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["previous_records"] = module  # pydantic resolves the module's annotations through it
    exec(compile(source, "previous_records.py", "exec"), module.__dict__)
    return module


def _info(**kwargs) -> ServerInfo:
    return ServerInfo(**{"state": ServerState.ONLINE, "start": 0, "end": 30, **kwargs})


def test_a_record_carries_release_protocol_and_capabilities_and_the_previous_release_reads_it():
    old = _previous_records()
    new = _info(version=C.release(), protocol=C.PROTOCOL_VERSION, min_protocol=C.MIN_PROTOCOL_VERSION,
                capabilities=C.OWN_CAPABILITIES, adapters=("x",))
    data = new.model_dump(mode="json")
    assert data["version"] == C.release() and data["capabilities"] == list(C.OWN_CAPABILITIES)
    seen_by_old = old.ServerInfo.model_validate(data)  # the previous release ignores the fields it does not know
    assert (seen_by_old.state.value, seen_by_old.start, seen_by_old.end, seen_by_old.adapters) == ("online", 0, 30,
                                                                                                   ("x",))
    # and this release reads a previous-release record as a first-release server with the first release's features
    previous = old.ServerInfo(state=old.ServerState.ONLINE, start=0, end=15, version="0.1.0").model_dump(mode="json")
    seen_by_new = ServerInfo.model_validate(previous)
    assert seen_by_new.capabilities is None and seen_by_new.capability_set == C.FIRST_RELEASE_CAPABILITIES
    assert seen_by_new.problem() is None and (seen_by_new.min_protocol, seen_by_new.protocol) == (1, 1)


def test_the_release_is_pyprojects_version():
    import tomllib

    assert C.release() == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    out = subprocess.run([sys.executable, "-m", "launch.cli", "--version"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(f"swarmgate {C.release()} "), out


@pytest.mark.parametrize("fields, why", [
    ({"version": "not a release!"}, "malformed release"),
    ({"version": "9.0.0", "min_protocol": C.PROTOCOL_VERSION + 1, "protocol": C.PROTOCOL_VERSION + 2},
     "future protocol"),
    ({"min_protocol": 3, "protocol": 2}, "empty range"),
])
def test_unknown_records_say_why(fields, why):
    assert why in (_info(**fields).problem() or "")


def test_unknown_capability_names_are_ignored_and_malformed_ones_reject_the_record():
    info = _info(version="0.3.0", capabilities=("push", "teleport"))
    assert info.problem() is None and info.capability_set == frozenset({"push"})
    assert C.unknown_capabilities(info.capabilities) == ("teleport",)
    with pytest.raises(ValueError):
        _info(capabilities=("Not A Name",))
    with pytest.raises(ValueError):
        _info(capabilities="push")  # not a list


def test_routing_keeps_to_servers_with_what_a_request_needs_and_says_what_is_missing():
    old_style = ServerSpan("a", 0, 30, _info(version="0.1.0", adapters=("x",)))  # a first-release record
    lacking = ServerSpan("b", 0, 30, _info(version="0.2.0", capabilities=("adapters", "training"), adapters=("x",)))
    # a first-release server trains through adapters; the one that does not announce it is avoided
    for _ in range(10):
        assert [h.peer_id for h in choose_training_chain([old_style, lacking], 0, 30,
                                                         adapter="x", needs=needs_for("x", training=True))] == ["a"]
    with pytest.raises(RoutingError) as error:
        choose_training_chain([lacking], 0, 30, adapter="x", needs=needs_for("x", training=True))
    assert "lack train_adapters" in str(error.value) and "0.2.0" in str(error.value)
    # inference with the adapter is fine on both; each hop carries its server's capabilities
    [hop] = find_inference_chain([lacking], 0, 30, adapter="x", needs=needs_for("x"))
    assert hop.capabilities == frozenset({"adapters", "training"})


@pytest.mark.parametrize("announced, sent", [(C.OWN_CAPABILITIES, "float16"), (("push",), None), (None, "float16")])
def test_a_client_sends_compression_only_to_a_server_that_announces_it(announced, sent):
    info = _info(capabilities=announced)
    hop = RouteHop("a", 0, 30, capabilities=info.capability_set)
    manager = SimpleNamespace(config=SimpleNamespace(compression="float16"))
    stream = SpanStream(manager, hop, "s", max_length=8, batch_size=1)  # type: ignore[arg-type]
    assert stream.compression == sent
    stream.send(torch.zeros(1, 1, 4), 0, 0)
    request = stream._queue.get_nowait()
    assert (request.tensors[0].compression != 0) == (sent is not None)  # raw tensors for a server without it


def test_a_server_logs_a_newer_release_once(caplog):
    from server.placement.announce import Announcer

    announcer = Announcer("p", 60, 30, torch.float32, lambda: 0)
    same = ServerSpan("a", 0, 30, _info(version=C.release()))
    newer = ServerSpan("b", 0, 30, _info(version="99.0.0"))
    garbage = ServerSpan("c", 0, 30, _info(version=""))
    assert announcer.note_newer_releases([same, garbage]) is None
    with caplog.at_level(logging.WARNING, logger="swarmgate.server"):
        line = announcer.note_newer_releases([same, newer, garbage])
        assert line is not None and "99.0.0" in line
        assert announcer.note_newer_releases([newer]) is None
    assert sum("newer release" in r.getMessage() for r in caplog.records) == 1


def test_unknown_records_are_skipped_with_one_log_line_per_peer(caplog):
    """Records stored in a real DHT: a malformed release, a future protocol and a record that does not parse are
    skipped by every read, each logged once; a first-release record and a current one are read."""
    from hivemind.p2p import PeerID
    from hivemind.utils import get_dht_time

    from swarm.runtime.dht_process import DHTProcess
    from swarm.wire.records import block_key, fetch_block_records

    dht = DHTProcess(start=True)
    try:
        peers = [PeerID(b"\x12\x20" + hashlib.sha256(bytes([i])).digest()).to_base58() for i in range(5)]
        records = {
            peers[0]: _info(version="0.1.0").model_dump(mode="json"),  # a first-release server
            peers[1]: _info(version=C.release(), capabilities=C.OWN_CAPABILITIES).model_dump(mode="json"),
            peers[2]: _info(version="garbage release").model_dump(mode="json"),
            peers[3]: _info(version="9.0.0", min_protocol=7, protocol=8).model_dump(mode="json"),
            peers[4]: {"state": "online", "start": "zero"},
        }
        when = get_dht_time() + 60
        for peer, value in records.items():
            for block in (0, 1):
                assert dht.store(block_key("t", block), value, when, subkey=peer)
        with caplog.at_level(logging.INFO, logger="swarm.wire.records"):
            for _ in range(3):
                read = fetch_block_records(dht, "t", 2)
                assert [sorted(blocks) for blocks in read] == [sorted(peers[:2])] * 2
        lines = [r.getMessage() for r in caplog.records]
        for peer in peers[2:]:
            assert sum(peer in line for line in lines) == 1, lines
        assert any("malformed release" in line for line in lines) and any("future protocol" in line for line in lines)
    finally:
        dht.shutdown()


def test_status_shows_each_servers_release_and_protocol():
    from swarm.client.transport.status import build_status, format_table

    records = [{"peer-old": _info(version="0.1.0", end=2), "peer-new": _info(version=C.release(), end=2,
                                                                             capabilities=C.OWN_CAPABILITIES)}] * 2
    status = build_status(records, "m", "p")
    assert {s.peer_id: (s.version, s.protocol) for s in status.servers} == {"peer-old": ("0.1.0", "1"),
                                                                            "peer-new": (C.release(), "1")}
    table = format_table(status)
    assert "release" in table.splitlines()[2] and "0.1.0" in table and C.release() in table
