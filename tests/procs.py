"""Starting real swarmgate processes for tests: wait for their readiness line, always clean up.

`SwarmProcess` runs `python -m swarm.cli <args>` with its output in a log file, waits for the
`SWARMGATE_READY {json}` line (failing with the log's tail if the process dies or the wait times out), and
stops it with SIGTERM (then SIGKILL) when the test is done.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[1]
READY = "SWARMGATE_READY "


class SwarmProcess:
    def __init__(self, args: List[str], name: str, env: Optional[dict] = None):
        self.name = name
        self.log_path = Path(tempfile.mkstemp(prefix=f"swarmgate-{name}-", suffix=".log")[1])
        self._log = open(self.log_path, "w")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                    **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "swarm.cli", *args], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=full_env, cwd=REPO, start_new_session=True)
        self.ready: Optional[dict] = None

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith(READY):
                    self.ready = json.loads(line[len(READY):])
                    return self.ready
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")

    @property
    def peer_id(self) -> str:
        assert self.ready is not None
        return self.ready["peer_id"]

    @property
    def maddr(self) -> str:
        assert self.ready is not None
        return next(m for m in self.ready["maddrs"] if "127.0.0.1" in m)

    def terminate(self, timeout: float = 30) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)


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
