"""Servers that place themselves, on real processes: cover the model, re-cover it after a crash, heal themselves."""
from __future__ import annotations

import threading
import time
import uuid
from typing import List

from launch.topology import ManagedProcess, start_servers, terminate_all
from swarm.wire.records import ServerState, fetch_block_records
from tests.fixtures.swarm_watch import NUM_BLOCKS, online_cover, reader, wait_for  # noqa: F401  (reader: a fixture)


def start_placed_servers(model_path: str, bootstrap, prefix: str, count: int, cache_root, extra: List[str] = ()
                         ) -> List[ManagedProcess]:
    """`count` servers that place themselves (unless `extra` pins them), sharing a throughput cache."""
    return start_servers(model_path, [bootstrap.maddr], [None] * count, prefix, extra, timeout=300, threads=1,
                         env={"SWARMGATE_CACHE": str(cache_root)})


def test_three_servers_cover_the_model_and_recover_from_a_crash(model_path, bootstrap, reader, reference_model,
                                                                tokenizer, tmp_path):
    from swarm import AutoDistributedModelForCausalLM

    prefix = f"place-{uuid.uuid4().hex[:8]}"
    flags = ["--num_blocks", "15", "--update_period", "1", "--expiration", "6", "--balance_period", "2",
             "--drain_timeout", "5", "--throughput", "auto"]
    procs = start_placed_servers(model_path, bootstrap, prefix, 3, tmp_path, flags)
    try:
        # all three measured nothing but one block once (shared cache), and announce the same number
        throughputs = {p.ready["throughput"] for p in procs}
        assert len(throughputs) == 1 and throughputs.pop() > 0
        cache = (tmp_path / "throughput.json").read_text()
        assert cache.count("decode_rps") == 1, cache

        spans = wait_for(lambda: online_cover(reader, prefix), 60, "three servers to cover all blocks")
        assert set(spans) == {p.peer_id for p in procs}
        assert all(end - start == 15 for start, end in spans.values())

        # kill (SIGKILL, no goodbye) a server that holds blocks nobody else serves
        def unique_blocks(peer):
            mine = set(range(*spans[peer]))
            for other, (start, end) in spans.items():
                if other != peer:
                    mine -= set(range(start, end))
            return len(mine)

        victim = max(procs, key=lambda p: unique_blocks(p.peer_id))
        assert unique_blocks(victim.peer_id) > 0
        victim.kill()
        killed_at = time.monotonic()
        survivors = [p for p in procs if p is not victim]

        def recovered():
            records = fetch_block_records(reader, prefix, NUM_BLOCKS)
            if any(victim.peer_id in servers for servers in records):
                return None  # the victim's records have not expired yet
            return online_cover(reader, prefix, exclude=victim.peer_id)

        spans_after = wait_for(recovered, 120, "the survivors to re-cover every block")
        print(f"\nspans {spans} -> {spans_after} after killing {victim.peer_id[-6:]}: "
              f"re-covered in {time.monotonic() - killed_at:.1f}s (records expire after 6s)")
        assert set(spans_after) == {p.peer_id for p in survivors}
        moves = sum(p.log_path.read_text().count("rebalancing: moving") for p in survivors)
        assert 1 <= moves <= 3, [p.log_tail() for p in survivors]

        model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[bootstrap.maddr],
                                                                dht_prefix=prefix)
        try:
            ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
            ours = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            ref = reference_model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            assert ours.tolist() == ref.tolist(), (tokenizer.decode(ours[0]), tokenizer.decode(ref[0]))
        finally:
            model.shutdown()
        for p in survivors:
            assert p.proc.poll() is None, p.log_tail()
    finally:
        terminate_all(procs)


def test_serving_loop_restarts_after_it_dies(model_path, bootstrap, reader):
    """In-process: the refresh fails once and the compute thread dies; the server heals and re-announces."""
    from server.server import Server, ServerConfig

    prefix = f"heal-{uuid.uuid4().hex[:8]}"
    config = ServerConfig(model=model_path, initial_peers=[bootstrap.maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                          block_indices="0:2", update_period=0.5, dht_prefix=prefix, throughput="7.5",
                          attn_cache_tokens=512, expiration=60)  # the offline record must outlive the stop and reads
    server = Server(config)
    original = server.announce
    calls: List[ServerState] = []
    failed = threading.Event()

    async def flaky_announce(state):
        calls.append(state)
        if len(calls) == 4:
            failed.set()
            raise RuntimeError("injected failure while announcing")
        await original(state)

    server.announce = flaky_announce
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", __import__("asyncio").run(server.run())),
                              daemon=True)
    thread.start()
    try:
        wait_for(lambda: failed.is_set() and server.restarts >= 1, 120, "the injected failure and a restart")
        announced = len(calls)
        wait_for(lambda: len(calls) >= announced + 2, 30, "announcements after the restart")

        def announced_online():
            records = fetch_block_records(reader, prefix, NUM_BLOCKS)
            infos = [records[i].get(server.peer_id) for i in (0, 1)]
            return all(i is not None and i.state == ServerState.ONLINE and i.throughput == 7.5 for i in infos)

        wait_for(announced_online, 30, "the record to be online again")
        # the compute thread dies: the next refresh notices and starts a new one
        server.handler.pool.shutdown()
        old_pool = server.handler.pool
        wait_for(lambda: server.handler.pool is not old_pool and server.handler.pool.is_alive(), 30,
                 "a new compute thread")
        assert server.handler.accepting
        peer_id = server.peer_id
    finally:
        server.request_stop()
        thread.join(60)
    assert not thread.is_alive() and result.get("rc") == 0

    def announced_offline():  # a read may miss the record on a loaded machine (a DHT get timing out): read again
        # (with the default lifetime, 2 x update_period = 1 s, a slow stop outlived the offline record itself)
        info = fetch_block_records(reader, prefix, NUM_BLOCKS)[0].get(peer_id)
        return info is not None and info.state == ServerState.OFFLINE

    wait_for(announced_offline, 30, "the record to say offline")


def test_a_moving_server_lets_running_sessions_finish(model_path, bootstrap, reader, tmp_path):
    """A server alone on 0:15 is joined by a pinned twin: it decides to move to the uncovered 15:30, announces
    it (joining there, offline here), keeps serving its open session, and moves once that session closes."""
    import torch

    from swarm import AutoDistributedModelForCausalLM
    from swarm.client.transport.session import InferenceSession

    prefix = f"drain-{uuid.uuid4().hex[:8]}"
    mover = start_placed_servers(model_path, bootstrap, prefix, 1, tmp_path,
                                 ["--num_blocks", "15", "--update_period", "1", "--balance_period", "1",
                                  "--drain_timeout", "120", "--throughput", "10"])[0]
    procs = [mover]
    model = None
    try:
        assert (mover.ready["start"], mover.ready["end"]) == (0, 15)
        model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[bootstrap.maddr],
                                                                dht_prefix=prefix)
        session = InferenceSession(model.manager, max_length=16, start=0, end=15)
        hidden = torch.randn(1, 4, model.config.hidden_size)
        assert session.step(hidden[:, :3]).shape == (1, 3, model.config.hidden_size)
        assert [hop.peer_id for hop in session.chain] == [mover.peer_id]

        procs += start_placed_servers(model_path, bootstrap, prefix, 1, tmp_path,
                                      ["--block_indices", "0:15", "--update_period", "1", "--throughput", "10"])

        def state_at(block):
            info = fetch_block_records(reader, prefix, NUM_BLOCKS)[block].get(mover.peer_id)
            return info.state if info is not None else None

        wait_for(lambda: state_at(15) == ServerState.JOINING and state_at(0) == ServerState.OFFLINE, 60,
                 "the mover to announce that it is leaving 0:15 for 15:30")
        # still draining: the open session goes on, on the old blocks
        assert model.manager.server_info(mover.peer_id).sessions_open == 1
        assert session.step(hidden[:, 3:]).shape == (1, 1, model.config.hidden_size)
        assert state_at(15) == ServerState.JOINING
        session.close()
        wait_for(lambda: state_at(15) == ServerState.ONLINE, 60, "the move to finish once the session closed")
        stats = model.manager.server_info(mover.peer_id)
        assert (stats.start, stats.end, stats.sessions_open) == (15, 30, 0)
        assert "moving anyway" not in mover.log_path.read_text()
    finally:
        if model is not None:
            model.shutdown()
        terminate_all(procs)
