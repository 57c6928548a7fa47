"""Property-based fuzzing (hypothesis) of the streamed training RPCs of a real block server.

`rpc_train_forward` / `rpc_train_backward` streams are built like the client's (`swarm.wire.streaming.pack`, in
small chunks so that tensors span several messages), then broken: chunks dropped, reordered, duplicated or cut,
metadata repeated, wrong dtypes, shapes and tensor counts, NaN, grad_output of another length, headers that
announce huge tensors or part counts, wrong message types, empty streams. The properties: every call gets a
`TrainResult` with tensors of the right shapes or an `ErrorReply` with a clear code (never `internal`), a valid
call after all that still matches a clean run, an inference session generating greedily through the same servers
meanwhile equals the local reference, and no session, cache token or training stream is left held.
"""
from __future__ import annotations

import asyncio
import time

import torch
from hivemind.proto import runtime_pb2
from hypothesis import given
from hypothesis import strategies as st

from swarm.runtime import aio
from swarm.wire import protocol as P
from swarm.wire import streaming
from tests.fixtures.rpc_fuzzing import (  # noqa: F401  (fuzz_env and honest_reference: fixtures)
    CLEAR_CODES,
    FUZZ,
    HIDDEN,
    HonestSessions,
    fuzz_env,
    honest_reference,
    wait_idle,
)

CHUNK = 4096  # bytes per part: a [1, 4, 576] float32 tensor is already 3 parts


@st.composite
def train_call(draw) -> tuple:
    """(requests, backward, the output shapes of the call as built, verdict: "ok" | "error" | "either"). Chunks of
    one tensor swapped are "either": the stream has no sequence numbers, so the server may compute on the swapped
    values (the caller's own garbage) or refuse a mismatch, but never crash."""
    backward = draw(st.booleans())
    start, end = draw(st.sampled_from([(15, 30), (15, 30), (20, 25), (0, 15), (15, 31), (29, 30)]))
    batch, seq = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    with_prompts = draw(st.booleans()) and draw(st.booleans())
    kind = P.TrainBackward if backward else P.TrainForward
    message = kind(start=start, end=end, prompts=with_prompts)
    hidden = torch.randn(batch, seq, HIDDEN)
    tensors = [hidden] + ([torch.randn(batch, seq, HIDDEN)] if backward else [])
    if with_prompts:
        tensors.append(torch.randn(end - start, draw(st.sampled_from([1, batch])), draw(st.integers(1, seq)), HIDDEN))
    corruption = draw(st.sampled_from(
        ["none"] * 4 + ["nan", "dtype", "grad_length", "drop_tensor", "extra_tensor", "shape", "wrong_type",
                        "prompts_flag", "int_dtype"]))
    if corruption == "nan":
        tensors[draw(st.integers(0, len(tensors) - 1))].view(-1)[0] = draw(st.sampled_from([float("nan"),
                                                                                          float("inf")]))
    elif corruption == "dtype":
        index = draw(st.integers(0, len(tensors) - 1))
        tensors[index] = tensors[index].to(draw(st.sampled_from([torch.float16, torch.bfloat16])))
    elif corruption == "grad_length" and not backward:
        corruption = "none"
    elif corruption == "grad_length":
        tensors[1] = torch.randn(batch, seq + draw(st.integers(1, 3)), HIDDEN)
    elif corruption == "drop_tensor":
        tensors.pop(draw(st.integers(0, len(tensors) - 1)))
    elif corruption == "extra_tensor":
        tensors.append(torch.randn(1, 1, HIDDEN))
    elif corruption == "shape":
        tensors[0] = torch.randn(*draw(st.sampled_from([(batch, seq, 64), (batch, seq), (0, seq, HIDDEN),
                                                        (batch, 0, HIDDEN), (1, 1, 1, HIDDEN)])))
    elif corruption == "wrong_type":
        message = draw(st.sampled_from([P.TrainResult(), P.ForwardRequest(start=15, end=30),
                                        P.Step(start_position=0), kind(start=15, end=30, prompts=True)
                                        if not with_prompts else kind(start=15, end=30)]))
    elif corruption == "prompts_flag":
        message = kind(start=start, end=end, prompts=not with_prompts)
    elif corruption == "int_dtype":
        tensors[0] = torch.zeros(batch, seq, HIDDEN, dtype=torch.int64)
    clean = corruption in ("none", "dtype") and 15 <= start < end <= 30
    requests = streaming.pack(runtime_pb2.ExpertRequest, message, tensors, CHUNK)
    # one corruption at a time: a dropped chunk could undo an extra tensor
    stream_corruption = "none" if corruption not in ("none", "dtype") else draw(st.sampled_from(
        ["none"] * 2 + ["drop", "swap", "duplicate", "cut_buffer", "metadata_again", "huge_header", "many_parts",
                        "empty", "headerless", "no_metadata", "wire_dtype"]))
    verdict = ("ok" if clean else "error") if stream_corruption == "none" else "error"
    parts = [(i, j) for i, r in enumerate(requests) for j in range(len(r.tensors))]
    if stream_corruption in ("drop", "swap", "duplicate", "cut_buffer") and parts:
        i, j = parts[draw(st.integers(0, len(parts) - 1))]
        part = requests[i].tensors[j]
        if stream_corruption == "drop":
            del requests[i].tensors[j]
        elif stream_corruption == "swap":
            k, m = parts[draw(st.integers(0, len(parts) - 1))]
            verdict = ("either" if clean else "error") if (k, m) != (i, j) else ("ok" if clean else "error")
            other = runtime_pb2.Tensor()
            other.CopyFrom(requests[k].tensors[m])
            requests[k].tensors[m].CopyFrom(part)
            requests[i].tensors[j].CopyFrom(other)
        elif stream_corruption == "duplicate":
            requests[i].tensors.insert(j, part)
        else:
            part.buffer = part.buffer[:draw(st.integers(0, max(0, len(part.buffer) - 1)))]
    elif stream_corruption == "metadata_again":
        requests.append(runtime_pb2.ExpertRequest(metadata=P.encode(message)))
    elif stream_corruption == "huge_header" and requests[0].tensors:
        header = requests[0].tensors[0]
        del header.size[:]
        header.size.extend([draw(st.integers(10**4, 2**31)), 4096, HIDDEN])
    elif stream_corruption == "many_parts" and requests[0].tensors:
        requests[0].tensors[0].chunks = draw(st.integers(2**16, 2**31 - 1))
    elif stream_corruption == "wire_dtype" and requests[0].tensors:
        requests[0].tensors[0].dtype = draw(st.sampled_from(["float64", "int8", "bool", "", "x" * 300]))
    elif stream_corruption == "empty":
        requests = []
    elif stream_corruption == "headerless":
        requests.append(runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=b"\x00" * 16)]))
    elif stream_corruption == "no_metadata":
        requests[0].metadata = b""
    shapes = [(batch, seq, HIDDEN)] + ([tuple(tensors[-1].shape)] if backward and with_prompts else [])
    return requests, backward, shapes, verdict, (corruption, stream_corruption)


async def _call(stub, backward: bool, requests: list):
    async def gen():
        for request in requests:
            yield request

    rpc = stub.rpc_train_backward if backward else stub.rpc_train_forward
    for attempt in range(2):
        try:
            return await streaming.read_reply(await rpc(gen()), P.TrainResult, max_bytes=1 << 30)
        except P.RemoteError as e:
            return e
        except P.ProtocolError as e:
            # rarely (about 1 in 1000 calls under load) hivemind closes the stream before the reply has gone out:
            # the call is retried once and must then get its reply
            if attempt or "empty stream" not in str(e):
                raise


def _valid_forward(stub) -> torch.Tensor:
    torch.manual_seed(0)
    requests = streaming.pack(runtime_pb2.ExpertRequest, P.TrainForward(start=15, end=30),
                              [torch.randn(1, 3, HIDDEN)], CHUNK)
    result = aio.run(asyncio.wait_for(_call(stub, False, requests), 120))
    assert not isinstance(result, P.RemoteError), result
    return result[1][0]


def test_fuzzed_training_streams(fuzz_env, honest_reference):
    manager, swarm, model = fuzz_env
    peer = swarm["servers"][1].peer_id
    stub = manager.stub(peer)
    ids, expected = honest_reference
    before = _valid_forward(stub)

    @FUZZ
    @given(train_call())
    def fuzz(case):
        requests, backward, shapes, verdict, _ = case
        result = aio.run(asyncio.wait_for(_call(stub, backward, requests), 120))
        if isinstance(result, P.RemoteError):
            assert result.code in CLEAR_CODES and len(result.message) > 5, result
            assert verdict != "ok", f"a valid call was refused: {result}"
        else:
            _, out = result
            assert verdict != "error", "a broken call was answered"
            assert [tuple(t.shape) for t in out] == shapes and all(torch.isfinite(t).all() for t in out)

    with HonestSessions(model, ids) as honest:
        fuzz()
    assert honest.error is None, honest.error
    assert honest.outputs and all(out == expected for out in honest.outputs)
    assert torch.equal(_valid_forward(stub), before)  # the server computes as before
    stats = wait_idle(manager, peer)
    deadline = time.monotonic() + 30
    while stats.streams_open and time.monotonic() < deadline:  # every training call's stream slot came back
        time.sleep(0.2)
        stats = manager.server_info(peer)
    assert (stats.sessions_open, stats.cache_tokens_used, stats.streams_open) == (0, 0, 0), stats
