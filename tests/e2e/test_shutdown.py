"""Clean shutdown: every process kind (`dht`, `server`, `gateway`, `up`) exits within 10 s of SIGTERM or SIGINT,
sent to the process alone or to its whole process group (what Ctrl-C, systemd and supervisors do), idle or with a
generation running, also when its children (the hivemind DHT process, p2pd) got the signal first; it leaves no
descendant behind and no `Task was destroyed but it is pending!` noise in its log.

Each test starts the process in its own session (`ManagedProcess`), collects its descendants with psutil before
signalling, and checks that none is alive afterwards."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

import httpx
import psutil
import pytest
import torch

from launch import topology
from launch.topology import ManagedProcess

EXIT_DEADLINE = 10.0  # seconds from the signal to the exit, as issue 18 requires (a bound, not a benchmark)
NOISE = ("Task was destroyed but it is pending", "Traceback (most recent call last)", "server failed",
         "gateway failed")
TERM, INT = signal.SIGTERM, signal.SIGINT


def _tree(proc: ManagedProcess) -> List[psutil.Process]:
    root = psutil.Process(proc.proc.pid)
    return [root, *root.children(recursive=True)]


def _alive(procs: List[psutil.Process]) -> List[psutil.Process]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _describe(procs: List[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            out.append(str(p.pid))
    return "; ".join(out)


def stop_and_check(proc: ManagedProcess, sig: signal.Signals, group: bool, children_first: bool = False,
                   min_children: int = 2) -> str:
    """Signal `proc` (alone or its group; its children first if asked), assert it exits within the deadline
    with status 0 and that no descendant is left; return its log."""
    procs = _tree(proc)
    try:
        assert len(procs) - 1 >= min_children, f"expected a DHT child and p2pd: {_describe(procs)}"
        if children_first:
            for child in procs[1:]:
                try:
                    child.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.5)
        if group:
            os.killpg(proc.proc.pid, sig)
        else:
            os.kill(proc.proc.pid, sig)
        try:
            returncode = proc.proc.wait(EXIT_DEADLINE)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{proc.name} still running {EXIT_DEADLINE:.0f}s after {sig.name}; its log:\n"
                        f"{proc.log_tail()}")
        deadline = time.monotonic() + 2  # the parent is gone; the kernel delivers its children's last signals
        while _alive(procs[1:]) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _alive(procs[1:])
        assert not left, f"{proc.name} left descendants behind: {_describe(left)}\n{proc.log_tail()}"
        log = proc.log_path.read_text(errors="replace")
        assert returncode == 0, f"{proc.name} exited with {returncode}:\n{proc.log_tail()}"
        for noise in NOISE:
            assert noise not in log, f"{noise!r} in {proc.name}'s log:\n{proc.log_tail(60)}"
        return log
    finally:
        for p in _alive(procs):
            try:
                p.kill()
            except psutil.Error:
                pass
        proc.kill()


class Generation(threading.Thread):
    """A long streamed completion through a gateway, in the background; `started` once tokens flow."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.started, self.chunks = url, threading.Event(), 0
        self.error: Optional[str] = None

    def run(self) -> None:
        body = {"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
                "ignore_eos": True, "temperature": 0}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as response:
                if response.status_code != 200:
                    self.error = f"HTTP {response.status_code}: {response.read()[:300]!r}"
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks += 1
                        if self.chunks >= 3:
                            self.started.set()
        except httpx.HTTPError as e:
            self.error = self.error or repr(e)

    def wait_tokens(self, proc: ManagedProcess) -> None:
        deadline = time.monotonic() + 120
        while not self.started.wait(0.2):
            assert self.is_alive() and time.monotonic() < deadline, \
                f"no tokens streamed ({self.error}); {proc.name}'s log:\n{proc.log_tail()}"


_counter = iter(range(10**6))


def _prefix(kind: str) -> str:
    return f"sd-{kind}-{os.getpid()}-{next(_counter)}"


def _case_id(case) -> str:
    sig, group, *rest = case
    return f"{sig.name}-{'group' if group else 'alone'}" + (f"-{rest[0]}" if rest and rest[0] else "")


# ---- dht ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [(TERM, False, None), (TERM, True, None), (INT, False, None), (INT, True, None),
                                  (TERM, False, "children-first")], ids=_case_id)
def test_dht_stops(bootstrap, case):
    sig, group, how = case
    proc = topology.start_bootstrap(name=f"sd-dht-{_case_id(case)}", threads=1)
    stop_and_check(proc, sig, group, children_first=how == "children-first")


# ---- server ---------------------------------------------------------------------------------------------------------
def _server(model_path: str, bootstrap, prefix: str) -> ManagedProcess:
    proc = topology.start_server(model_path, [bootstrap.maddr], "0:30", prefix, threads=1,
                                 name=f"{prefix}-server")
    try:
        proc.wait_ready(180)
    except BaseException:
        proc.kill()
        raise
    return proc


def _gateway(model_path: str, bootstrap, prefix: str) -> ManagedProcess:
    proc = topology.start_gateway(model_path, [bootstrap.maddr], prefix, name=f"{prefix}-gateway", threads=1,
                                  timeout=None)
    try:
        proc.wait_ready(180)
    except BaseException:
        proc.kill()
        raise
    return proc


@pytest.mark.parametrize("case", [(TERM, False, None), (TERM, True, None), (INT, True, None), (INT, False, None),
                                  (TERM, True, "children-first"), (TERM, True, "load"), (TERM, False, "load"),
                                  (INT, True, "load")], ids=_case_id)
def test_server_stops(model_path, bootstrap, case):
    sig, group, how = case
    prefix = _prefix("server")
    server = _server(model_path, bootstrap, prefix)
    gateway: Optional[ManagedProcess] = None
    try:
        if how == "load":
            gateway = _gateway(model_path, bootstrap, prefix)
            generation = Generation(gateway.ready["url"])
            generation.start()
            generation.wait_tokens(gateway)
        log = stop_and_check(server, sig, group, children_first=how == "children-first")
        if how != "children-first":  # its DHT peer is intact (group signals reach it no more): it says goodbye
            assert "announced offline" in log, log[-3000:]
    finally:
        server.kill()
        if gateway is not None:
            gateway.terminate()


# ---- gateway --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def steady_server(model_path, bootstrap):
    """(prefix, server): one 0:30 server that stays for the whole module, under the gateways and clients stopped
    here and beside the servers that leave in `test_a_group_stop_announces_offline_before_the_dht_child_goes`."""
    prefix = _prefix("steady")
    server = _server(model_path, bootstrap, prefix)
    yield prefix, server
    server.terminate()


@pytest.fixture(scope="module")
def gateway_swarm(steady_server):
    return steady_server[0]


@pytest.mark.parametrize("case", [(TERM, False, None), (TERM, True, None), (INT, True, None), (INT, False, None),
                                  (TERM, True, "children-first"), (TERM, False, "load"), (TERM, True, "load"),
                                  (INT, True, "load")], ids=_case_id)
def test_gateway_stops(model_path, bootstrap, gateway_swarm, case):
    sig, group, how = case
    gateway = _gateway(model_path, bootstrap, gateway_swarm)
    try:
        if how == "load":
            generation = Generation(gateway.ready["url"])
            generation.start()
            generation.wait_tokens(gateway)
        stop_and_check(gateway, sig, group, children_first=how == "children-first")
    finally:
        gateway.kill()


# ---- up -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [(TERM, False, None), (INT, True, None), (TERM, True, "load")], ids=_case_id)
def test_up_stops(model_path, bootstrap, tmp_path: Path, case):
    sig, group, how = case
    config = tmp_path / "swarm.yaml"
    config.write_text(f"model: {model_path}\ndht_port: 0\nlog_dir: {tmp_path / 'logs'}\n"
                      "servers:\n  - block_indices: '0:30'\n    args: [--num_threads, '1']\n"
                      "gateway:\n  port: 0\n  args: [--num_threads, '1']\n")
    up = ManagedProcess(["up", "--config", str(config)], f"sd-up-{_case_id(case)}", env={"OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 300
        while "Press Ctrl-C" not in up.log_path.read_text(errors="replace"):
            assert up.proc.poll() is None and time.monotonic() < deadline, up.log_tail()
            time.sleep(0.5)
        if how == "load":
            url = next(line.split()[1][:-len("/v1")] for line in up.log_path.read_text().splitlines()
                       if line.startswith("gateway: "))
            generation = Generation(url)
            generation.start()
            generation.wait_tokens(up)
        # up, a bootstrap peer, a server and a gateway, each with its DHT child and p2pd
        stop_and_check(up, sig, group, min_children=9)
    finally:
        up.kill()


# ---- a library client -----------------------------------------------------------------------------------------------
CLIENT_SCRIPT = """
import sys, torch
from swarm import AutoDistributedModelForCausalLM
model = AutoDistributedModelForCausalLM.from_pretrained(sys.argv[1], initial_peers=[sys.argv[2]],
                                                        dht_prefix=sys.argv[3])
with model.inference_session(max_length=16) as session:
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, session=session)
print("generated", out.shape[1])
if sys.argv[4] == "shutdown":
    model.shutdown()
"""


@pytest.mark.parametrize("ending", ["shutdown", "exit"])
def test_client_exits_quietly(model_path, bootstrap, gateway_swarm, ending):
    """A Python client ends (after `shutdown()` or just by exiting) without asyncio noise or a child left."""
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, model_path, bootstrap.maddr, gateway_swarm, ending],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    watched: List[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                watched += [p for p in psutil.Process(proc.pid).children(recursive=True) if p not in watched]
            except psutil.NoSuchProcess:
                break
            time.sleep(0.2)
        output, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "generated 6" in output, output[-3000:]
        assert "Task was destroyed but it is pending" not in output, output[-3000:]
        assert watched, "the client started no DHT process?"
        deadline = time.monotonic() + 2
        while _alive(watched) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(watched), f"left behind: {_describe(_alive(watched))}"
    finally:
        for p in _alive(watched):
            p.kill()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


# ---- several DHT peers in one process ------------------------------------------------------------------------------
def test_a_dht_peer_stopping_fails_only_its_own_calls(bootstrap):
    """An in-process server's DHT peer dying (or shut down) fails its own waiting calls at once, and any later call,
    but not the calls of another DHT peer of the same process (a test's reader, a second in-process server)."""
    import functools

    from swarm.runtime.dht_process import DHTGone, DHTProcess

    mine = DHTProcess(initial_peers=[bootstrap.maddr], client_mode=True, start=True)
    other = DHTProcess(initial_peers=[bootstrap.maddr], client_mode=True, start=True)
    try:
        waiting_mine = mine.run_coroutine(functools.partial(slow, seconds=30), return_future=True)
        waiting_other = other.run_coroutine(functools.partial(slow, seconds=1.5), return_future=True)
        os.kill(mine.pid, signal.SIGKILL)
        with pytest.raises(DHTGone):
            waiting_mine.result(10)
        assert waiting_other.result(20) == "answered"
        with pytest.raises(DHTGone):  # a call after the death fails at once instead of waiting forever
            mine.run_coroutine(functools.partial(slow, seconds=0), return_future=True).result(5)
        mine.shutdown()
        assert other.run_coroutine(functools.partial(slow, seconds=0)) == "answered"
    finally:
        mine.shutdown()
        other.shutdown()


async def slow(_dht, _node, seconds: float) -> str:
    """A DHT call that takes `seconds` (run in the DHT process: module level, to be pickled)."""
    import asyncio

    await asyncio.sleep(seconds)
    return "answered"


# ---- a group stop announces offline first (issue 45) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def offline_swarm(bootstrap, model_path, steady_server):
    """A server that stays (0:30, the module's steady one) and a client that watches the records from another DHT
    peer."""
    from swarm import AutoDistributedModelForCausalLM

    prefix, stays = steady_server
    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[bootstrap.maddr],
                                                            dht_prefix=prefix, pad_head_rows=False)
    yield prefix, stays, model
    model.shutdown()


@pytest.mark.parametrize("sig", [INT, TERM], ids=lambda sig: sig.name)
def test_a_group_stop_announces_offline_before_the_dht_child_goes(model_path, bootstrap, offline_swarm, sig,
                                                                  reference_model):
    """Ctrl-C (SIGINT to the whole process group) or SIGTERM to the group: the DHT child and p2pd no longer get the
    signal (a process group of their own), so the server announces `offline` through them before it stops them.
    Read from another DHT peer right after the exit (no waiting: the record must already say so). A client that was
    generating on the stopped server, whose swarm view (read before the stop) still lists it and prefers it, then
    generates again: its failed connect refreshes the view, which drops the server without a ban, a failed try or a
    failover (no phantom first try), and the tokens are transformers'. A forward pass on that stale view, routed to
    the stopped server, drops it the same way (`SwarmManager.settle_failures`)."""
    from swarm.wire.records import ServerState, fetch_block_records
    from tests.fixtures.swarm_checks import greedy_reference

    prefix, stays, model = offline_swarm
    leaving = _server(model_path, bootstrap, prefix)
    manager = model.manager
    ids = torch.tensor([[1, 2, 3]])
    expected = greedy_reference(reference_model, ids, 3)
    period = manager.config.update_period
    try:
        seen = {span.peer_id for span in manager.allowed_spans(force=True)}  # the view, warm from here on
        assert leaving.peer_id in seen and stays.peer_id in seen, seen
        manager.config.update_period = 3600  # no periodic refresh during the test, however slow the machine
        manager.rtts.update({leaving.peer_id: 1e-4, stays.peer_id: 1.0})  # routing prefers the server that leaves
        with model.inference_session(max_length=16) as session:
            out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, session=session)
            assert [hop.peer_id for hop in session.session.chain] == [leaving.peer_id]
        assert torch.equal(out, expected)
        log = stop_and_check(leaving, sig, group=True)
        assert "announced offline" in log and "could not announce offline" not in log, log[-3000:]
        records = fetch_block_records(manager.dht, prefix, 30)
        states = {records[i][leaving.peer_id].state for i in range(30) if leaving.peer_id in records[i]}
        assert states == {ServerState.OFFLINE}, states  # every block's record, read at once from another peer
        stale = list(manager.spans)
        assert leaving.peer_id in {span.peer_id for span in stale}  # the client's view is still stale
        with model.inference_session(max_length=16) as session:
            out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, session=session)
            assert session.session.failovers == 0
            assert [hop.peer_id for hop in session.session.chain] == [stays.peer_id]
        assert torch.equal(out, expected)
        assert manager.banned() == [], "the server that left was banned: a phantom first try"
        assert leaving.peer_id not in {span.peer_id for span in manager.spans}
        # a forward pass follows the same rule: the stale view again, with the server that left as the (all but
        # certain) pick of the throughput-weighted forward route; it fails there, then goes on with no ban
        manager.spans = [span if span.peer_id != leaving.peer_id else
                         type(span)(span.peer_id, span.start, span.end,
                                    span.info.model_copy(update={"throughput": 1e12})) for span in stale]
        logits = model(ids).logits  # [1, 3, vocab]
        assert torch.equal(logits.argmax(-1), reference_model(ids).logits.argmax(-1))
        assert manager.banned() == [], "the server that left was banned by a forward pass"
        assert leaving.peer_id not in {span.peer_id for span in manager.spans}
    finally:
        manager.config.update_period = period
