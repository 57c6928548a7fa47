"""Gaps filled fast, on real processes: when a server leaves a hole, exactly one of two free servers moves into it,
noticed by the hole watch (`--hole_check_period`), not the slow balance check. The server leaves gracefully
(SIGTERM: it announces its blocks offline) or is SIGKILLed (its record stays `online` until it expires, 240 s
here: the free servers find it dead by pinging it, `server.placement.liveness`)."""
from __future__ import annotations

import time
import uuid

import pytest

from launch.topology import start_server, terminate_all, wait_all
from swarm.wire.records import fetch_block_records, online_spans
from tests.fixtures.swarm_watch import NUM_BLOCKS, online_cover, reader, wait_for  # noqa: F401 (reader: fixture)

MOVED = "rebalancing: moving"


@pytest.mark.parametrize("departure", ["sigterm", "sigkill"])
def test_two_free_servers_exactly_one_fills_the_hole(model_path, bootstrap, reader, reference_model,  # noqa: F811
                                                    tokenizer, tmp_path, departure):
    from swarm import AutoDistributedModelForCausalLM

    prefix = f"gap-{uuid.uuid4().hex[:8]}"
    # A (slow) pins 0:15, B (fast) pins 15:30: both free servers join the weaker half, 0:15, next to A
    pinned = [start_server(model_path, [bootstrap.maddr], span, prefix, threads=1, extra=["--throughput", speed])
              for span, speed in (("0:15", "1"), ("15:30", "100"))]
    procs = list(pinned)
    try:
        wait_all(pinned, 300)
        fast_b = pinned[1]
        free = [start_server(model_path, [bootstrap.maddr], None, prefix, threads=1, name=f"server-{prefix}-free{i}",
                             extra=["--num_blocks", "15", "--throughput", "1", "--balance_period", "600",
                                    "--hole_check_period", "5"])
                for i in range(2)]
        procs += free
        wait_all(free, 300)
        assert all((p.ready["start"], p.ready["end"]) == (0, 15) for p in free), [p.ready for p in free]
        wait_for(lambda: online_cover(reader, prefix), 60, "all four servers online")

        if departure == "sigterm":
            fast_b.terminate()  # B announces its blocks offline and leaves a hole at 15:30
        else:
            fast_b.kill()  # SIGKILL (the whole group, p2pd too): B's records stay online, a hole nobody announces
        left_at = time.monotonic()

        def refilled():
            records = fetch_block_records(reader, prefix, NUM_BLOCKS)
            if departure == "sigterm" and any(fast_b.peer_id in servers and servers[fast_b.peer_id].state.value
                                              != "offline" for servers in records):
                return None
            return online_cover(reader, prefix, exclude=fast_b.peer_id)

        # generous: the balance checks (--balance_period 600: every 300..900 s) could not fill it in time
        spans = wait_for(refilled, 240, "a free server to move into 15:30")
        filled_in = time.monotonic() - left_at
        time.sleep(15)  # three more hole checks: the other free server must stay where it is
        moved = [p for p in free if MOVED in p.log_path.read_text()]
        print(f"\nhole 15:30 served again {filled_in:.1f}s after the departure ({departure}, load included); spans "
              f"{spans}")
        assert len(moved) == 1, [p.log_tail(15) for p in free]
        stayed = next(p for p in free if p is not moved[0])
        final = {s.peer_id: (s.start, s.end) for s in online_spans(fetch_block_records(reader, prefix, NUM_BLOCKS))}
        assert final[moved[0].peer_id] == (15, 30) and final[stayed.peer_id] == (0, 15), final

        model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[bootstrap.maddr],
                                                                dht_prefix=prefix)
        try:
            ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
            ours = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            ref = reference_model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            assert ours.tolist() == ref.tolist()
        finally:
            model.shutdown()
    finally:
        terminate_all(procs)
