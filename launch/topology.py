"""The one launcher of a local topology: a bootstrap peer, block servers and a gateway as child processes.

`swarmgate up`, the test fixtures and the benchmarks all start their processes here.

- `ManagedProcess` runs one `swarmgate` subcommand (`python -m launch.cli SUBCOMMAND ...`, or a given
  module that stands in for one, e.g. a test-only server) in its own process group with its output in a log
  file; `wait_ready` waits for its `SWARMGATE_READY {json}` line and fails with the log's tail if the process
  exits or the wait times out; `terminate` sends SIGTERM, then SIGKILLs the whole group (a DHT child and its
  p2p daemon included).
- `start_bootstrap`, `start_server(s)`, `start_gateway` build each kind's command line.
- `Topology` (a context manager) owns one bootstrap peer, its servers and gateways, and stops them all on exit
  (also when starting fails half-way) within `STOP_TIMEOUT`: gateways and servers together, then the bootstrap.

`threads=N` (tests, benchmarks on shared cores) gives a process N intra-op threads: `OMP_NUM_THREADS` (unless the
environment already sets it) and `--num_threads N` for servers and gateways. `wrap` prefixes the command line, e.g.
`["ip", "netns", "exec", "ns1"]` runs the process in a network namespace (it keeps the environment, PYTHONPATH
included, and exec's in place, so the process group is still the one `terminate` and `kill` signal).
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
from typing import Dict, List, Optional, Sequence

import psutil

READY = "SWARMGATE_READY "
REPO = Path(__file__).resolve().parents[1]
CLI = "launch.cli"
LOCALHOST = "127.0.0.1"
STOP_TIMEOUT = 8.0  # seconds `Topology.close` gives its processes before SIGKILL
# where a process started without a `log_dir` logs (a fresh `swarmgate-<name>-*.log` file there; default: the system's
# temporary directory); the test suite points it into its own directory, removed after a run that passed
LOG_DIR_ENV = "SWARMGATE_LOG_DIR"


class ManagedProcess:
    """A `swarmgate` subcommand (or `module`, which takes the subcommand's arguments) in its own process group,
    logging to a file."""

    def __init__(self, args: Sequence[str], name: str, env: Optional[Dict[str, str]] = None,
                 log_dir: Optional[str] = None, module: Optional[str] = None, wrap: Sequence[str] = (),
                 cwd: Optional[str] = None):
        """`cwd`: where it runs (default: this checkout; `python -m` imports from there first: another release's
        tree runs that release)."""
        self.name = name
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.log_path = Path(log_dir) / f"{name}.log"
        else:
            directory = os.environ.get(LOG_DIR_ENV) or None
            if directory:
                Path(directory).mkdir(parents=True, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix=f"swarmgate-{name}-", suffix=".log", dir=directory)
            os.close(fd)
            self.log_path = Path(path)
        self._log = open(self.log_path, "w")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        command = [*wrap, sys.executable, "-m", module or CLI, *args]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd or REPO,
                                     start_new_session=True)
        self.ready: Optional[dict] = None

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = 180) -> dict:
        """The JSON of the readiness line; RuntimeError if the process exits first, TimeoutError after `timeout`."""
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
        return next((m for m in self.ready["maddrs"] if LOCALHOST in m), self.ready["maddrs"][0])

    def terminate(self, timeout: float = 30) -> Optional[int]:
        """SIGTERM and wait; then SIGKILL whatever is left of its process group (e.g. a DHT child)."""
        self.signal(signal.SIGTERM)
        self.wait(timeout)
        returncode = self.proc.poll()
        self.kill()
        return returncode

    def signal(self, sig: int) -> None:
        """Send `sig` to the process (not its group) if it is still running."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def signal_tree(self, sig: int) -> None:
        """Send `sig` to the process and every descendant (its DHT child and p2pd are in a process group of their
        own, so `os.killpg` on this process's group no longer reaches them), e.g. SIGSTOP to freeze a host."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass

    def wait(self, timeout: float) -> Optional[int]:
        """Its exit status, waiting up to `timeout` s; None if it is still running."""
        try:
            return self.proc.wait(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the process, its descendants (its DHT child and p2pd run in a group of their own:
        `swarm.runtime.dht_process`) and whatever else is left of its process group."""
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            descendants = []
        for child in descendants:
            try:
                child.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def thread_env(threads: Optional[int]) -> Dict[str, str]:
    """The environment of a process limited to `threads` intra-op threads (an explicit OMP_NUM_THREADS wins)."""
    return {} if threads is None else {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}


def _thread_args(threads: Optional[int]) -> List[str]:
    return [] if threads is None else ["--num_threads", str(threads)]


def wait_all(procs: Sequence[ManagedProcess], timeout: float = 180) -> List[ManagedProcess]:
    """Wait for each process's readiness; if one fails, kill them all and raise."""
    try:
        for p in procs:
            p.wait_ready(timeout)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return list(procs)


def terminate_all(procs: Sequence[ManagedProcess], timeout: float = 30) -> None:
    """SIGTERM to every process at once, wait for them together (up to `timeout` s in all), then SIGKILL the
    groups of any left: stopping n servers costs one shutdown, not n."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.signal(signal.SIGTERM)
    for proc in procs:
        proc.wait(deadline - time.monotonic())
    for proc in procs:
        proc.kill()


def start_bootstrap(host: str = LOCALHOST, port: int = 0, name: str = "dht", *, threads: Optional[int] = None,
                    log_dir: Optional[str] = None, timeout: float = 60, extra: Sequence[str] = (),
                    wrap: Sequence[str] = ()) -> ManagedProcess:
    """A bootstrap DHT peer, ready (its `.maddr` is what servers and clients join); `extra`: more flags."""
    return wait_all([ManagedProcess(["dht", "--host_maddrs", f"/ip4/{host}/tcp/{port}", *extra], name,
                                    env=thread_env(threads), log_dir=log_dir, wrap=wrap)], timeout)[0]


def start_server(model: str, initial_peers: Sequence[str], span: Optional[str] = None, prefix: Optional[str] = None,
                 extra: Sequence[str] = (), *, name: Optional[str] = None, host: str = LOCALHOST,
                 threads: Optional[int] = None, env: Optional[Dict[str, str]] = None, log_dir: Optional[str] = None,
                 module: Optional[str] = None, wrap: Sequence[str] = (), port: int = 0) -> ManagedProcess:
    """A block server serving `span` ("start:end"; None: it places itself) listening on `host:port` (0: any free
    port), not yet waited for. `module` runs instead of `swarmgate server` (it gets the same arguments)."""
    args = [model, "--initial_peers", *initial_peers, "--host_maddrs", f"/ip4/{host}/tcp/{port}"]
    if span is not None:
        args += ["--block_indices", span]
    if prefix is not None:
        args += ["--dht_prefix", prefix]
    args += _thread_args(threads) + list(extra)
    name = name or f"server-{prefix or 'swarm'}-{(span or 'placed').replace(':', '-')}"
    return ManagedProcess(args if module else ["server", *args], name, env={**thread_env(threads), **(env or {})},
                          log_dir=log_dir, module=module, wrap=wrap)


def start_servers(model: str, initial_peers: Sequence[str], spans: Sequence[Optional[str]],
                  prefix: Optional[str] = None, extra: Sequence[str] = (), *, timeout: float = 180,
                  **kwargs) -> List[ManagedProcess]:
    """One server per span, started together and waited for (all killed if one fails); `kwargs` as
    `start_server`'s (but `name`)."""
    procs: List[ManagedProcess] = []
    try:
        for i, span in enumerate(spans):
            name = f"server-{prefix or 'swarm'}-{span.replace(':', '-') if span else f'placed{i}'}"
            procs.append(start_server(model, initial_peers, span, prefix, extra, name=name, **kwargs))
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return wait_all(procs, timeout)


def start_gateway(model: str, initial_peers: Sequence[str], prefix: Optional[str] = None, extra: Sequence[str] = (),
                  *, name: str = "gateway", host: str = LOCALHOST, port: int = 0, threads: Optional[int] = None,
                  env: Optional[Dict[str, str]] = None, log_dir: Optional[str] = None,
                  timeout: Optional[float] = 180, wrap: Sequence[str] = ()) -> ManagedProcess:
    """The HTTP gateway (its URL is `.ready["url"]`), waited for unless `timeout` is None."""
    args = ["gateway", model, "--initial_peers", *initial_peers]
    if prefix is not None:
        args += ["--dht_prefix", prefix]
    args += ["--host", host, "--port", str(port), *_thread_args(threads), *extra]
    proc = ManagedProcess(args, name, env={**thread_env(threads), **(env or {})}, log_dir=log_dir, wrap=wrap)
    return proc if timeout is None else wait_all([proc], timeout)[0]


class Topology:
    """A bootstrap peer, then block servers (one per span), then gateways, all on this host; stopped, last
    started first, when the `with` block ends or `close()` is called.

        with Topology(model, ["0:15", "15:30"], prefix="demo") as swarm:
            url = swarm.add_gateway().ready["url"]
    """

    def __init__(self, model: str, spans: Sequence[Optional[str]] = (), prefix: Optional[str] = None,
                 server_args: Sequence[str] = (), *, name: str = "swarm", host: str = LOCALHOST, dht_port: int = 0,
                 threads: Optional[int] = None, log_dir: Optional[str] = None, ready_timeout: float = 180,
                 dht_args: Sequence[str] = ()):
        self.model, self.spans, self.prefix, self.server_args = model, list(spans), prefix, list(server_args)
        self.dht_args = list(dht_args)
        self.name, self.host, self.dht_port = name, host, dht_port
        self.threads, self.log_dir, self.ready_timeout = threads, log_dir, ready_timeout
        self.procs: List[ManagedProcess] = []
        self.bootstrap: Optional[ManagedProcess] = None
        self.servers: List[ManagedProcess] = []
        self.gateways: List[ManagedProcess] = []

    def _named(self, kind: str) -> str:
        return f"{self.name}-{kind}" if self.name else kind

    @property
    def initial_peers(self) -> List[str]:
        assert self.bootstrap is not None, "start the bootstrap peer first"
        return [self.bootstrap.maddr]

    def start(self) -> "Topology":
        """The bootstrap peer, then the servers of `spans` (ready)."""
        self.bootstrap = start_bootstrap(self.host, self.dht_port, self._named("dht"), threads=self.threads,
                                         log_dir=self.log_dir, extra=self.dht_args)
        self.procs.append(self.bootstrap)
        if self.spans:
            self.add_servers(self.spans)
        return self

    def add_server(self, span: Optional[str] = None, extra: Sequence[str] = (), name: Optional[str] = None,
                   wait: bool = True, prefix: Optional[str] = None, **kwargs) -> ManagedProcess:
        """One more server (under `prefix` instead of the topology's if given; `kwargs` as `start_server`'s);
        waited for unless `wait` is False."""
        index = len(self.servers)
        proc = start_server(self.model, self.initial_peers, span, prefix or self.prefix, [*self.server_args, *extra],
                            name=name or self._named(f"server{index}"), host=self.host,
                            threads=self.threads, log_dir=self.log_dir, **kwargs)
        self.procs.append(proc)
        self.servers.append(proc)
        if wait:
            proc.wait_ready(self.ready_timeout)
        return proc

    def add_servers(self, spans: Sequence[Optional[str]], extra: Sequence[str] = ()) -> List[ManagedProcess]:
        """One server per span, started together, then waited for."""
        procs = [self.add_server(span, extra, wait=False) for span in spans]
        for p in procs:
            p.wait_ready(self.ready_timeout)
        return procs

    def add_gateway(self, name: Optional[str] = None, extra: Sequence[str] = (), host: Optional[str] = None,
                    port: int = 0, wait: bool = True) -> ManagedProcess:
        proc = start_gateway(self.model, self.initial_peers, self.prefix, extra,
                             name=name or self._named(f"gateway{len(self.gateways)}"), host=host or self.host,
                             port=port, threads=self.threads, log_dir=self.log_dir, timeout=None)
        self.procs.append(proc)
        self.gateways.append(proc)
        if wait:
            proc.wait_ready(self.ready_timeout)
        return proc

    def exited(self) -> Optional[ManagedProcess]:
        """A process of this topology that has exited, if any."""
        return next((p for p in self.procs if p.proc.poll() is not None), None)

    def close(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop every process within `timeout` s: SIGTERM to the gateways and servers at once, then to the
        bootstrap peer (so that servers can still announce offline); SIGKILL to the groups of those left."""
        deadline = time.monotonic() + timeout
        rest = [p for p in self.procs if p is not self.bootstrap]
        for stage in (rest[::-1], [p for p in self.procs if p is self.bootstrap]):
            terminate_all(stage, deadline - time.monotonic())
        self.procs.clear()

    def __enter__(self) -> "Topology":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
