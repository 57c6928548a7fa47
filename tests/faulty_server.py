"""A test-only block server that fails or lies: errors after N steps, or perturbed outputs.

    python -m tests.faulty_server MODEL [swarmgate server flags] --fail_after_steps N
    python -m tests.faulty_server MODEL [swarmgate server flags] --perturb_after_steps N [--perturb_every K]
    python -m tests.faulty_server MODEL [swarmgate server flags] --drop_training_replies N

It runs the normal server entry point (`server.server.main`) with a handler that either answers every inference
step after the N-th served one with the handler's ordinary `internal` error reply (`--fail_after_steps`), or,
from each session's N-th step on, adds noise of the output's own scale to what it returns
(`--perturb_after_steps`; with `--perturb_every K`, only every K-th session it opens lies): a malicious server
that spot-checks (`swarm.client.verify`) must catch. Forward passes (what referees run) stay honest. With
`--drop_training_replies N` every other training call, from its first on, until N were, reads its request and
ends without any reply, as a stream dropped in transport does (calls 1, 3, ..., 2N - 1; the others are served).
The tests start it with `start_with_honest` (or
`swarm.launch.topology.start_server(..., module="tests.faulty_server")`).
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, List, Optional, Tuple


def start_with_honest(model_path: str, initial_peers: List[str], prefix: str, fault: List[str],
                      honest_spans: List[str], name: str) -> Tuple[Any, List[Any]]:
    """A faulty server on 0:30 with the flags `fault` (chosen first by routing: throughput 100) and honest servers
    on `honest_spans` (throughput 1), started together, all ready: (faulty, honest); all killed if one fails."""
    from swarm.launch.topology import start_server, start_servers

    faulty = start_server(model_path, initial_peers, "0:30", prefix, ["--throughput", "100", *fault], name=name,
                          threads=1, module="tests.faulty_server")
    try:
        honest = start_servers(model_path, initial_peers, honest_spans, prefix, ["--throughput", "1"], threads=1)
    except BaseException:
        faulty.kill()
        raise
    try:
        faulty.wait_ready()
    except BaseException:
        for proc in (faulty, *honest):
            proc.kill()
        raise
    return faulty, honest


def faulty_server(fail_after_steps: Optional[int] = None, perturb_after_steps: Optional[int] = None,
                  perturb_every: int = 1, drop_training_replies: int = 0) -> type:
    """A `Server` subclass whose handler fails, or perturbs, inference steps as described above."""
    import torch

    from server.handler import BlockHandler
    from server.server import Server

    class FaultyHandler(BlockHandler):
        sessions_seen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # kv -> [ordinal, steps served]
        sessions_opened = 0
        training_calls = 0

        async def _train_rpc(self, requests, context, *args, **kwargs):
            FaultyHandler.training_calls += 1
            if FaultyHandler.training_calls % 2 == 1 and FaultyHandler.training_calls < 2 * drop_training_replies:
                async for _ in requests:  # the whole request, then the stream ends with no reply
                    pass
                return
            async for response in super()._train_rpc(requests, context, *args, **kwargs):
                yield response

        async def _compute(self, hidden, start_position, kv, *args, **kwargs):
            if fail_after_steps is not None and self.counters.inference_steps >= fail_after_steps:
                raise RuntimeError(f"injected fault after {fail_after_steps} steps")
            output = await super()._compute(hidden, start_position, kv, *args, **kwargs)
            if perturb_after_steps is not None:
                if kv not in self.sessions_seen:
                    self.sessions_seen[kv] = [FaultyHandler.sessions_opened, 0]
                    FaultyHandler.sessions_opened += 1
                seen = self.sessions_seen[kv]
                seen[1] += 1
                if seen[1] > perturb_after_steps and seen[0] % perturb_every == 0:
                    output = output + torch.randn_like(output) * output.float().std().to(output.dtype)
            return output

    class FaultyServer(Server):
        handler_class = FaultyHandler

    return FaultyServer


def _pop_flag(argv: list, name: str) -> Optional[int]:
    if name not in argv:
        return None
    at = argv.index(name)
    value = int(argv[at + 1])
    del argv[at:at + 2]
    return value


def run(argv: list) -> int:
    from server.server import main

    argv = list(argv)
    fail = _pop_flag(argv, "--fail_after_steps")
    perturb = _pop_flag(argv, "--perturb_after_steps")
    every = _pop_flag(argv, "--perturb_every") or 1
    drop = _pop_flag(argv, "--drop_training_replies") or 0
    if fail is None and perturb is None and not drop:
        raise SystemExit("tests.faulty_server needs --fail_after_steps N, --perturb_after_steps N or "
                         "--drop_training_replies N")
    return main(argv, server_class=faulty_server(fail, perturb, every, drop))


if __name__ == "__main__":
    from swarm.runtime.threads import tune_openmp_env

    tune_openmp_env()  # as `swarmgate server` does, before torch is imported
    sys.exit(run(sys.argv[1:]))
