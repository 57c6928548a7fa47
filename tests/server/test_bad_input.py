"""Bad input to a real block server: each gets a clear error on its own session; the server and others go on."""
from __future__ import annotations

import asyncio
import time
from typing import Optional

import pytest
import torch
from hivemind.proto import runtime_pb2

from launch.topology import start_servers
from swarm.client.transport.manager import ClientConfig, SwarmManager
from swarm.runtime import aio
from swarm.wire import protocol as P
from swarm.wire.records import ServerState, fetch_block_records, server_states

HIDDEN = 576


@pytest.fixture(scope="module")
def manager(quiet_swarm):
    swarm = quiet_swarm  # ("0:15", "15:30"), no shared gateway's pooled session on it: the tests count sessions
    m = SwarmManager(ClientConfig(initial_peers=swarm["initial_peers"]), swarm["prefix"], 30)
    yield m, swarm
    m.shutdown()


async def _conversation(manager: SwarmManager, peer_id: str, requests, hold: Optional[asyncio.Event] = None):
    """Send raw requests on one inference stream; return the decoded replies (errors included). The stream stays
    open until every request is answered and, if `hold` is given, until it is set."""
    answered = asyncio.Event()

    async def gen():
        for request in requests:
            yield request
        # ending our side closes the stream: keep it open until every request is answered or the server ends it
        await answered.wait()

    responses = await manager.stub(peer_id).rpc_inference(gen())
    replies = []
    try:
        async for response in responses:
            replies.append(P.decode_reply(response.metadata))
            if len(replies) == len(requests):  # one reply per request
                if hold is not None:
                    await hold.wait()
                break
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server ended the stream (after an error at open) while we were still writing
    finally:
        answered.set()
    return replies


def _server_stats_when(manager: SwarmManager, peer_id: str, done, timeout: float = 30.0):
    """The server's stats once `done(stats)` holds, or the last ones after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        stats = manager.server_info(peer_id)
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def _open(**kw):
    fields = dict(session_id="s1", start=0, end=15, max_length=16, batch_size=1)
    fields.update(kw)
    return P.make_request(P.OpenSession(**fields))


def _step(hidden, start_position=0):
    return P.make_request(P.Step(start_position=start_position), [hidden])


def talk(manager, peer_id, *requests):
    return aio.run(asyncio.wait_for(_conversation(manager, peer_id, list(requests)), 60))


def test_bad_steps_get_errors_and_the_session_goes_on(manager):
    m, swarm = manager
    peer = swarm["servers"][0].peer_id
    good = torch.randn(1, 3, HIDDEN)
    bad_dtype = P.make_request(P.Step(start_position=3))  # a peer sending float64, which our client never does
    bad_dtype.tensors.append(runtime_pb2.Tensor(buffer=torch.randn(1, 1, HIDDEN, dtype=torch.float64).numpy().tobytes(),
                                                size=[1, 1, HIDDEN], dtype="float64"))
    replies = talk(
        m, peer, _open(),
        _step(torch.randn(1, 3, HIDDEN + 1)),                   # wrong hidden size
        bad_dtype,                                              # wrong dtype
        _step(torch.randn(1, 3, HIDDEN), start_position=5),     # a position past what the session holds
        _step(torch.randn(2, 3, HIDDEN)),                       # wrong batch size
        _step(torch.full((1, 2, HIDDEN), float("nan"))),        # non-finite values
        _step(good),                                            # a good step still works
        _step(torch.randn(1, 14, HIDDEN), start_position=3),    # past max_length 16
        _step(torch.randn(1, 1, HIDDEN), start_position=3),     # and the session still works
        P.make_request(P.Step(start_position=4, rope_length=4), [good[:, :1]]),  # a step ending before its part
        P.make_request(P.Step(start_position=4, rope_length=9), [good[:, :1]]),  # a part of a longer step
    )
    kinds = [type(r).__name__ for r in replies]
    assert kinds == ["StepResult", "ErrorReply", "ErrorReply", "ErrorReply", "ErrorReply", "ErrorReply",
                     "StepResult", "ErrorReply", "StepResult", "ErrorReply", "StepResult"]
    messages = [r.message for r in replies if isinstance(r, P.ErrorReply)]
    assert "576" in messages[0] and "float64" in messages[1] and "start_position" in messages[2]
    assert "batch size" in messages[3] and "NaN" in messages[4] and "max_length" in messages[5]
    assert replies[6].position == 3 and replies[8].position == 4 and replies[10].position == 5
    assert "rope_length" in messages[6]


def test_bad_session_openings(manager):
    m, swarm = manager
    peer = swarm["servers"][0].peer_id
    [unknown_range] = talk(m, peer, _open(start=10, end=20))
    assert isinstance(unknown_range, P.ErrorReply) and "not served" in unknown_range.message
    [too_big] = talk(m, peer, _open(max_length=10**6))
    assert isinstance(too_big, P.ErrorReply) and "max_length" in too_big.message
    [over_cache] = talk(m, peer, _open(max_length=8000, batch_size=64))
    assert isinstance(over_cache, P.ErrorReply) and over_cache.code == "out_of_cache"
    bad_version = runtime_pb2.ExpertRequest(metadata=b'{"v": 99, "type": "open"}')
    [reply] = talk(m, peer, bad_version)
    assert isinstance(reply, P.ErrorReply) and "version" in reply.message
    not_json = runtime_pb2.ExpertRequest(metadata=b"\xff\x00garbage")
    [reply] = talk(m, peer, not_json)
    assert isinstance(reply, P.ErrorReply) and "JSON" in reply.message
    extra_field = runtime_pb2.ExpertRequest(
        metadata=b'{"v": 1, "type": "open", "session_id": "x", "start": 0, "end": 15, "max_length": 4, "evil": 1}'
    )
    [reply] = talk(m, peer, extra_field)
    assert isinstance(reply, P.ErrorReply) and "evil" in reply.message
    # a truncated tensor buffer
    broken = _step(torch.randn(1, 2, HIDDEN))
    broken.tensors[0].buffer = broken.tensors[0].buffer[:-4]
    replies = talk(m, peer, _open(), broken)
    assert isinstance(replies[1], P.ErrorReply) and "bytes" in replies[1].message
    # after all that, the server serves a normal session and reports no leaked cache
    replies = talk(m, peer, _open(session_id="after"), _step(torch.randn(1, 2, HIDDEN)))
    assert isinstance(replies[-1], P.StepResult) and replies[-1].position == 2
    # (the server frees a session when its stream ends, which may finish just after our last reply)
    stats = _server_stats_when(m, peer, lambda s: (s.sessions_open, s.cache_tokens_used) == (0, 0))
    assert (stats.sessions_open, stats.cache_tokens_used) == (0, 0), stats


def test_a_part_reopened_by_its_client_supersedes_the_old_stream(manager):
    """A client that reopens a session part before the server has seen its old stream end (a retry right after a
    close, or after the stream broke) gets the part: the old stream ends. Another peer naming a held part is
    refused, and the holder's session goes on."""
    m, swarm = manager
    peer = swarm["servers"][0].peer_id

    loop = aio.get_loop()
    release = asyncio.Event()
    held = asyncio.run_coroutine_threadsafe(_conversation(m, peer, [_open(session_id="reopened")], hold=release), loop)
    assert _server_stats_when(m, peer, lambda s: s.sessions_open > 0).sessions_open == 1  # the server holds the part
    again = talk(m, peer, _open(session_id="reopened"), _step(torch.randn(1, 2, HIDDEN)))
    assert [type(r).__name__ for r in again] == ["StepResult", "StepResult"] and again[1].position == 2
    # the old stream (its client still holding it open) has ended on the server: no session is left open
    assert _server_stats_when(m, peer, lambda s: s.sessions_open == 0).sessions_open == 0
    loop.call_soon_threadsafe(release.set)
    assert [type(r).__name__ for r in held.result(30)] == ["StepResult"]

    other = SwarmManager(ClientConfig(initial_peers=swarm["initial_peers"]), swarm["prefix"], 30)
    try:
        async def collision():
            release = asyncio.Event()
            held = asyncio.ensure_future(_conversation(m, peer, [_open(session_id="taken"),
                                                                 _step(torch.randn(1, 2, HIDDEN))], hold=release))
            await asyncio.sleep(1.0)
            refused = await _conversation(other, peer, [_open(session_id="taken")])
            release.set()
            return refused, await held

        refused, holder = aio.run(asyncio.wait_for(collision(), 60))
    finally:
        other.shutdown()
    assert isinstance(refused[0], P.ErrorReply) and "already open" in refused[0].message
    assert [type(r).__name__ for r in holder] == ["StepResult", "StepResult"]


def test_bad_forward_requests(manager):
    m, swarm = manager
    peer = swarm["servers"][1].peer_id
    stub = m.stub(peer)

    def call(request):
        response = aio.run(stub.rpc_forward(request, timeout=60))
        return P.decode_reply(response.metadata, forward=True)

    ok = call(P.make_request(P.ForwardRequest(start=15, end=30), [torch.randn(1, 4, HIDDEN)]))
    assert isinstance(ok, P.ForwardResult)
    wrong = call(P.make_request(P.ForwardRequest(start=0, end=30), [torch.randn(1, 4, HIDDEN)]))
    assert isinstance(wrong, P.ErrorReply) and "not served" in wrong.message
    two = call(P.make_request(P.ForwardRequest(start=15, end=30), [torch.randn(1, 4, HIDDEN)] * 2))
    assert isinstance(two, P.ErrorReply) and "exactly 1" in two.message
    short = call(P.make_request(P.ForwardRequest(start=15, end=30, rope_length=3), [torch.randn(1, 4, HIDDEN)]))
    assert isinstance(short, P.ErrorReply) and "rope_length" in short.message


def test_bad_prefix_outputs_requests(manager):
    """`rpc_prefix_outputs` answers only the peer's own open session part, for positions it adopted and kept."""
    m, swarm = manager
    peer = swarm["servers"][0].peer_id
    stub = m.stub(peer)

    async def ask(request):
        return P.decode_reply((await stub.rpc_prefix_outputs(request, timeout=60)).metadata)

    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        responses = await stub.rpc_inference(aio.iterate_queue(queue))
        queue.put_nowait(_open(session_id="po1"))  # open, nothing adopted (no prefix declared)
        try:
            assert isinstance(P.decode_reply((await responses.__anext__()).metadata), P.StepResult)
            key = P.stream_key("po1", 0)
            return [await ask(P.make_request(P.PrefixOutputsRequest(stream_key=key, positions=4))),
                    await ask(P.make_request(P.PrefixOutputsRequest(stream_key="nobody:0", positions=4))),
                    await ask(P.make_request(P.PrefixOutputsRequest(stream_key=key, positions=4),
                                             [torch.randn(1, 4, HIDDEN)])),
                    await ask(runtime_pb2.ExpertRequest(metadata=b'{"type": "prefix_outputs", "positions": -1}'))]
        finally:
            queue.put_nowait(None)

    none_kept, unknown, with_tensor, malformed = aio.run(asyncio.wait_for(scenario(), 60))
    assert isinstance(none_kept, P.ErrorReply) and "kept the outputs of 0 adopted positions" in none_kept.message
    assert isinstance(unknown, P.ErrorReply) and "no session part nobody:0" in unknown.message
    assert isinstance(with_tensor, P.ErrorReply) and "carries no tensors" in with_tensor.message
    assert isinstance(malformed, P.ErrorReply) and malformed.code == "bad_request"
    ok = _forward(m, swarm["servers"][0].peer_id)  # the server goes on
    assert isinstance(ok, P.ForwardResult)


def _forward(m, peer_id: str):
    request = P.make_request(P.ForwardRequest(start=0, end=15), [torch.randn(1, 4, HIDDEN)])
    response = aio.run(m.stub(peer_id).rpc_forward(request, timeout=60))
    return P.decode_reply(response.metadata, forward=True)


def test_sigterm_announces_offline_and_exits_zero(model_path, bootstrap):
    prefix = "tsigterm"
    [server] = start_servers(model_path, [bootstrap.maddr], ["0:30"], prefix, ["--update_period", "5"], threads=1)
    m = SwarmManager(ClientConfig(initial_peers=[bootstrap.maddr]), prefix, 30)
    try:
        states = server_states(fetch_block_records(m.dht, prefix, 30))
        assert states.get(server.peer_id) == ServerState.ONLINE
        assert server.terminate(timeout=60) == 0
        states = server_states(fetch_block_records(m.dht, prefix, 30))
        assert states.get(server.peer_id) == ServerState.OFFLINE
    finally:
        server.kill()
        m.shutdown()


def test_cli_rejects_bad_flags(model_path, bootstrap):
    import subprocess
    import sys

    from launch.topology import REPO

    cases = [  # (arguments, expected exit status (None: not 0), text in stderr); the processes run together
        (("server", model_path, "--new_swarm", "--block_indices", "20:10"), None, "start < end"),
        (("server", model_path, "--new_swarm", "--torch_dtype", "float8"), None, "torch_dtype"),
        (("server", model_path, "--new_swarm", "--block_indices", "0:99", "--host_maddrs", "/ip4/127.0.0.1/tcp/0"),
         1, "outside"),
        (("server", model_path), 1, "initial_peers"),  # neither --new_swarm nor --initial_peers
        (("nonsense",), 2, "unknown command"),
    ]
    procs = [subprocess.Popen([sys.executable, "-m", "launch.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args, _, _ in cases]
    try:
        results = [proc.communicate(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for (args, code, text), proc, (_, stderr) in zip(cases, procs, results):
        assert (proc.returncode != 0 if code is None else proc.returncode == code), (args, proc.returncode, stderr)
        assert text in stderr, (args, stderr)
