"""Starting real swarmgate processes for tests: wait for their readiness line, always clean up.

`SwarmProcess` runs `python -m swarm.launch.cli <args>` with its output in a log file, waits for the
`SWARMGATE_READY {json}` line (failing with the log's tail if the process dies or the wait times out), and
stops it with SIGTERM (then SIGKILL) when the test is done.
"""
from __future__ import annotations

import os
from typing import List, Optional

from swarm.launch.local_swarm import READY, REPO, ManagedProcess  # noqa: F401  (re-exported for tests)


class SwarmProcess(ManagedProcess):
    """A ManagedProcess with test defaults (one intra-op thread unless the test says otherwise)."""

    def __init__(self, args: List[str], name: str, env: Optional[dict] = None):
        super().__init__(args, name, env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})})


def start_bootstrap() -> SwarmProcess:
    p = SwarmProcess(["dht", "--host_maddrs", "/ip4/127.0.0.1/tcp/0"], "dht")
    p.wait_ready(60)
    return p


def start_servers(model: str, initial_peer: str, spans: List[str], prefix: str, extra: List[str] = ()
                  ) -> List[SwarmProcess]:
    procs = [
        SwarmProcess(["server", model, "--initial_peers", initial_peer, "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
                      "--block_indices", span, "--dht_prefix", prefix, "--num_threads", "1", *extra],
                     f"server-{prefix}-{span.replace(':', '-')}")
        for span in spans
    ]
    try:
        for p in procs:
            p.wait_ready()
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return procs
