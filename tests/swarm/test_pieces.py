"""Unit tests of pure pieces: tensor serialization, dtype names, message validation, config precedence, a model's
shape, the KV cache."""
from __future__ import annotations

import argparse

import pytest
import torch

from server.compute.cache import SessionKV
from swarm.runtime.config import ConfigError, load_config, parse_span
from swarm.wire import protocol as P
from swarm.wire.dtypes import DTYPES, dtype_name, parse_dtype
from swarm.wire.records import ServerInfo, ServerState, dht_prefix_for, online_spans


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tensor_roundtrip_keeps_dtype_and_values(dtype):
    t = torch.randn(2, 3, 5).to(dtype)
    back = P.deserialize_tensor(P.serialize_tensor(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_tensor_validation():
    proto = P.serialize_tensor(torch.randn(2, 3))
    proto.size[:] = [2, 4]
    with pytest.raises(P.ProtocolError, match="bytes"):
        P.deserialize_tensor(proto)
    proto = P.serialize_tensor(torch.ones(3, dtype=torch.int64))
    with pytest.raises(P.ProtocolError, match="int64"):
        P.deserialize_tensor(proto)
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.deserialize_tensor(P.serialize_tensor(torch.zeros(10, 10)), max_elements=50)


def test_dtype_names_are_the_wire_names():
    for name, dtype in DTYPES.items():
        assert parse_dtype(name) is dtype and dtype_name(dtype) == name
        assert P.serialize_tensor(torch.zeros(1, dtype=dtype)).dtype == name  # what travels on the wire
    assert list(DTYPES) == ["float32", "float16", "bfloat16"]
    with pytest.raises(ValueError, match="unknown dtype 'float8'.*float32, float16, bfloat16"):
        parse_dtype("float8")


@pytest.mark.parametrize("values, head_dim, kv_heads", [
    ({}, 16, 4), ({"head_dim": 32}, 32, 4), ({"num_key_value_heads": 2, "torch_dtype": "bfloat16"}, 16, 2)])
def test_model_shape_from_a_config(values, head_dim, kv_heads):
    from swarm.modeling.model_config import model_config
    from swarm.modeling.shape import ModelShape, head_dim_of

    config = model_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                           "intermediate_size": 128, "num_hidden_layers": 3, **values})
    shape = ModelShape.from_config(config)
    assert (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (64, 4, kv_heads, head_dim)
    assert head_dim_of(config) == config.head_dim == head_dim
    assert (shape.num_layers, shape.intermediate_size, shape.groups, shape.rope_type) == (3, 128, 4 // kv_heads,
                                                                                           "default")
    assert shape.dtype == (torch.bfloat16 if "torch_dtype" in values else None)
    assert shape.cache_bytes_per_token(torch.float16) == 2 * kv_heads * head_dim * 2


def test_messages_reject_unknown_fields_and_versions():
    ok = P.decode(P.encode(P.Step(start_position=3)), P.Step)
    assert ok.start_position == 3
    with pytest.raises(P.ProtocolError, match="version"):
        P.decode(b'{"v": 2, "type": "step", "start_position": 0}', P.Step)
    with pytest.raises(P.ProtocolError, match="Extra inputs"):
        P.decode(b'{"v": 1, "type": "step", "start_position": 0, "x": 1}', P.Step)
    with pytest.raises(P.ProtocolError, match="start_position"):
        P.decode(b'{"v": 1, "type": "step", "start_position": -1}', P.Step)
    with pytest.raises(P.ProtocolError):
        P.decode(b'{"v": 1, "type": "open", "session_id": "", "start": 0, "end": 1, "max_length": 1}', P.OpenSession)


def test_rope_length_is_left_out_while_unset_and_checked_against_the_step():
    """`RowEdits.rope_length` (a field added later) never reaches a server from before it unless set, travels on
    pushes (`row_edits`), and must lie between the message's end and the session's max_length."""
    import json

    assert "rope_length" not in json.loads(P.encode(P.Step(start_position=3)))
    assert "rope_length" not in json.loads(P.encode(P.ForwardRequest(start=0, end=1)))
    step = P.decode(P.encode(P.Step(start_position=3, rope_length=20)), P.Step)
    assert step.rope_length == 20
    pushed = P.PushStep(stream_key="k", start_position=3, step_id=1, **step.row_edits())
    assert P.decode(P.encode(pushed), P.PushStep).rope_length == 20
    P.check_row_edits(step, 1, 32, end=8)
    for end, max_length in ((21, 32), (8, 16)):
        with pytest.raises(P.ProtocolError, match="rope_length"):
            P.check_row_edits(step, 1, max_length, end=end)
    with pytest.raises(P.ProtocolError, match="rope_length"):
        P.decode(b'{"v": 1, "type": "step", "start_position": 0, "rope_length": 0}', P.Step)


def test_training_calls_name_their_adapter_only_when_they_have_one():
    """`TrainForward/TrainBackward.adapter` (added later) is left out on the base model, so servers from before
    still take those calls; set, it round-trips."""
    import json

    for kind in (P.TrainForward, P.TrainBackward):
        assert "adapter" not in json.loads(P.encode(kind(start=0, end=2)))
        assert P.decode(P.encode(kind(start=0, end=2, adapter="a1")), kind).adapter == "a1"
        with pytest.raises(P.ProtocolError, match="adapter"):
            P.decode(P.encode(kind(start=0, end=2)).replace(b'"end":2', b'"end":2,"adapter":""'), kind)


def test_error_reply_raises_remote_error():
    response = P.error_response("bad_request", "nope")
    with pytest.raises(P.RemoteError, match="nope") as info:
        P.unpack_reply(response, "peer")
    assert info.value.code == "bad_request"


def test_config_precedence(tmp_path):
    from server.server import ServerConfig

    yaml_file = tmp_path / "server.yaml"
    yaml_file.write_text("model: from-yaml\nnum_blocks: 3\nupdate_period: 7\n")
    env = {"SWARMGATE_NUM_BLOCKS": "5", "SWARMGATE_ALLOC_TIMEOUT": "9", "SWARMGATE_INITIAL_PEERS": "a,b"}
    cli = argparse.Namespace(config=str(yaml_file), num_blocks="11")
    config = load_config(ServerConfig, cli, environ=env)
    assert config.num_blocks == 11  # CLI beats YAML and env
    assert config.update_period == 7  # YAML beats the default
    assert config.alloc_timeout == 9  # env beats the default
    assert config.initial_peers == ["a", "b"] and config.model == "from-yaml"
    yaml_file.write_text("model: m\nnum_blockz: 3\n")
    with pytest.raises(ConfigError, match="num_blockz"):
        load_config(ServerConfig, argparse.Namespace(config=str(yaml_file)), environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(ServerConfig, argparse.Namespace(config=str(tmp_path / "missing.yaml")), environ={})
    with pytest.raises(ConfigError, match="block_indices"):
        load_config(ServerConfig, argparse.Namespace(model="m", block_indices="3"), environ={})


def test_parse_span():
    assert parse_span("0:15") == (0, 15)
    for bad in ("15:0", "a:b", "3", "-1:2"):
        with pytest.raises(ValueError):
            parse_span(bad)


def test_session_kv_writes_in_place_and_rewinds():
    kv = SessionKV(num_layers=2, batch_size=1, kv_heads=2, head_dim=4, max_length=8, dtype=torch.float32,
                   device=torch.device("cpu"))
    k = torch.randn(1, 2, 3, 4)
    kv.begin_step(0)
    keys, values = kv.update(k, k * 2, 0)
    assert keys.shape == (1, 2, 3, 4) and torch.equal(keys, k) and torch.equal(values, k * 2)
    kv.end_step(3)
    assert kv.length == 3
    kv.begin_step(1)  # rewind: overwrite from position 1
    k2 = torch.randn(1, 2, 1, 4)
    keys, _ = kv.update(k2, k2, 1)
    assert keys.shape == (1, 2, 2, 4) and torch.equal(keys[:, :, 1:], k2)
    kv.end_step(1)
    assert kv.length == 2


def test_records_to_spans():
    def info(start, end, state=ServerState.ONLINE):
        return ServerInfo(state=state, start=start, end=end)

    records = [{"a": info(0, 2)}, {"a": info(0, 2), "b": info(1, 3)},
               {"b": info(1, 3), "c": info(2, 3, ServerState.JOINING)}]
    spans = online_spans(records)
    assert [(s.peer_id, s.start, s.end) for s in spans] == [("a", 0, 2), ("b", 1, 3)]
    assert dht_prefix_for("/tmp/x/SmolLM2-135M-Instruct/") == "smollm2-135m-instruct"
    assert dht_prefix_for("bigscience/bloom-560m") == "bloom-560m"


def test_serial_torch_here_limits_only_the_calling_thread():
    """swarm.runtime.threads: an event-loop thread runs tensor work alone; the compute thread keeps its threads."""
    import subprocess
    import sys

    code = (
        "import threading, torch\n"
        "torch.set_num_threads(2)\n"
        "from swarm.runtime.threads import serial_torch_here\n"
        "seen = {}\n"
        "def loop_thread():\n"
        "    seen['applied'] = serial_torch_here()\n"
        "    torch.ones(1 << 20).add_(1)\n"
        "    seen['loop'] = torch.get_num_threads()\n"
        "t = threading.Thread(target=loop_thread); t.start(); t.join()\n"
        "def compute_thread():\n"
        "    seen['compute'] = torch.get_num_threads()\n"
        "t = threading.Thread(target=compute_thread); t.start(); t.join()\n"
        "print(seen['applied'], seen['loop'], seen['compute'], torch.get_num_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1", "2", "2"]


def test_openmp_spin_is_set_before_torch_loads():
    import os
    import subprocess
    import sys

    code = "import os, swarm, sys; print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")})
    from swarm.runtime.threads import DEFAULT_SPINCOUNT

    assert out.stdout.split() == [str(DEFAULT_SPINCOUNT), "False"]
    user = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GOMP_SPINCOUNT": "77"})
    assert user.stdout.split()[0] == "77"  # the user's setting wins


def test_a_server_asks_for_huge_pages_before_torch_loads_and_a_user_setting_wins():
    import os
    import subprocess
    import sys

    code = ("import os, sys; from swarm.runtime.malloc import tune_allocator_env as t; "
            "print(t(), os.environ.get('THP_MEM_ALLOC_ENABLE'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.split() == ["True", "1", "False"], out.stderr
    user = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**env, "THP_MEM_ALLOC_ENABLE": "0"})
    assert user.stdout.split()[:2] == ["False", "0"]
    late = subprocess.run([sys.executable, "-c", "import torch; " + code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert late.stdout.split()[:2] == ["False", "None"]  # too late once torch is loaded: nothing set


@pytest.mark.parametrize("eos", [2, [2, 7], [3, 10 ** 6], torch.tensor([2], dtype=torch.int32)])
def test_min_new_tokens_processor_matches_transformers(eos):
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    from swarm.client.decoding.sampling import MinNewTokensProcessor

    torch.manual_seed(0)
    ours, theirs = MinNewTokensProcessor(5, 3, eos), MinNewTokensLengthLogitsProcessor(5, 3, eos)
    for length in (5, 7, 8, 9):  # 0 and 2 new tokens: eos masked; 3 and 4: free
        ids, scores = torch.randint(0, 50, (2, length)), torch.randn(2, 50)
        kept = scores.clone()
        expected = theirs(ids, scores)
        assert torch.equal(ours(ids, scores), expected)
        assert torch.equal(scores, kept)  # the caller's logits are left as they were
        masked = 3 if isinstance(eos, list) and eos[0] == 3 else 2
        assert bool(torch.isinf(expected[:, masked]).all()) == (length - 5 < 3)


def test_push_sender_close_ends_its_streams_and_refuses_later_pushes():
    import asyncio

    from server.rpc.push import PushSender, _Channel

    async def scenario():
        sender = PushSender(p2p=None)
        channel = _Channel()
        sender._channels["peer"] = channel
        sender.close()
        hop = type("Hop", (), {"peer_id": "peer", "stream_key": "k"})()
        return channel, sender.push([hop], 0, 0, None), sender._channels

    channel, pushed, channels = asyncio.run(scenario())
    assert channel.queue.get_nowait() is None and not channel.alive  # the stream's request iterator ends
    assert pushed is False and channels == {}


def test_one_token_selection_path_matches_transformers_processors():
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from swarm.client.decoding.sampling import SamplingParams, build_processors, draw, pick_tokens

    torch.manual_seed(0)
    ids, scores = torch.randint(0, 50, (2, 7)), torch.randn(2, 50)
    sampled = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.2,
                               min_new_tokens=3, eos_token_id=2)
    ours = build_processors(SamplingParams.from_generation_config(sampled, 10), prompt_len=5)
    theirs = LogitsProcessorList([MinNewTokensLengthLogitsProcessor(5, 3, 2), RepetitionPenaltyLogitsProcessor(1.2),
                                  TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)])
    assert torch.equal(ours(ids, scores), theirs(ids, scores))
    greedy = SamplingParams.from_generation_config(GenerationConfig(do_sample=False, temperature=0.7, top_k=5), 10)
    assert greedy.greedy and len(build_processors(greedy)) == 0
    # OpenAI's logit_bias: a constant added to those tokens' logits
    biased = build_processors(SamplingParams(max_tokens=1, logit_bias={3: 5.0, 7: -100.0}))(ids, scores)
    expected = scores.clone()
    expected[:, 3] += 5.0
    expected[:, 7] -= 100.0
    assert torch.equal(biased, expected)
    # seeded rows draw from their own generators, the same as one draw per row with that generator
    probs_scores = torch.randn(2, 50)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    picked = pick_tokens(probs_scores, False, gens)
    again = [draw(torch.softmax(row, -1), torch.Generator().manual_seed(s)) for row, s in zip(probs_scores, (1, 2))]
    assert picked.tolist() == again and pick_tokens(probs_scores, True).tolist() == probs_scores.argmax(-1).tolist()


def test_a_sessions_input_history_grows_with_what_was_sent_and_keeps_it():
    """`BoundaryHistory` (what failover replays) holds the positions written, not the session's whole max_length."""
    from swarm.client.transport.session_chain import BoundaryHistory

    history = BoundaryHistory(2, 10_000, 8, torch.float32)
    sent = torch.randn(2, 300, 8)
    for start, end in [(0, 40), (40, 41), (41, 100), (100, 170), (170, 171)]:  # a prompt, decode steps, chunks
        history.write(start, sent[:, start:end])
    assert history.length == 171 and torch.equal(history.read(171), sent[:, :171])
    assert history.buffer.shape[1] <= 2 * 171  # doubling, not max_length
    capacity = history.buffer.shape[1]
    history.write(150, sent[:, 0:120])  # a rewind (say, rejected drafts), then a chunk that ends past the capacity
    assert 150 < capacity < 270 and history.buffer.shape[1] >= 270 and history.length == 270
    assert torch.equal(history.read(270), torch.cat([sent[:, :150], sent[:, 0:120]], dim=1))
    history.reorder([1, 1], 270)
    assert torch.equal(history.read(270)[0], history.read(270)[1])
    small = BoundaryHistory(1, 20, 8, torch.float32)  # never past max_length
    small.write(0, sent[:1, :15])
    small.write(15, sent[:1, 15:20])
    assert small.buffer.shape[1] == 20 and torch.equal(small.read(20), sent[:1, :20])


def test_only_a_call_that_got_no_reply_at_all_is_sent_again():
    """`remote_autograd.no_reply`: a dropped stream is resent to the same server; an unreachable server, an error
    from its handler, a bad reply or a time-out go to failover (a ban and another route) at once."""
    import asyncio

    from hivemind.p2p import P2PHandlerError
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

    from swarm.client.transport.remote_autograd import no_reply
    from swarm.wire import protocol as P
    from swarm.wire import streaming

    dropped = [P.ProtocolError(streaming.EMPTY_STREAM), asyncio.IncompleteReadError(b"", 4), EOFError(),
               ConnectionResetError(), BrokenPipeError()]
    answered = [ControlFailure("Connect failed. msg=failed to dial"), P2PHandlerError("boom"),
                P.ProtocolError("payload has more than 65536 tensor parts"), P.RemoteError("internal", "boom"),
                ConnectionRefusedError(), asyncio.TimeoutError(), ValueError("bad shape")]
    assert [no_reply(e) for e in dropped] == [True] * len(dropped)
    assert [no_reply(e) for e in answered] == [False] * len(answered)
