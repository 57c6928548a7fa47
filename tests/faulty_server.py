"""A test-only block server that answers every inference step after the N-th with an error.

    python -m tests.faulty_server MODEL [swarmgate server flags] --fail_after_steps N

It runs the normal server entry point (`server.server.main`) with a handler whose computation fails once N
steps have been served, so the client sees the handler's ordinary `internal` error reply. The failover tests
start it through `swarm.launch.topology.start_server(..., module="tests.faulty_server")`.
"""
from __future__ import annotations

import sys


def faulty_server(fail_after_steps: int) -> type:
    """A `Server` subclass whose handler fails every inference step after `fail_after_steps` served ones."""
    from server.handler import BlockHandler
    from server.server import Server

    class FaultyHandler(BlockHandler):
        async def _compute(self, *args, **kwargs):
            if self.counters.inference_steps >= fail_after_steps:
                raise RuntimeError(f"injected fault after {fail_after_steps} steps")
            return await super()._compute(*args, **kwargs)

    class FaultyServer(Server):
        handler_class = FaultyHandler

    return FaultyServer


def run(argv: list) -> int:
    from server.server import main

    if "--fail_after_steps" not in argv:
        raise SystemExit("tests.faulty_server needs --fail_after_steps N")
    at = argv.index("--fail_after_steps")
    steps = int(argv[at + 1])
    return main(argv[:at] + argv[at + 2:], server_class=faulty_server(steps))


if __name__ == "__main__":
    from swarm.runtime.threads import tune_openmp_env

    tune_openmp_env()  # as `swarmgate server` does, before torch is imported
    sys.exit(run(sys.argv[1:]))
