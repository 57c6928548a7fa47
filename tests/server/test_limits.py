"""Resource limits of a real block server (`server/rpc/limits.py`): over a cap a clear `over_limit` error on that
call only, nothing held afterwards, and no memory growth from oversize messages."""
from __future__ import annotations

import asyncio
import time

import psutil
import pytest
import torch
from hivemind.proto import runtime_pb2

from launch.topology import start_server
from server.config import ServerConfig
from swarm.client.transport.manager import ClientConfig, SwarmManager
from swarm.runtime import aio
from swarm.wire import protocol as P

HIDDEN = 576
LIMITS = ("--max_sessions_per_peer", "2", "--max_streams", "4", "--max_message_bytes", "1000000",
          "--max_step_tokens", "64", "--step_timeout", "10")


@pytest.fixture(scope="module")
def servers(swarms, model_path, bootstrap):
    """{'limited': the ("0:30",) server with every limit of LIMITS, 'capped': a server capping sessions per peer and
    open streams only (with the default --step_timeout no stream or session of a test expires while it runs, however
    slow the machine)}, started together."""
    capped = start_server(model_path, [bootstrap.maddr], "0:30", "tcapped",
                          ["--max_sessions_per_peer", "2", "--max_streams", "4"], threads=1)
    try:
        limited = swarms.get(("0:30",), extra=LIMITS)["servers"][0]
        capped.wait_ready(180)
        yield {"limited": limited, "capped": capped}
    finally:
        capped.terminate()


@pytest.fixture(scope="module")
def limited(swarms, servers):
    swarm = swarms.get(("0:30",), extra=LIMITS)
    m = SwarmManager(ClientConfig(initial_peers=swarm["initial_peers"]), swarm["prefix"], 30)
    yield m, servers["limited"]
    m.shutdown()


@pytest.fixture(scope="module")
def capped(bootstrap, servers):
    m = SwarmManager(ClientConfig(initial_peers=[bootstrap.maddr]), "tcapped", 30)
    yield m, servers["capped"]
    m.shutdown()


def _open(session_id: str) -> runtime_pb2.ExpertRequest:
    return P.make_request(P.OpenSession(session_id=session_id, start=0, end=30, max_length=16))


class Stream:
    """One inference stream kept open: send requests one by one, read each reply."""

    def __init__(self, manager: SwarmManager, peer_id: str):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.manager, self.peer_id = manager, peer_id
        self.responses = None

    async def _gen(self):
        while (item := await self.queue.get()) is not None:
            yield item

    def start(self) -> "Stream":
        async def go():
            self.responses = await self.manager.stub(self.peer_id).rpc_inference(self._gen())
        aio.run(go(), timeout=60)
        return self

    def ask(self, request):
        async def go():
            self.queue.put_nowait(request)
            return P.decode_reply((await asyncio.wait_for(self.responses.__anext__(), 60)).metadata)
        return aio.run(go(), timeout=90)

    def close(self) -> None:
        async def go():
            self.queue.put_nowait(None)
            try:
                await asyncio.wait_for(self.responses.aclose(), 10)
            except Exception:
                pass
        aio.run(go(), timeout=30)


def _wait_idle(manager: SwarmManager, peer_id: str, timeout: float = 60) -> P.ServerStats:
    deadline = time.monotonic() + timeout
    while True:
        stats = manager.server_info(peer_id)
        if (stats.sessions_open, stats.cache_tokens_used) == (0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _wait_streams_closed(manager: SwarmManager, peer_id: str, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while (streams := manager.server_info(peer_id).streams_open) and time.monotonic() < deadline:
        time.sleep(0.2)
    return streams


def test_limit_flags_are_documented_and_checked():
    fields = ServerConfig.model_fields
    for name in ("max_sessions_per_peer", "max_streams", "max_message_bytes", "max_step_tokens", "max_queued_steps"):
        assert fields[name].description, name
    with pytest.raises(ValueError, match="max_streams"):
        ServerConfig(model="m", max_streams=0)
    with pytest.raises(ValueError, match="packed row count"):
        ServerConfig(model="m", packed_rows=[8, 1])
    assert ServerConfig(model="m", packed_rows=[16, 8, 16]).packed_rows == [8, 16]


def test_the_prefill_pass_budget_flag_defaults_by_device_and_is_checked():
    from server.config import PREFILL_BATCH_TOKENS_CPU, PREFILL_BATCH_TOKENS_CUDA

    assert ServerConfig.model_fields["prefill_batch_tokens"].description
    assert ServerConfig(model="m").prefill_pass_tokens == PREFILL_BATCH_TOKENS_CPU
    assert ServerConfig(model="m", device="cuda:1").prefill_pass_tokens == PREFILL_BATCH_TOKENS_CUDA
    assert ServerConfig(model="m", device="cuda", prefill_batch_tokens=32).prefill_pass_tokens == 32
    with pytest.raises(ValueError, match="prefill_batch_tokens"):
        ServerConfig(model="m", prefill_batch_tokens=0)
    with pytest.raises(ValueError, match=r"unknown device 'gpu0': use cpu, cuda or cuda:N"):
        ServerConfig(model="m", device="gpu0")


def test_the_device_flag_takes_what_torch_takes_of_cpu_and_cuda():
    from swarm.runtime.config import parse_device

    for name in ("cpu", "cpu:0", "cpu:3", "cuda", "cuda:0", "cuda:12"):
        torch.device(name)  # torch takes each
        assert ServerConfig(model="m", device=name).device == ("cpu" if name.startswith("cpu") else name)
    # a CPU tensor's device is 'cpu' whatever index it was made with: the name compares equal to it
    assert torch.zeros(1, device=parse_device("cpu:0")).device == torch.device(parse_device("cpu:0"))
    for name in ("cuda:01", "cuda:", "cuda:-1", " cuda", "CUDA", "cuda:\u0663", "gpu0", "mps", "meta", "cuda:0:1"):
        with pytest.raises(ValueError, match=r"unknown device .*: use cpu, cuda or cuda:N"):
            parse_device(name)
        with pytest.raises(ValueError, match="device"):
            ServerConfig(model="m", device=name)


def test_sessions_per_peer_and_open_streams(capped):
    m, server = capped
    a, b = Stream(m, server.peer_id).start(), Stream(m, server.peer_id).start()
    idle = []
    try:
        assert isinstance(a.ask(_open("a")), P.StepResult)
        assert isinstance(b.ask(_open("b")), P.StepResult)
        c = Stream(m, server.peer_id).start()
        refused = c.ask(_open("c"))
        assert isinstance(refused, P.ErrorReply) and refused.code == "over_limit"
        assert "max_sessions_per_peer" in refused.message
        c.close()
        # the refused stream's end reaches the server first: counted open still, it would let a fifth stream in
        # (whose session is then refused for --max_sessions_per_peer instead)
        deadline = time.monotonic() + 60  # a bound, not a timing: the server's own count is what is waited for
        while m.server_info(server.peer_id).streams_open > 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert m.server_info(server.peer_id).streams_open == 2
        # two streams that have sent nothing yet still count against --max_streams 4: a fifth is refused
        idle = [Stream(m, server.peer_id).start() for _ in range(2)]
        deadline = time.monotonic() + 60  # until the server has them all (a fixed sleep raced a loaded machine)
        while m.server_info(server.peer_id).streams_open < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert m.server_info(server.peer_id).streams_open == 4
        fifth = Stream(m, server.peer_id).start()
        refused = fifth.ask(_open("e"))
        assert isinstance(refused, P.ErrorReply) and refused.code == "over_limit" and "max_streams" in refused.message
        fifth.close()
        # every refused stream gets its reply: the server used to close it at once, unread, and the reset that
        # closing sent could overtake the reply (the caller then saw a broken pipe or waited for ever)
        for i in range(100):
            over = Stream(m, server.peer_id).start()
            refused = over.ask(_open(f"over{i}"))
            over.close()
            assert isinstance(refused, P.ErrorReply) and refused.code == "over_limit", (i, refused)
        # the open sessions are unaffected
        reply = a.ask(P.make_request(P.Step(start_position=0), [torch.randn(1, 2, HIDDEN)]))
        assert isinstance(reply, P.StepResult) and reply.position == 2
    finally:
        for s in [a, b, *idle]:
            s.close()
    stats = _wait_idle(m, server.peer_id)
    assert (stats.sessions_open, stats.cache_tokens_used) == (0, 0), stats
    again = Stream(m, server.peer_id).start()  # every slot came back
    try:
        assert isinstance(again.ask(_open("again")), P.StepResult)
    finally:
        again.close()


def test_step_tokens_and_message_bytes(limited):
    m, server = limited
    s = Stream(m, server.peer_id).start()
    try:
        assert isinstance(s.ask(_open("long")), P.StepResult)
        long_prompt = s.ask(P.make_request(P.Step(start_position=0), [torch.randn(1, 100, HIDDEN)]))
        assert isinstance(long_prompt, P.ErrorReply) and long_prompt.code == "over_limit"
        assert "max_step_tokens" in long_prompt.message
        huge = s.ask(P.make_request(P.Step(start_position=0), [torch.randn(1, 500, HIDDEN)]))  # 1.15 MB
        assert isinstance(huge, P.ErrorReply) and "max_message_bytes" in huge.message
        ok = s.ask(P.make_request(P.Step(start_position=0), [torch.randn(1, 16, HIDDEN)]))
        assert isinstance(ok, P.StepResult) and ok.position == 16
    finally:
        s.close()
    stub = m.stub(server.peer_id)
    response = aio.run(stub.rpc_forward(P.make_request(P.ForwardRequest(start=0, end=30),
                                                       [torch.randn(2, 40, HIDDEN)]), timeout=60))
    reply = P.decode_reply(response.metadata, forward=True)
    assert isinstance(reply, P.ErrorReply) and "max_step_tokens" in reply.message  # 80 tokens in one call


def test_oversize_messages_do_not_grow_memory(limited):
    m, server = limited
    rss = psutil.Process(server.proc.pid).memory_info().rss
    s = Stream(m, server.peer_id).start()
    try:
        assert isinstance(s.ask(_open("flood")), P.StepResult)
        for _ in range(30):
            reply = s.ask(P.make_request(P.Step(start_position=0), [torch.randn(1, 600, HIDDEN)]))  # 1.4 MB each
            assert isinstance(reply, P.ErrorReply) and reply.code == "over_limit"
    finally:
        s.close()
    _wait_idle(m, server.peer_id)
    grown = psutil.Process(server.proc.pid).memory_info().rss - rss
    assert grown < 32 << 20, f"the server grew by {grown >> 20} MiB after 42 MB of refused messages"


@pytest.mark.parametrize("backward", [False, True])
def test_training_calls_time_out_and_count_as_streams(limited, backward):
    """Regression (found fuzzing the training RPCs): a training call whose request never ended held its handler
    forever, and training calls were not counted against --max_streams. Now a stalled call gets `timeout` after
    --step_timeout, and calls over --max_streams get `over_limit`; a silent inference stream is one of the five."""
    from swarm.wire import streaming

    m, server = limited
    kind = P.TrainBackward if backward else P.TrainForward
    first = streaming.pack(runtime_pb2.ExpertRequest, kind(start=0, end=30), [torch.randn(1, 2, HIDDEN)])[0]

    async def stalled():
        yield first
        await asyncio.sleep(3600)

    async def silent():
        await asyncio.sleep(3600)
        yield first

    async def call(inference: bool = False):
        stub = m.stub(server.peer_id)
        rpc = stub.rpc_train_backward if backward else stub.rpc_train_forward
        # an inference stream that never sends its first request gets `timeout` too (it used to be closed silently)
        responses = await (stub.rpc_inference(silent()) if inference else rpc(stalled()))
        try:  # the first reply only: reading to the end would wait for our own (stalled) writer
            return P.decode_reply((await responses.__anext__()).metadata)
        finally:
            await responses.aclose()

    async def five():
        return await asyncio.gather(*(call() for _ in range(4)), call(inference=True))

    _wait_streams_closed(m, server.peer_id)  # the streams of earlier tests are gone
    errors = aio.run(asyncio.wait_for(five(), 120), timeout=150)  # --max_streams 4, --step_timeout 10
    codes = sorted(e.code for e in errors)
    assert codes == ["over_limit"] + ["timeout"] * 4, errors
    assert any("max_streams" in e.message for e in errors) and any("step_timeout" in e.message for e in errors)
    stats = _wait_idle(m, server.peer_id)
    assert _wait_streams_closed(m, server.peer_id) == 0  # every slot came back: a session opens
    s = Stream(m, server.peer_id).start()
    try:
        assert isinstance(s.ask(_open("after")), P.StepResult)
    finally:
        s.close()
    assert (stats.sessions_open, stats.cache_tokens_used) == (0, 0)


def test_routing_skips_servers_whose_announced_limits_take_no_such_session():
    from swarm.client.transport.routing import RoutingError, find_inference_chain
    from swarm.wire.records import ServerInfo, ServerLimits, ServerSpan, ServerState

    def span(peer: str, max_length: int) -> ServerSpan:
        limits = ServerLimits(max_length=max_length, max_sessions_per_peer=8, max_streams=8,
                              max_message_bytes=1 << 20, max_step_tokens=64, max_queued_steps=8)
        return ServerSpan(peer, 0, 4, ServerInfo(state=ServerState.ONLINE, start=0, end=4, limits=limits))

    spans = [span("short", 100), span("long", 1000)]
    [hop] = find_inference_chain(spans, 0, 4, session_length=500)
    assert hop.peer_id == "long" and hop.limits is not None and hop.limits.max_step_tokens == 64
    with pytest.raises(RoutingError, match="at most 1000 tokens, their --max_length"):
        find_inference_chain(spans, 0, 4, session_length=2000)


def test_limits_are_announced_and_the_client_fits_its_steps_to_them(limited, swarms, model_path, tokenizer,
                                                                    reference_model):
    """The DHT record and rpc_info carry the server's limits; a client sends a 100-token prompt to a server that
    takes 64 tokens per step in chunks (it got `over_limit` before), and a session longer than any server takes
    gets a clear error before anything is sent."""
    from swarm import AutoDistributedModelForCausalLM
    from swarm.client.transport.session import SessionError

    m, server = limited
    stats = m.server_info(server.peer_id)
    assert stats.limits is not None
    assert (stats.limits.max_sessions_per_peer, stats.limits.max_streams, stats.limits.max_message_bytes,
            stats.limits.max_step_tokens, stats.limits.max_length) == (2, 4, 1000000, 64, 8192)
    [record] = [s for s in m.update(force=True) if s.peer_id == server.peer_id]
    assert record.info.limits == stats.limits
    swarm = swarms.get(("0:30",), extra=LIMITS)
    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=swarm["initial_peers"],
                                                            dht_prefix=swarm["prefix"])
    try:
        ids = tokenizer("The colors of the rainbow are " * 14, return_tensors="pt")["input_ids"]
        assert ids.shape[1] > 64
        out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert out.tolist() == reference_model.generate(ids, max_new_tokens=3, min_new_tokens=3,
                                                        do_sample=False).tolist()
        with model.inference_session(max_length=9000) as session:
            with pytest.raises(SessionError, match="--max_length"):
                model.generate(ids, max_new_tokens=1, session=session)
    finally:
        model.shutdown()


def test_rounds_fit_the_step_tokens_and_keep_their_sessions_past_the_step_timeout(limited):
    """Rounds (issue 46) on the limited server: two sessions of 40 rows each (80 tokens a round, the server takes
    64 a message) go in two round messages, each session's rows whole; and sessions that step only in rounds for
    longer than --step_timeout (10 s) are not closed as idle (their own streams carry no step meanwhile)."""
    from swarm.client.transport import rounds
    from swarm.client.transport.session import InferenceSession

    m, server = limited
    sessions = [InferenceSession(m, max_length=16) for _ in range(2)]
    try:
        first = rounds.step_round([(s, torch.randn(40, 1, HIDDEN), None) for s in sessions])  # opens them (astep)
        assert all(isinstance(out, torch.Tensor) for out in first), first
        before = aio.run(rounds.round_stats(m, server.peer_id))
        began, steps = time.monotonic(), 0
        while time.monotonic() - began < 12 or steps < 2:  # past the server's --step_timeout 10
            outs = rounds.step_round([(s, torch.randn(40, 1, HIDDEN), None) for s in sessions])
            assert all(isinstance(out, torch.Tensor) and out.shape == (40, 1, HIDDEN) for out in outs), outs
            steps += 1
            time.sleep(2)
        after = aio.run(rounds.round_stats(m, server.peer_id))
        assert after.messages - before.messages == 2 * steps  # cut under max_step_tokens: two messages a round
        assert after.rows - before.rows == 2 * steps and after.row_errors == before.row_errors
        assert after.session_steps == before.session_steps  # nothing on the sessions' own streams meanwhile
        for s in sessions:  # their own streams are still open: a step on them works, no failover
            s.step(torch.randn(40, 1, HIDDEN))
            assert s.failovers == 0 and s.position == 2 + steps
    finally:
        for s in sessions:
            s.close()
        rounds.close_round_streams(m)
