"""The local-topology launcher (`launch.topology`): readiness, clear failures, clean stops."""
from __future__ import annotations

import pytest

from launch.topology import ManagedProcess, start_bootstrap, start_server


def test_a_process_that_exits_fails_with_its_log_tail():
    proc = ManagedProcess(["nonsense"], "nonsense")
    try:
        with pytest.raises(RuntimeError, match="(?s)nonsense exited with 2.*unknown command"):
            proc.wait_ready(60)
    finally:
        proc.terminate()


def test_a_module_can_stand_in_for_the_cli_and_a_slow_start_times_out():
    # `module` gets the subcommand's arguments: here an HTTP server that never prints the readiness line
    proc = ManagedProcess(["0", "--bind", "127.0.0.1"], "sleeper", module="http.server")
    try:
        with pytest.raises(TimeoutError, match="sleeper not ready after 0.5s"):
            proc.wait_ready(0.5)
    finally:
        assert proc.terminate(timeout=10) is not None  # SIGTERM ends it; the group is killed either way
    assert proc.proc.poll() is not None


@pytest.mark.slow  # starts a DHT peer
def test_bootstrap_is_ready_and_a_failing_server_is_reported(tmp_path):
    dht = start_bootstrap(threads=1)
    try:
        assert dht.ready["peer_id"] and "127.0.0.1" in dht.maddr
        server = start_server(str(tmp_path / "no-such-model"), [dht.maddr], "0:1", "ttopo", threads=1)
        with pytest.raises(RuntimeError, match="exited with 1"):
            server.wait_ready(120)
        server.terminate()
    finally:
        assert dht.terminate() == 0


def test_the_bootstrap_peer_loads_no_model_code():
    """`swarmgate dht` serves no blocks: its module (and the relay-limits check it runs) must not import the model
    families or transformers (about 0.7 s more at every start of a bootstrap peer)."""
    import subprocess
    import sys

    code = ("import sys, launch.bootstrap; "
            "print(sorted(m for m in ('transformers', 'server.config') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
