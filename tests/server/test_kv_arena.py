"""Sessions on the shared KV arena (`server.compute.kv_arena`) attend together (`server.compute.decode.arena_groups`)
and give what sessions with their own buffers give: over two chunks, in any row order, with a slot left empty in the
middle, with one long session among short ones, and after a slot's earlier session wrote NaNs into it."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from server.compute import decode
from server.compute.blocks import BlockSpan
from server.compute.decode import arena_groups
from server.compute.kv_arena import SLOTS
from swarm.modeling.checkpoint import Checkpoint
from tests.fixtures.family_configs import llama_like_configs

MAX_LENGTH = 96


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("arena-llama")
    AutoModelForCausalLM.from_config(llama_like_configs()["llama"]).save_pretrained(path)
    span = BlockSpan.load(Checkpoint(str(path)), 1, 4, "float32")
    assert span.enable_kv_arena(128)
    return span


def own_buffers(span: BlockSpan, first: int = 1, last: int = 4):
    arena, span.kv_arena = span.kv_arena, None
    try:
        return span.new_session_kv(1, MAX_LENGTH, first, last)
    finally:
        span.kv_arena = arena


def open_pair(span: BlockSpan, prompt: torch.Tensor):
    """The same prompt in an arena session and in one with its own buffers."""
    on, off = span.new_session_kv(1, MAX_LENGTH, 1, 4), own_buffers(span)
    assert on.slot is not None and off.slot is None
    span.forward(prompt, 0, on)
    span.forward(prompt, 0, off)
    return on, off


def step_all(span: BlockSpan, pairs: list, rng: random.Random) -> None:
    """One decode step of every pair, the arena sessions in a shuffled row order; outputs compared."""
    xs = [torch.randn(1, 1, span.hidden_size) for _ in pairs]
    order = list(range(len(pairs)))
    rng.shuffle(order)
    got = span.forward_batch([(xs[i], pairs[i][0].length, pairs[i][0]) for i in order], 1, 4)
    expected = span.forward_batch([(x, off.length, off) for x, (_, off) in zip(xs, pairs)], 1, 4)
    for position, i in enumerate(order):
        assert torch.isfinite(got[position]).all()
        difference = (got[position] - expected[i]).abs().max()
        assert torch.allclose(got[position], expected[i], atol=1e-5, rtol=1e-5), difference


def test_arena_sessions_attend_together_and_match_their_own_buffers(span, monkeypatch):
    torch.manual_seed(1)
    rng = random.Random(1)
    pairs = [open_pair(span, torch.randn(1, 3 + (5 * i) % 17, span.hidden_size)) for i in range(SLOTS + 4)]
    assert len({id(on.slot.chunk) for on, _ in pairs}) == 2  # 16 sessions in one chunk, 4 in a second
    plans = arena_groups(sorted([(1, on) for on, _ in pairs], key=lambda s: (id(s[1].slot.chunk), s[1].slot.index)))
    assert plans is not None and len(plans) == 2  # one call per chunk
    for _ in range(3):
        step_all(span, pairs, rng)
    del pairs[5]  # a slot in the middle of the first chunk goes empty: its row's query is zeros
    gc.collect()
    step_all(span, pairs, rng)
    long_on, long_off = open_pair(span, torch.randn(1, 80, span.hidden_size))  # takes the empty slot
    pairs.append((long_on, long_off))
    # where one long session would make the others read its length, its chunk attends a session at a time
    monkeypatch.setattr(decode, "PER_SESSION_KEYS", 0)
    plans = arena_groups(sorted([(1, on) for on, _ in pairs], key=lambda s: (id(s[1].slot.chunk), s[1].slot.index)))
    assert plans is not None and len(plans) == len(pairs)
    step_all(span, pairs, rng)
    assert [on.length for on, _ in pairs] == [off.length for _, off in pairs]


def test_a_reused_slot_holds_nothing_of_its_last_session(span):
    torch.manual_seed(2)
    rng = random.Random(2)
    pairs = [open_pair(span, torch.randn(1, 4, span.hidden_size)) for _ in range(3)]
    poisoned = span.new_session_kv(1, MAX_LENGTH, 1, 4)
    slot = poisoned.slot.index
    span.forward(torch.full((1, 40, span.hidden_size), float("nan")), 0, poisoned)  # NaN keys and values
    assert torch.isnan(poisoned.keys[0][:, :, :40]).all()
    del poisoned
    gc.collect()
    on, off = open_pair(span, torch.randn(1, 2, span.hidden_size))
    assert on.slot.index == slot
    pairs.append((on, off))
    for _ in range(2):  # its neighbours read its slot up to their own lengths: zeros there now, not NaNs
        step_all(span, pairs, rng)


def test_which_sessions_go_on_the_arena(span):
    assert span.new_session_kv(2, MAX_LENGTH, 1, 4).slot is None  # beams or several rows
    assert span.new_session_kv(1, 129, 1, 4).slot is None  # longer than the arena's capacity
    part = span.new_session_kv(1, MAX_LENGTH, 2, 4)  # blocks 2:4 only: a chunk of its own layers
    whole = span.new_session_kv(1, MAX_LENGTH, 1, 4)
    assert part.slot is not None and whole.slot is not None and part.slot.chunk is not whole.slot.chunk
    assert part.keys[0].shape == (1, span.kv_heads, MAX_LENGTH, span.head_dim)
    x = torch.randn(1, 5, span.hidden_size)
    ref = own_buffers(span, 2, 4)
    assert torch.allclose(span.forward(x, 0, part, 2, 4), span.forward(x, 0, ref, 2, 4), atol=1e-5, rtol=1e-5)
    del part, whole, ref
    gc.collect()
    assert span.kv_arena.chunks() == 0  # every chunk freed with its last session


def test_spans_without_the_arena(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    config = llama_like_configs()["mistral"]
    config.sliding_window = 8
    path = tmp_path_factory.mktemp("arena-mistral")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    span = BlockSpan.load(Checkpoint(str(path)), 0, 2, "float32")
    assert span.enable_kv_arena(128)
    assert span.new_session_kv(1, 64, 0, 2).slot is None  # sliding windows keep ring buffers


def test_a_session_gets_its_own_buffers_when_no_chunk_can_be_mapped(span, monkeypatch):
    from server.compute import kv_arena

    def refuse(*args):
        raise OSError(12, "Cannot allocate memory")  # mmap under strict overcommit

    monkeypatch.setattr(kv_arena, "_map", refuse)
    kv = span.new_session_kv(1, MAX_LENGTH, 1, 3)  # a layer range with no chunk yet
    assert kv.slot is None and kv.keys[0].shape == (1, span.kv_heads, MAX_LENGTH, span.head_dim)
    x = torch.randn(1, 4, span.hidden_size)
    ref = own_buffers(span, 1, 3)
    assert torch.allclose(span.forward(x, 0, kv, 1, 3), span.forward(x, 0, ref, 1, 3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("capacity", [128, 100])  # slots of whole pages, and slots sharing pages with their neighbours
def test_clearing_a_slot_zeroes_it_and_leaves_its_neighbours(capacity):
    from server.compute.kv_arena import Chunk

    chunk = Chunk(2, 2, capacity, 16, torch.float32)
    for buf in chunk.keys + chunk.values:
        buf.fill_(float("nan"))
    chunk.clear(1)
    for buf in chunk.keys + chunk.values:
        assert bool((buf[1] == 0).all())
        assert bool(torch.isnan(buf[0]).all()) and bool(torch.isnan(buf[2]).all())


def test_a_session_collected_under_the_arena_lock_does_not_deadlock():
    """The cycle collector may finalize a session inside any allocation, also one made while the arena's lock is
    held: the finalizer only queues the slot (run in a thread of its own, so that a deadlock fails the test)."""
    import threading

    from server.compute.kv_arena import KVArena

    arena = KVArena(2, 16, 64, torch.float32)

    class Owner:  # stands in for a SessionKV
        pass

    def scenario(out: list) -> None:
        owner = Owner()
        first = arena.assign(owner, 0, 2, 32)
        owner.cycle = owner  # collected by the cycle collector only
        del owner
        with arena._lock:
            gc.collect()  # finalizes the owner while this thread holds the lock
        second = arena.assign(Owner(), 0, 2, 32)
        out.append((first[0].index, second[0].index))

    out: list = []
    worker = threading.Thread(target=scenario, args=(out,), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "deadlocked"
    assert out == [(0, 0)]  # released, cleared and handed out again
