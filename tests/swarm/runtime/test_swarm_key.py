"""The swarm key's pieces without processes: key files, membership proofs, the DHT authorizer, config checks."""
from __future__ import annotations

import asyncio

import pytest
from hivemind.proto import dht_pb2

from swarm.runtime.config import ConfigError, load_config
from swarm.runtime.swarm_key import MAX_CLOCK_SKEW, SwarmKey, SwarmKeyAuthorizer, SwarmKeySettings

SECRET = "0123456789abcdef-shared-secret"
PEER = "12D3KooWQcDwdERqzANxK8BBxoXHhs5q31JtseSoksHmMw3bHuap"
OTHER_PEER = "12D3KooWRBhwfeP2Y7TCx1SM6s6rBzH9NwWn3vdtRAtrmQkpXfMn"


def test_key_from_file_ignores_surrounding_whitespace_and_rejects_short_keys(tmp_path):
    path = tmp_path / "swarm.key"
    path.write_text(f"\n{SECRET}\n")
    assert SwarmKey.from_file(path).fingerprint == SwarmKey(SECRET).fingerprint != SwarmKey(SECRET + "x").fingerprint
    with pytest.raises(ValueError, match="at least 16"):
        SwarmKey("short")
    with pytest.raises(ValueError, match="cannot read the swarm key file"):
        SwarmKey.from_file(tmp_path / "missing.key")


def test_membership_proof_is_bound_to_the_key_and_the_peer_id():
    key = SwarmKey(SECRET)
    proof = key.member_proof(PEER)
    assert key.is_member(PEER, proof)
    assert not key.is_member(OTHER_PEER, proof)  # copied by another peer: useless
    assert not SwarmKey(SECRET + "-other").is_member(PEER, proof)
    assert not key.is_member(PEER, "") and not key.is_member(PEER, "é" * 64)


def _ping() -> dht_pb2.PingRequest:
    return dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"node"), validate=True)


def test_authorizer_accepts_signed_requests_once_and_refuses_tampering_replays_and_other_keys():
    async def run():
        member, peer = SwarmKeyAuthorizer(SwarmKey(SECRET)), SwarmKeyAuthorizer(SwarmKey(SECRET))
        outsider = SwarmKeyAuthorizer(SwarmKey(SECRET + "-other"))
        request = _ping()
        await member.sign_request(request, None)
        replay = dht_pb2.PingRequest.FromString(request.SerializeToString())
        assert await peer.validate_request(request)
        assert not await peer.validate_request(replay)  # the same nonce again

        tampered = _ping()
        await member.sign_request(tampered, None)
        tampered.validate = False
        assert not await peer.validate_request(tampered)

        foreign = _ping()
        await outsider.sign_request(foreign, None)
        assert not await peer.validate_request(foreign)
        assert not await peer.validate_request(_ping())  # unsigned

        stale = _ping()
        await member.sign_request(stale, None)
        stale.auth.time -= 2 * MAX_CLOCK_SKEW
        stale.auth.signature = b""
        stale.auth.signature = member.key.mac(b"dht-request", stale.SerializeToString())
        assert not await peer.validate_request(stale)

        request = _ping()
        await member.sign_request(request, None)
        response = dht_pb2.PingResponse(dht_time=1.0, available=True)
        await peer.sign_response(response, request)
        copy = dht_pb2.PingResponse.FromString(response.SerializeToString())
        assert await member.validate_response(response, request)
        other_request = _ping()
        await member.sign_request(other_request, None)
        assert not await member.validate_response(copy, other_request)  # bound to its request's nonce
        forged = dht_pb2.PingResponse(dht_time=1.0, available=True)
        await outsider.sign_response(forged, request)
        assert not await member.validate_response(forged, request)

    asyncio.run(run())


def test_settings_take_the_key_from_a_file_or_the_environment_once(tmp_path):
    path = tmp_path / "swarm.key"
    path.write_text(SECRET)
    assert load_config(SwarmKeySettings, environ={}).load_swarm_key() is None
    from_env = load_config(SwarmKeySettings, environ={"SWARMGATE_SWARM_KEY": SECRET}).load_swarm_key()
    from_file = load_config(SwarmKeySettings, environ={"SWARMGATE_SWARM_KEY_FILE": str(path)}).load_swarm_key()
    assert from_env is not None and from_file is not None and from_env.fingerprint == from_file.fingerprint
    assert SECRET not in repr(load_config(SwarmKeySettings, environ={"SWARMGATE_SWARM_KEY": SECRET}))
    with pytest.raises(ConfigError, match="not both"):
        load_config(SwarmKeySettings, environ={"SWARMGATE_SWARM_KEY": SECRET, "SWARMGATE_SWARM_KEY_FILE": str(path)})
    with pytest.raises(ConfigError, match="cannot read the swarm key file"):
        load_config(SwarmKeySettings, environ={"SWARMGATE_SWARM_KEY_FILE": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="at least 16"):
        load_config(SwarmKeySettings, environ={"SWARMGATE_SWARM_KEY": "short"})


def test_every_rpc_of_a_block_server_carries_the_membership_proof():
    """`ProvedStub` stamps the proof on each RPC a server serves: one it lacks would reach a keyed server
    unproved and be refused (the training RPCs once were)."""
    from server.rpc.handler import BlockHandler
    from swarm.wire.protocol import ProvedStub

    served = {name for name in dir(BlockHandler) if name.startswith("rpc_")}
    assert {"rpc_inference", "rpc_forward", "rpc_train_forward", "rpc_train_backward"} <= served
    assert served <= {name for name in dir(ProvedStub) if name.startswith("rpc_")}
