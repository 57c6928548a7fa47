"""What keeps our processes' memory small, each checked for its effect (not for RSS numbers, which vary).

Checkpoint tensors are read into memory of their own (no mapping of the file stays behind), a block server's
imports and blocks need no transformers model module (nor torch._dynamo, nor scipy.optimize), a gateway's imports
need no transformers generation utilities, the compute thread drops a finished task's arguments (a session's KV
cache), and `swarm.runtime.malloc.trim` works where glibc is.
"""
from __future__ import annotations

import gc
import json
import platform
import threading
import weakref

import pytest
import torch

from tests.fixtures.fresh_python import run_python


def test_safetensors_reads_equal_safe_open_and_own_their_memory(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from swarm.modeling.checkpoint import _read_safetensors

    tensors = {
        "f32": torch.randn(3, 5), "bf16": torch.randn(4, 2).to(torch.bfloat16), "f16": torch.randn(7).half(),
        "i64": torch.arange(6).reshape(2, 3), "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4), "u8": torch.arange(10, dtype=torch.uint8),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    names = sorted(tensors)
    got = dict(_read_safetensors(path, names))
    with open("/proc/self/maps") as maps:  # nothing of the file is mapped into the process
        assert str(path) not in maps.read()
    with safe_open(str(path), framework="pt") as f:
        for name in names:
            expected = f.get_tensor(name)
            assert got[name].dtype == expected.dtype and got[name].shape == expected.shape, name
            assert torch.equal(got[name], expected), name


def test_compute_thread_drops_a_finished_tasks_arguments():
    from swarm.runtime.taskpool import PRIORITY_DECODE, TaskPool

    class Cache:  # stands for a session's KV cache, passed to a task
        pass

    pool = TaskPool(adapt_threads=False)
    try:
        plain, batched = Cache(), Cache()
        refs = [weakref.ref(plain), weakref.ref(batched)]
        assert pool.call(PRIORITY_DECODE, lambda cache: 1, plain) == 1
        assert pool.call_batchable(PRIORITY_DECODE, "key", lambda items: [2] * len(items), batched) == 2
        del plain, batched
        gc.collect()
        assert [ref() for ref in refs] == [None, None]  # while the worker waits for its next task
    finally:
        pool.shutdown()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_malloc_trim_works_on_glibc():
    from swarm.runtime import malloc

    junk = [bytearray(1 << 16) for _ in range(256)]
    del junk
    assert malloc.trim()
    results = []  # from any thread, too
    worker = threading.Thread(target=lambda: results.append(malloc.trim()))
    worker.start()
    worker.join(timeout=30)
    assert results == [True]


def test_deferred_scipy_optimize_loads_on_first_use():
    code = (
        "import sys, swarm, hivemind\n"
        "placeholder = type(sys.modules['scipy.optimize']).__name__\n"
        "from hivemind.averaging.load_balancing import load_balance_peers\n"
        "print(placeholder, sum(load_balance_peers(100, [1.0, 3.0])), type(sys.modules['scipy.optimize']).__name__)\n"
    )
    assert run_python(code) == "_Placeholder 100 module"  # linprog (scipy.optimize) ran


def test_transformers_model_classes_load_without_scipy_optimize():
    """transformers' object-detection losses take `linear_sum_assignment` by name at import: a stand-in until it is
    called (the gateway and client model import every model class's base); `from scipy.optimize import` of another
    name, and a submodule, load the real module."""
    code = (
        "import sys, swarm, hivemind, gateway.app\n"
        "from transformers import LlamaForCausalLM\n"
        "loaded = 'scipy.optimize._optimize' in sys.modules\n"
        "from transformers.loss.loss_for_object_detection import linear_sum_assignment\n"
        "rows, cols = linear_sum_assignment([[4, 1, 3], [2, 0, 5], [3, 2, 2]])\n"
        "from scipy.optimize import linprog\n"
        "import scipy.optimize._lsap\n"
        "kind = type(sys.modules['scipy.optimize']).__name__\n"
        "print(loaded, rows.tolist(), cols.tolist(), linprog.__module__, kind)\n"
    )
    assert run_python(code) == "False [0, 1, 2] [1, 0, 2] scipy.optimize._linprog module"
    submodule_first = (
        "import sys, swarm, hivemind\n"
        "import scipy.optimize._lsap as lsap\n"
        "placeholder = type(sys.modules['scipy.optimize']).__name__\n"
        "import scipy.optimize\n"
        "print(placeholder, scipy.optimize.linprog.__name__, scipy.optimize._lsap is lsap)\n"
    )
    assert run_python(submodule_first) == "_Placeholder linprog True"


def test_the_gateway_and_client_model_load_without_transformers_generation_utils():
    """`transformers.generation.utils` (imported by its output classes and beam-search helpers) brings
    torch.distributed's tensor and FSDP modules, torch._dynamo and sympy: about 80 MB that a gateway serving chat
    never uses. The client model imports them when `generate` asks for a dict or for beams."""
    code = (
        "import sys, swarm, gateway.app, swarm.client.model.causal_lm\n"
        "heavy = [m for m in ('transformers.generation.utils', 'torch._dynamo', 'sympy', 'torch.distributed.tensor',"
        " 'swarm.client.decoding.beam') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    assert run_python(code) == "[]"


FAMILIES = ["qwen2", "mixtral", "qwen3_moe", "gemma3_text", "gpt_oss", "deepseek_v3"]


def test_a_block_server_needs_no_transformers_model_module(tmp_path):
    """Config, blocks (with a forward pass) and the client's norm come from swarm.modeling (llama, mixtral, qwen3
    and qwen3_moe, gemma, gpt_oss, deepseek_v3, layers, model_config), for each family in turn in one process (one
    interpreter start for all: what any family imports stays in sys.modules and is named after it)."""
    from tests.fixtures.family_configs import DEEPSEEK
    from tests.fixtures.tiny_checkpoints import save_tiny

    paths = {}
    for family in FAMILIES:
        experts = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                   "deepseek_v3": DEEPSEEK}.get(family, {})
        paths[family] = str(tmp_path / family)
        save_tiny(family, tmp_path / family, None, vocab_size=512, **experts)
    code = (
        "import json, sys, swarm, torch, server.server\n"
        "from server.compute.blocks import BlockSpan\n"
        "from swarm.modeling.checkpoint import Checkpoint\n"
        "from swarm.modeling.families import family_for\n"
        "heavy = {}\n"
        f"for family, path in {paths!r}.items():\n"
        "    checkpoint = Checkpoint(path)\n"
        "    span = BlockSpan.load(checkpoint, 0, 2, 'float32')\n"
        "    kv = span.new_session_kv(1, 8, 0, 2)\n"
        "    span.forward(torch.randn(1, 5, span.hidden_size), 0, kv)\n"
        "    if span.can_batch:\n"
        "        span.forward_batch([(torch.randn(1, 1, span.hidden_size), 5, kv)], 0, 2)\n"
        "    kind = family_for(checkpoint.load_config())\n"
        "    kind.norm(span.hidden_size)\n"
        "    heavy[family] = [m for m in sys.modules if m.startswith('transformers.models.') or m in "
        "('transformers.modeling_utils', 'torch._dynamo', 'scipy.optimize._optimize')]\n"
        "print(json.dumps(heavy))\n"
    )
    assert json.loads(run_python(code)) == {family: [] for family in FAMILIES}


@pytest.mark.parametrize("entry", ["server.server", "gateway.app", "launch.bootstrap"])
def test_entry_points_defer_scipy_and_tune_openmp_before_torch_loads(entry):
    """Code that imports an entry module directly (not through `launch.cli.main`, which imports swarm first): the
    module imports torch and hivemind at its top, and the package inits import `swarm` before, so that
    scipy.optimize stays deferred (320 ms and 35 MB per process) and GOMP_SPINCOUNT is set while it takes effect."""
    code = (
        "import os, sys, launch.cli\n"
        f"import {entry}\n"
        "print(type(sys.modules.get('scipy.optimize')).__name__, os.environ.get('GOMP_SPINCOUNT') is not None)\n"
    )
    assert run_python(code, unset=["GOMP_SPINCOUNT"]) == "_Placeholder True"
