"""Quantized spans (`--quant_type int8 / nf4`, `swarm.modeling.quantize`) on the bundled model, in-process on the CPU.

The reference is transformers' own bitsandbytes path: `AutoModelForCausalLM.from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))` (per-module `Linear8bitLt` / `Linear4bit` on the unfused weights).
Its hidden states entering block A and leaving block B are fed to / compared with a `BlockSpan` of blocks A:B,
step for step as the reference ran them (a prompt, then one token at a time with its cache): LLM.int8() picks its
outlier columns from all rows of a call, so only the same rows per call give the same values.
"""
from __future__ import annotations

import pytest
import torch

from server.compute.blocks import BlockSpan
from server.placement.memory import block_split, bytes_per_block, quantized_bytes
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.quantize import check_quant_support, quantized_linear, quantized_weight_bytes, resolve_quant_type

A, B = 2, 6  # the span under test
PROMPT = [1, 504, 3458, 314, 253, 1345, 28, 357]
NEXT = [4327, 30, 1567]


@pytest.fixture(scope="module", params=["int8", "nf4"])
def quant_type(request):
    return request.param


@pytest.fixture(scope="module")
def reference(bundled_quantized, quant_type):
    """transformers' quantized model (the session's, tests/fixtures/quant_reference.py): hidden states entering
    block A and leaving block B for the prompt, then for each next token with the cache (incremental), and for the
    whole sequence in one pass."""
    model = bundled_quantized(quant_type)
    steps = []
    with torch.inference_mode():
        out = model(torch.tensor([PROMPT]), use_cache=True, output_hidden_states=True)
        steps.append((out.hidden_states[A], out.hidden_states[B]))
        past = out.past_key_values
        for token in NEXT:
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True, output_hidden_states=True)
            steps.append((out.hidden_states[A], out.hidden_states[B]))
            past = out.past_key_values
        full = model(torch.tensor([PROMPT + NEXT]), output_hidden_states=True)
    return steps, (full.hidden_states[A], full.hidden_states[B])


@pytest.fixture(scope="module")
def span(model_path, quant_type):
    return BlockSpan.load(Checkpoint(model_path), A, B, "float32", "cpu", quant_type)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_prefill_and_decode_match_transformers_bitsandbytes(span, reference, quant_type):
    steps, _ = reference
    kv = span.new_session_kv(1, 32, A, B)
    diffs = []
    position = 0
    for step_in, step_out in steps:
        out = span.forward(step_in, position, kv)  # the prompt (chunked prefill path), then decode steps
        diffs.append(_max_diff(out, step_out))
        position += step_in.shape[1]
    print(f"{quant_type}: max abs diff per step {diffs} (hidden states up to {steps[0][1].abs().max():.0f})")
    assert max(diffs) <= 1e-3


def test_batched_decode_path_matches_transformers(span, reference):
    """The decode steps through `forward_batch` (the server's batched path) give the reference's values."""
    steps, _ = reference
    kv = span.new_session_kv(1, 32, A, B)
    span.forward(steps[0][0], 0, kv)
    position = len(PROMPT)
    for step_in, step_out in steps[1:]:
        (out,) = span.forward_batch([(step_in, position, kv)], A, B)
        assert _max_diff(out, step_out) <= 1e-3
        position += 1


def test_pass_without_cache_matches_transformers(span, reference):
    _, (full_in, full_out) = reference
    assert _max_diff(span.forward(full_in), full_out) <= 1e-3


def test_batched_sessions_equal_single_sessions(span, quant_type):
    """Several sessions (different batch sizes and lengths) decoded in one pass equal each decoded alone; on an int8
    span bit for bit (each session's rows quantized on their own: `swarm.modeling.int8_rows`)."""
    generator = torch.Generator().manual_seed(3)
    sessions = [(2, 5), (1, 9), (3, 2)]  # (batch, prompt length)
    prompts = [torch.randn(b, n, span.hidden_size, generator=generator) for b, n in sessions]
    steps = [torch.randn(b, 1, span.hidden_size, generator=generator) for b, _ in sessions]
    steps[1][..., 5] = 40.0  # a column over LLM.int8()'s threshold in this session's rows
    singles, kvs = [], []
    for prompt, step in zip(prompts, steps):
        for group in (singles, kvs):
            kv = span.new_session_kv(prompt.shape[0], 32, A, B)
            span.forward(prompt, 0, kv)
            if group is singles:
                (out,) = span.forward_batch([(step, prompt.shape[1], kv)], A, B)
                singles.append(out)
            else:
                kvs.append(kv)
    batched = span.forward_batch([(step, p.shape[1], kv) for step, p, kv in zip(steps, prompts, kvs)], A, B)
    diffs = [_max_diff(x, y) for x, y in zip(batched, singles)]
    print(f"{quant_type}: batched vs single max abs diff {diffs}")
    if quant_type == "int8":
        assert not span.sessions_alone
        assert all(torch.equal(x, y) for x, y in zip(batched, singles)), diffs
    assert max(diffs) <= 1e-4


OTHER_PROMPTS = [[1, 2683, 314, 253, 3458, 28, 4327, 30, 1567, 504, 357, 1345], [1, 357, 1567, 30]]


@pytest.fixture(scope="module")
def int8_sessions(bundled_quantized, quant_type):
    """transformers' int8 model (the session's), one session at a time: for PROMPT and OTHER_PROMPTS, the hidden
    states entering block A and leaving block B for the prompt, then for each of NEXT with the cache."""
    if quant_type != "int8":
        pytest.skip("nf4 quantizes weights only: rows of other sessions do not change a session's numbers")
    model = bundled_quantized("int8")
    sessions = []
    with torch.inference_mode():
        for prompt in [PROMPT] + OTHER_PROMPTS:
            out = model.eval()(torch.tensor([prompt]), use_cache=True, output_hidden_states=True)
            steps = [(out.hidden_states[A], out.hidden_states[B])]
            for token in NEXT:
                out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True,
                            output_hidden_states=True)
                steps.append((out.hidden_states[A], out.hidden_states[B]))
            sessions.append(steps)
    return sessions


def test_int8_sessions_merged_are_each_transformers_alone(span, int8_sessions, monkeypatch):
    """Three sessions' prompts as one merged prefill, then their decode steps as merged batches, beside a fourth
    session of random rows with outliers of its own: each of the three is bit for bit what transformers' int8 model
    computes for that session alone; and the merged calls did hold sessions with different outlier columns, and
    ones without any."""
    from swarm.modeling import int8_rows

    seen = []  # per merged int8 call: each group's outlier columns
    grouped = int8_rows.grouped_linear

    def spy(module, x, groups):
        rows = x.reshape(-1, x.shape[-1]).half().abs() >= module.state.threshold
        seen.append([frozenset(rows[r0:r1].any(0).nonzero().view(-1).tolist()) for r0, r1 in groups.bounds])
        return grouped(module, x, groups)

    monkeypatch.setattr(int8_rows, "grouped_linear", spy)
    kvs = [span.new_session_kv(1, 32, A, B) for _ in range(4)]
    assert all(span.can_batch_prefill(kv) for kv in kvs)
    random_rows = torch.randn(1, 6 + len(NEXT), span.hidden_size, generator=torch.Generator().manual_seed(7))
    random_rows[..., 11] = -30.0
    items = [(steps[0][0], 0, kv) for steps, kv in zip(int8_sessions, kvs)] + [(random_rows[:, :6], 0, kvs[3])]
    outs = span.forward_prefill_batch(items, A, B)
    for i, steps in enumerate(int8_sessions):
        assert torch.equal(outs[i], steps[0][1]), f"session {i} prefill: max abs diff {_max_diff(outs[i], steps[0][1])}"
    for n in range(len(NEXT)):
        items = [(steps[1 + n][0], steps[0][0].shape[1] + n, kv) for steps, kv in zip(int8_sessions, kvs)]
        outs = span.forward_batch(items + [(random_rows[:, 6 + n:7 + n], 6 + n, kvs[3])], A, B)
        for i, steps in enumerate(int8_sessions):
            assert torch.equal(outs[i], steps[1 + n][1]), \
                f"session {i} step {n}: max abs diff {_max_diff(outs[i], steps[1 + n][1])}"
    assert len(seen) == 4 * (B - A) * (1 + len(NEXT))  # every projection of every block, merged
    assert any(len({c for c in sets if c}) > 1 for sets in seen)  # sessions with outliers, in different columns
    assert any(not sets[0] and any(sets[1:]) for sets in seen)  # a session without outliers beside ones with


def test_int8_session_computes_what_transformers_does_whatever_runs_beside_it(span, reference, quant_type):
    """A session's steps on an int8 span, set up as a server sets it up (KV arena asked for), batched with another
    session's steps whose rows carry outliers of their own: bit for bit transformers' int8 model. LLM.int8() picks
    its outlier columns from all rows of a call, so a session's numbers must not depend on which other sessions'
    steps a batch happens to hold (timing); nor may the arena's grouped attention change their last bits, which
    the next projection's per-row int8 quantization can turn into a whole int8 step."""
    if quant_type != "int8":
        pytest.skip("nf4 quantizes weights only: rows of other sessions do not change a session's numbers")
    arena = span.enable_kv_arena(64)  # what `server.server` asks for on the CPU
    steps, _ = reference
    generator = torch.Generator().manual_seed(5)
    other_rows = torch.randn(1, 8 + len(NEXT), span.hidden_size, generator=generator)
    other_rows[..., 5] = 40.0  # a column over LLM.int8()'s threshold in every row of the other session
    kv, other = span.new_session_kv(1, 32, A, B), span.new_session_kv(1, 32, A, B)
    ours, _ = span.forward_prefill_batch([(steps[0][0], 0, kv), (other_rows[:, :8], 0, other)], A, B)
    assert torch.equal(ours, steps[0][1])
    for i, (step_in, step_out) in enumerate(steps[1:]):
        _, ours = span.forward_batch([(other_rows[:, 8 + i:9 + i], 8 + i, other), (step_in, len(PROMPT) + i, kv)],
                                     A, B)
        assert torch.equal(ours, step_out), f"step {i}: max abs diff {_max_diff(ours, step_out)}"
    assert not arena  # int8 sessions attend each with its own call


def test_no_float_linear_weight_stays_and_sizes_add_up(span, quant_type):
    import bitsandbytes as bnb

    for name, tensor in list(span.named_parameters()) + list(span.named_buffers()):
        if tensor.is_floating_point():  # only the norms' weights (and biases, none here) stay in float
            assert tensor.dim() == 1, f"{name} is a float tensor of shape {tuple(tensor.shape)}"
    linears = [m for m in span.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)) for m in linears)
    assert all(m.weight.dtype == (torch.int8 if quant_type == "int8" else torch.uint8) for m in linears)
    split = block_split(span.config, A)  # (the family's account, which memory planning counts)
    blocks = B - A
    actual = quantized_weight_bytes(span)
    assert blocks * split.quantized * (1.0 if quant_type == "int8" else 0.5) < actual
    assert len(linears) == blocks * len(split.modules) == blocks * 4  # q;k;v, o, gate;up, down
    # (equal as loaded, tests/server/test_memory_plan.py; this span has run, and bitsandbytes' CPU nf4 kernels
    # keep a used module's absmax in bfloat16: less than planned, never more)
    assert actual <= blocks * quantized_bytes(split.modules, quant_type)
    floats = sum(t.numel() * t.element_size() for t in span.parameters() if t.is_floating_point())
    assert floats == blocks * split.other * 4
    assert actual + floats <= blocks * bytes_per_block(span.config, torch.float32, quant_type)


def test_load_reads_and_quantizes_one_block_at_a_time(model_path, monkeypatch):
    """No read asks for more than one block's tensors (the float copies of the others never coexist)."""
    checkpoint = Checkpoint(model_path)
    blocks_per_read = []
    original = Checkpoint.load_tensors

    def load_tensors(self, select, dtype=None):
        tensors = original(self, select, dtype)
        blocks_per_read.append({name.split(".")[2] for name in tensors})
        return tensors

    monkeypatch.setattr(Checkpoint, "load_tensors", load_tensors)
    BlockSpan.load(checkpoint, 0, 3, "float32", "cpu", "nf4")
    assert blocks_per_read == [{"0"}, {"1"}, {"2"}]


def test_quant_type_resolution_and_support():
    assert resolve_quant_type("auto", "cpu") == "none"
    assert resolve_quant_type("auto", "cuda") == "nf4"
    assert resolve_quant_type("INT8", "cpu") == "int8"
    with pytest.raises(ValueError, match="unknown quant_type 'int4'"):
        resolve_quant_type("int4", "cpu")
    for quant_type in ("none", "int8", "nf4"):
        check_quant_support(quant_type, "cpu")


def test_nf4_outputs_the_cpu_kernel_cannot_compute_are_refused_at_load():
    # bitsandbytes' CPU kernel would assert "N must be divisible by block_n" at the first matmul instead
    with pytest.raises(ValueError, match="nf4 on the CPU needs output sizes divisible by 32: a projection has 48"):
        quantized_linear(torch.randn(48, 64), None, "nf4", torch.float32, torch.device("cpu"))
    module = quantized_linear(torch.randn(96, 64), None, "nf4", torch.float32, torch.device("cpu"))
    assert module(torch.randn(3, 64)).shape == (3, 96)


def test_bad_quant_type_is_a_config_error(model_path, capsys, monkeypatch):
    from pydantic import ValidationError

    from server.config import ServerConfig
    from server.server import main

    with pytest.raises(ValidationError, match="quant_type"):
        ServerConfig(model=model_path, quant_type="int4")
    with pytest.raises(SystemExit) as exit_info:
        main([model_path, "--new_swarm", "--quant_type", "int4"])
    assert exit_info.value.code == 2
    assert "quant_type" in capsys.readouterr().err
    monkeypatch.setenv("SWARMGATE_QUANT_TYPE", "fp8")
    with pytest.raises(SystemExit):
        main([model_path, "--new_swarm"])


def test_unusable_bitsandbytes_exits_before_the_dht(model_path, capsys, monkeypatch):
    import server.network.identity as network_module
    import server.server as server_module

    def fail(quant_type, device, dtype=None):
        raise ValueError(f"--quant_type {quant_type} cannot run on {device} with this bitsandbytes: no kernels")

    started = []
    monkeypatch.setattr(server_module, "check_quant_support", fail)
    monkeypatch.setattr(network_module, "start_dht", lambda config: started.append(config))
    assert server_module.main([model_path, "--new_swarm", "--quant_type", "nf4"]) == 1
    assert "cannot run on cpu" in capsys.readouterr().err
    assert not started


def test_record_and_throughput_key_carry_the_quant_type():
    from server.placement.announce import Announcer
    from server.placement.throughput import cache_key
    from swarm.wire.records import ServerState

    record = Announcer("p", 10.0, 30, torch.float32, lambda: 0, quant_type="nf4")
    assert record.info(ServerState.ONLINE, 0, 1).quant_type == "nf4"
    assert cache_key("m", "cpu", torch.float32, "int8") != cache_key("m", "cpu", torch.float32, "none")


def test_throughput_measures_a_quantized_block(model_path, tmp_path):
    from server.placement.throughput import CACHE_FILE, cache_key, get_throughput

    rate, source = get_throughput("eval", Checkpoint(model_path), "cpu", torch.float32, "float32", cache_root=tmp_path,
                                  quant_type="nf4")
    assert rate > 0 and source == "measured"
    import json

    cached = json.loads((tmp_path / CACHE_FILE).read_text())
    assert cache_key(model_path, "cpu", torch.float32, "nf4") in cached


def test_quant_formats_are_validated_once_and_carry_their_facts():
    from swarm.wire.quant import INT8, NF4, QUANT_TYPES, parse_quant_type, quant_format

    assert QUANT_TYPES == ("none", "int8", "nf4")
    assert parse_quant_type(" NF4 ") == "nf4" and parse_quant_type("auto", allow_auto=True) == "auto"
    for bad, allow_auto in (("auto", False), ("fp8", True), (None, False), (4, True)):
        with pytest.raises(ValueError, match="unknown quant_type .*; choose "):
            parse_quant_type(bad, allow_auto=allow_auto)
    assert quant_format("int8") is INT8 and INT8.sessions_alone and INT8.graph_refusal
    assert NF4.sessions_alone is None and NF4.graph_refusal is None and NF4.bytes_per_module == 64
    assert not quant_format("none").quantized
