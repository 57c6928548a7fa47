"""A client model's lifecycle (issue 45): `with`, `close()` (beside `shutdown()`), and a model that is simply dropped
all release its DHT process and p2p daemon; making and dropping many models leaves this process with the same child
processes and open files as before. On a real bootstrap peer (no server needed: a model joins the DHT at load)."""
from __future__ import annotations

import gc
import time
from typing import Tuple

import psutil
import pytest

from swarm import AutoDistributedModelForCausalLM


def _resources() -> Tuple[int, int]:
    """(live child processes, open file descriptors) of this test process."""
    me = psutil.Process()
    children = [p for p in me.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    return len(children), me.num_fds()


def _settled(before: Tuple[int, int], timeout: float = 30.0) -> Tuple[int, int]:
    """The resources once they are back to `before`, or what they are after `timeout` s (a stopping child takes a
    moment to be reaped): a bound, never a timing assertion."""
    deadline = time.monotonic() + timeout
    now = _resources()
    while (now[0] > before[0] or now[1] > before[1]) and time.monotonic() < deadline:
        time.sleep(0.2)
        gc.collect()
        now = _resources()
    return now


def _load(model_path: str, bootstrap):
    return AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[bootstrap.maddr],
                                                           dht_prefix="lifecycle", pad_head_rows=False)


@pytest.mark.parametrize("count", [3, 20])
def test_dropped_models_release_their_processes_and_files(model_path, bootstrap, count):
    """`count` models, each ended one of three ways in turn: a `with` block, `close()`, or `del` and a collection
    (the finalizer). Every model had its own DHT child and p2pd while it lived; afterwards none is left."""
    _load(model_path, bootstrap).close()  # the first load opens files that stay (imports, torch's thread pools)
    gc.collect()
    before = _settled(_resources())
    grew = []
    for i in range(count):
        if i % 3 == 0:
            with _load(model_path, bootstrap) as model:
                grew.append(_resources()[0] - before[0])
            assert model.closed
        elif i % 3 == 1:
            model = _load(model_path, bootstrap)
            grew.append(_resources()[0] - before[0])
            model.close()
            model.shutdown()  # a second close does nothing
            assert model.closed
        else:
            model = _load(model_path, bootstrap)
            grew.append(_resources()[0] - before[0])
        del model
        gc.collect()
    assert min(grew) >= 2, grew  # a live model has its DHT process and p2pd
    after = _settled(before)
    assert after[0] <= before[0], f"child processes: {before[0]} before, {after[0]} after {count} models"
    assert after[1] <= before[1], f"open files: {before[1]} before, {after[1]} after {count} models"
