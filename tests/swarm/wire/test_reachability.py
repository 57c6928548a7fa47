"""Reachability and relays without namespaces: the dial-back messages and flags, the relay arguments, routing's
preference for direct servers, and a real dial-back check against the session's bootstrap peer on loopback
(an address that answers is reachable, one where nobody listens is not). The NAT scenario itself, with real
namespaces, is tests/e2e/test_nat.py."""
from __future__ import annotations

import asyncio
import socket

import pytest
from pydantic import ValidationError

from server.config import ServerConfig
from swarm.client.transport.routing import chain_cost, find_inference_chain
from swarm.runtime.config import ConfigError, load_config
from swarm.runtime.relays import RelaySettings, relay_dht_kwargs
from swarm.wire.reachability import DialBack, check_reachability, checker_peers, dialable_maddrs
from swarm.wire.records import ServerInfo, ServerSpan, ServerState

PEER = "12D3KooWNaPxVvxKbtZ2PkrnYb9aCKnYUWtkMXrEe3s2i2zpNZSz"


def test_dial_back_requests_name_direct_addresses_only():
    DialBack(peer_id=PEER, maddrs=["/ip4/1.2.3.4/tcp/5"])
    for bad in ({"peer_id": "nope", "maddrs": ["/ip4/1.2.3.4/tcp/5"]},
                {"peer_id": PEER, "maddrs": [f"/ip4/1.2.3.4/tcp/5/p2p/{PEER}/p2p-circuit"]},
                {"peer_id": PEER, "maddrs": ["/ip4/1.2.3.4"]},
                {"peer_id": PEER, "maddrs": ["/ip4/1.2.3.4/tcp/5"] * 9},
                {"peer_id": PEER, "maddrs": []},
                {"peer_id": PEER, "maddrs": ["/ip4/1.2.3.4/tcp/5"], "extra": 1}):
        with pytest.raises((ValidationError, ValueError)):
            DialBack(**bad)
    assert dialable_maddrs([f"/ip4/1.2.3.4/tcp/5/p2p/{PEER}", f"/ip4/5.6.7.8/tcp/1/p2p/{PEER}/p2p-circuit/p2p/X",
                            "/ip4/1.2.3.4/tcp/5"]) == ["/ip4/1.2.3.4/tcp/5"]
    assert [str(p) for p in checker_peers([f"/ip4/1.2.3.4/tcp/5/p2p/{PEER}", "/ip4/1.2.3.4/tcp/6", "garbage"])] \
        == [PEER]


def test_relay_arguments():
    on, off = RelaySettings(), RelaySettings(no_relay=True)
    offer = relay_dht_kwargs(on, offer=True, reserve=False)
    assert offer["force_reachability"] == "public" and offer["use_relay"] and not offer["use_auto_relay"]
    assert offer["p2pd_extra"] == {"relayService": True, "relayMaxCircuits": 16, "relayDataLimit": 4 << 30,
                                   "relayTimeLimit": "86400s"}
    reserve = relay_dht_kwargs(on, offer=False, reserve=True, relays=["/ip4/1.2.3.4/tcp/5/p2p/" + PEER])
    assert reserve["force_reachability"] == "private" and reserve["use_auto_relay"]
    assert reserve["trusted_relays"] == ["/ip4/1.2.3.4/tcp/5/p2p/" + PEER]
    assert reserve["p2pd_extra"] == {"relayService": False, "relayDiscovery": False}
    none = relay_dht_kwargs(off, offer=True, reserve=True)
    assert not none["use_relay"] and not none["use_auto_relay"] and "force_reachability" not in none
    assert none["p2pd_extra"] == {"relayService": False}


def test_volunteer_flags_from_cli_yaml_and_environment(tmp_path, capsys):
    from server.server import main

    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    for flag in ("--public_ip", "--no_relay", "--no_auto_relay", "--skip_reachability_check",
                 "--relay_max_circuits", "--relay_data_limit",
                 "--relay_time_limit", "--relay_limits_check"):
        assert flag in shown
    config = ServerConfig(model="m", port=31338, public_ip="203.0.113.7")
    assert config.announced_maddrs() == ["/ip4/203.0.113.7/tcp/31338"]
    for bad in ({"public_ip": "203.0.113.7"}, {"public_ip": "not-an-ip", "port": 1}, {"relay_max_circuits": 0}):
        with pytest.raises(ValidationError):
            ServerConfig(model="m", **bad)
    yaml_file = tmp_path / "server.yaml"
    yaml_file.write_text("server:\n  model: m\n  no_auto_relay: true\n")
    loaded = load_config(ServerConfig, yaml_path=str(yaml_file), section="server",
                         environ={"SWARMGATE_NO_RELAY": "1", "SWARMGATE_SKIP_REACHABILITY_CHECK": "true"})
    assert loaded.no_auto_relay and loaded.no_relay and loaded.skip_reachability_check
    with pytest.raises(ConfigError):
        load_config(ServerConfig, environ={"SWARMGATE_MODEL": "m", "SWARMGATE_PUBLIC_IP": "203.0.113.7"})


def _span(peer: str, reachable: str, throughput: float = 10.0) -> ServerSpan:
    info = ServerInfo(state=ServerState.ONLINE, start=0, end=4, throughput=throughput, cache_tokens_left=10_000,
                      reachable=reachable)
    return ServerSpan(peer, 0, 4, info)


def test_routing_prefers_a_direct_server_when_as_fast():
    direct, relayed = _span("b-direct", "direct"), _span("a-relayed", "relayed")
    rtts = {"a-relayed": 0.01, "b-direct": 0.01}
    chain = find_inference_chain([relayed, direct], 0, 4, client_rtts=rtts)
    assert [hop.peer_id for hop in chain] == ["b-direct"]  # the tie (and the peer id order) would pick the other
    assert chain_cost(chain, [relayed, direct], client_rtts=rtts) < chain_cost(
        find_inference_chain([relayed], 0, 4, client_rtts=rtts), [relayed], client_rtts=rtts)
    faster = _span("a-relayed", "relayed", throughput=100.0)
    assert [hop.peer_id for hop in find_inference_chain([faster, direct], 0, 4, client_rtts=rtts)] == ["a-relayed"]
    with pytest.raises(ValidationError):
        ServerInfo(state=ServerState.ONLINE, start=0, end=1, reachable="sometimes")


def test_dial_back_check_against_the_bootstrap_peer(bootstrap):
    """A real check on loopback: the bootstrap peer dials this peer back from its probe."""
    from swarm.runtime.swarm_key import join_dht

    dht = join_dht(None, initial_peers=[bootstrap.maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
    with socket.socket() as closed:  # a port nobody listens on (bound, not listening: refused)
        closed.bind(("127.0.0.1", 0))
        dead = f"/ip4/127.0.0.1/tcp/{closed.getsockname()[1]}"

        async def check():
            p2p = await dht.replicate_p2p()
            try:
                checkers = checker_peers([bootstrap.maddr])
                here = dialable_maddrs(dht.get_visible_maddrs())
                return (await check_reachability(p2p, checkers, here), await check_reachability(p2p, checkers, [dead]),
                        await check_reachability(p2p, [], here))
            finally:
                await p2p.shutdown()

        try:
            assert asyncio.run(check()) == (True, False, None)
        finally:
            dht.shutdown()
