"""`swarm.runtime.cpu_turns`: a holder of the machine-wide turn that never lets go (a stopped or frozen process)
holds up another process's tasks for `wait` seconds once, not forever; the turns come back when it lets go."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

from swarm.runtime.cpu_turns import WAIT_ENV, CpuTurns, turn_wait

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(3600)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process that holds the turn until it is killed: yields (the lock file's path, the process)."""
    path = str(tmp_path / "turns.lock")
    proc = subprocess.Popen([sys.executable, "-c", HOLD, path], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield path, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(30)


def _free(path: str) -> bool:
    """Whether another open file can take the turn now (then it lets it go)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # (closing the file lets its lock go)
    return True


def test_a_stopped_holder_delays_the_turns_once_and_they_come_back_when_it_goes(holder):
    path, proc = holder
    proc.send_signal(signal.SIGSTOP)  # stopped while it holds the turn
    turns = CpuTurns(path, wait=0.2)
    with turns:  # waits `wait`, then runs without the turn
        pass
    assert (turns.turns, turns.skipped) == (0, 1)
    with turns:  # the holder still has it: no waiting again
        pass
    assert (turns.turns, turns.skipped) == (0, 2)
    proc.send_signal(signal.SIGCONT)
    proc.kill()  # its lock goes with it; the waiter thread takes the turn and lets it go
    proc.wait(30)
    deadline = time.monotonic() + 60  # (only a guard against a hang)
    while not _free(path):
        assert time.monotonic() < deadline, "the waiter kept the turn"
        time.sleep(0.01)
    while turns._stuck:
        assert time.monotonic() < deadline, "the waiter did not see the turn come back"
        time.sleep(0.01)
    with turns:  # turns again
        assert not _free(path)
    assert (turns.turns, turns.skipped) == (1, 2) and _free(path)
    turns.close()


def test_a_turn_given_within_the_wait_is_taken(holder):
    path, proc = holder
    turns = CpuTurns(path, wait=600)
    killer = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(0.2); os.kill({proc.pid}, 9)"])
    with turns:  # the holder lets go (dies) while this task waits
        assert not _free(path)
    killer.wait(30)
    assert (turns.turns, turns.skipped) == (1, 0) and _free(path)
    turns.close()


def test_the_wait_comes_from_the_environment_and_is_checked(monkeypatch):
    monkeypatch.delenv(WAIT_ENV, raising=False)
    assert turn_wait() == 30.0
    monkeypatch.setenv(WAIT_ENV, "2.5")
    assert turn_wait() == 2.5 and CpuTurns("/tmp/x.lock").wait == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv(WAIT_ENV, bad)
        with pytest.raises(ValueError, match=WAIT_ENV):
            turn_wait()
