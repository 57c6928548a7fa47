"""Per-token latency and messages per token with and without server-to-server push, for 2 and 3 servers, and
the pause at failover. Starts its own bootstrap peer and servers on loopback; prints one JSON object.

Messages per token are counted from the servers' counters: messages the client sends, pushes between servers,
replies to the client. The failover pause is the longest gap between two tokens of a 40-token greedy
generation in which the server of the last span is SIGKILLed after 10 tokens (a replacement exists), next to
the median gap; `failover_frozen` stops it with SIGSTOP instead (a frozen host or a cut link: no connection
error ever comes, the client's liveness ping finds it silent).
"""
from __future__ import annotations

import json
import signal
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.harness import Clock  # noqa: E402
from launch.topology import Topology  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402

TOPOLOGIES = {"2_servers": ["0:15", "15:30"], "3_servers": ["0:10", "10:20", "20:30"]}
PROMPT = torch.tensor([[1, 504, 3458, 314, 4086, 28, 260, 1345, 2024, 30, 1530, 260, 1029]])


def gaps(times):
    return [b - a for a, b in zip(times[1:], times[2:])]  # skip the prompt -> first token (prefill)


def run_chain(model, peers, new_tokens=48):
    stats = lambda: {p: model.manager.server_info(p) for p in peers}  # noqa: E731
    model.generate(PROMPT, max_new_tokens=4)  # warm-up
    before = stats()
    clock = Clock()
    model.generate(PROMPT, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock)
    after = stats()
    steps = sum(after[p].inference_steps - before[p].inference_steps for p in peers)
    pushed = sum(after[p].steps_from_push - before[p].steps_from_push for p in peers)
    pushes = sum(after[p].pushes_sent - before[p].pushes_sent for p in peers)
    tokens = new_tokens  # prefill + (new - 1) decode steps = new_tokens steps per server
    client_sent = steps - pushed
    return {
        "ms_per_token": round(1000 * statistics.median(gaps(clock.times)), 2),
        "client_messages_per_token": round(client_sent / tokens, 2),
        "server_pushes_per_token": round(pushes / tokens, 2),
        "total_messages_per_token": round((client_sent + pushes + steps) / tokens, 2),
    }


def main() -> None:
    from swarm import AutoDistributedModelForCausalLM

    path = str(prepare_model())
    result = {}
    # one bootstrap peer; each topology's servers under their own DHT prefix, all started before any is waited for
    with Topology(path, name="bench-chain", ready_timeout=300) as topology:
        dht = topology.bootstrap
        servers = {}
        failover = ["0:15", "15:30", "15:30"]
        for name, spans in {**TOPOLOGIES, "failover": failover, "failover_frozen": failover}.items():
            servers[name] = [topology.add_server(span, ["--throughput", "1"], name=f"bench-{name}-{i}", wait=False,
                                                 prefix=f"bench-{name}")
                             for i, span in enumerate(spans)]
        for p in topology.servers:
            p.wait_ready(300)
        for name in TOPOLOGIES:
            peers = [s.peer_id for s in servers[name]]
            for push in (True, False):
                model = AutoDistributedModelForCausalLM.from_pretrained(
                    path, initial_peers=[dht.maddr], dht_prefix=f"bench-{name}", use_push=push)
                result[f"{name}_{'push' if push else 'no_push'}"] = run_chain(model, peers)
                model.shutdown()
        # failover pause: a killed server (its connections reset), a frozen one (SIGSTOP: they stay open, silent)
        for name, stop in (("failover", lambda proc: proc.kill()),
                           ("failover_frozen", lambda proc: proc.signal_tree(signal.SIGSTOP))):
            result[name] = pause_at_failover(path, dht.maddr, servers[name], name, stop)
    print(json.dumps(result))


def pause_at_failover(path: str, maddr: str, servers: list, name: str, stop) -> dict:
    """The longest gap between tokens of a 40-token greedy generation whose last-span server is stopped after 10."""
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=[maddr], dht_prefix=f"bench-{name}")
    by_peer = {s.peer_id: s for s in servers}
    model.generate(PROMPT, max_new_tokens=4)
    stopped = []
    with model.inference_session(max_length=PROMPT.shape[1] + 40) as session:
        def maybe_stop(n):
            if n == 10:
                stopped.append(by_peer[next(h.peer_id for h in session.session.chain if h.start == 15)])
                stop(stopped[-1])

        clock = Clock(maybe_stop)
        model.generate(PROMPT, session=session, max_new_tokens=40, min_new_tokens=40, do_sample=False,
                       streamer=clock)
        failovers = session.session.failovers
    model.shutdown()
    for proc in stopped:
        proc.kill()  # a frozen process would sit out SIGTERM's whole grace period at the end
    g = gaps(clock.times)
    return {"pause_ms": round(1000 * max(g), 1), "median_token_ms": round(1000 * statistics.median(g), 1),
            "failovers": failovers}


if __name__ == "__main__":
    main()
