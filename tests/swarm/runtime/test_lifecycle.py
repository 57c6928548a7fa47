"""`swarm.runtime.lifecycle`: a process that ends through `finish` leaves no temporary directory behind: neither the
`torch-shm-dir-*` of the shared-memory manager torch starts for hivemind's futures nor multiprocessing's `pymp-*`."""
from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import json, multiprocessing.util, os, sys
import psutil, torch, torch.multiprocessing
from swarm.runtime import lifecycle
torch.multiprocessing.set_sharing_strategy("file_system")  # (hivemind's, for its futures' shared memory)
shared = torch.zeros(4).share_memory_()  # starts a torch_shm_manager daemon, which makes its directory
managers = [p for p in psutil.Process().children(recursive=True) if p.name() == "torch_shm_manager"]
sockets = [c.laddr for p in managers for c in p.net_connections(kind="unix")]
dirs = {"shm": sorted({os.path.dirname(path) for path in sockets}), "mp": multiprocessing.util.get_temp_dir()}
print(json.dumps(dirs), flush=True)
lifecycle.finish(0)
"""


def test_finish_removes_the_shared_memory_managers_and_multiprocessings_directories():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    assert out.returncode == 0, out.stderr
    made = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(made["shm"]) == 1 and os.path.basename(made["shm"][0]).startswith("torch-shm-dir-")
    assert os.path.basename(made["mp"]).startswith("pymp-")
    assert not os.path.exists(made["shm"][0]) and not os.path.exists(made["mp"])
