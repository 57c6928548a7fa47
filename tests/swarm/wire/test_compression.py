"""Activation compression on the wire (`swarm.wire.compression`): the codecs' sizes and errors, malformed compressed
tensors rejected before decoding, bad `--compression` values as usage errors, and sessions through the shared
two-server swarm asking for float16 (greedy tokens equal transformers' on a float32 swarm) and blockwise8 (last
position logits within `BLOCKWISE8_LOGITS_TOL` of the uncompressed logits, those of local transformers)."""
from __future__ import annotations

import pytest
import torch

from swarm.wire import protocol as P

SPANS = ("0:15", "15:30")
# blockwise8's documented tolerance: max |logit difference| to the uncompressed session over the whole vocabulary
# (measured 0.98 on this prompt, whose logits span about 30; float16: 0.0076), three compressed transfers per step
BLOCKWISE8_LOGITS_TOL = 2.0


@pytest.mark.parametrize("kind,step_bytes,token_bytes,rel_err", [
    ("none", 2304, 2304, 0.0), ("float16", 1152, 1152, 1e-3), ("blockwise8", 1620, 587, 0.02)])
def test_codec_sizes_and_errors(kind, step_bytes, token_bytes, rel_err):
    torch.manual_seed(0)
    step, chunk = torch.randn(1, 1, 576), torch.randn(1, 100, 576)  # a decode step, a 100-token prefill chunk
    assert len(P.serialize_tensor(step, kind).buffer) == step_bytes
    assert len(P.serialize_tensor(chunk, kind).buffer) == 100 * token_bytes
    back = P.deserialize_tensor(P.serialize_tensor(chunk, kind))
    assert back.dtype == torch.float32 and back.shape == chunk.shape
    assert ((back - chunk).norm() / chunk.norm()).item() <= rel_err
    half = torch.randn(2, 3, 576).bfloat16()  # bfloat16 keeps its range: float16 leaves it as it is
    assert P.serialize_tensor(half, "float16").compression == 0
    assert P.deserialize_tensor(P.serialize_tensor(half, "blockwise8")).dtype == torch.bfloat16


def test_malformed_compressed_tensors_are_refused():
    good = P.serialize_tensor(torch.randn(1, 4, 576), "blockwise8")
    for mutate in (lambda t: t.size.__setitem__(1, 5), lambda t: setattr(t, "buffer", t.buffer[:-1]),
                   lambda t: setattr(t, "dtype", "int64"),
                   lambda t: setattr(t, "buffer", (7).to_bytes(8, "little") + t.buffer[8:])):
        bad = type(good)()
        bad.CopyFrom(good)
        mutate(bad)
        with pytest.raises(P.ProtocolError):
            P.deserialize_tensor(bad)
    f16 = P.serialize_tensor(torch.randn(1, 2, 576), "float16")
    f16.dtype = "float16"  # only float32 travels as float16
    with pytest.raises(P.ProtocolError):
        P.deserialize_tensor(f16)


def test_bad_compression_values_are_usage_errors(model_path, capsys):
    from server.server import main
    from swarm.client.transport.manager import ClientConfig

    with pytest.raises(SystemExit) as exit_info:
        main([model_path, "--new_swarm", "--compression", "int4"])
    assert exit_info.value.code == 2 and "compression" in capsys.readouterr().err
    with pytest.raises(ValueError):
        ClientConfig(compression="zip")
    with pytest.raises(P.ProtocolError):
        P.decode(b'{"v": 1, "type": "open", "session_id": "s", "start": 0, "end": 1, "max_length": 8, '
                 b'"compression": "zip"}', P.OpenSession)


@pytest.fixture(scope="module")
def compressed_clients(swarms, model_path):
    from swarm import AutoDistributedModelForCausalLM

    swarm = swarms.get(SPANS)
    made = {kind: AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm["initial_peers"], dht_prefix=swarm["prefix"], compression=kind)
        for kind in ("float16", "blockwise8")}
    yield made
    for model in made.values():
        model.shutdown()


def test_float16_keeps_greedy_text_and_blockwise8_logits_stay_close(compressed_clients, reference_model, tokenizer):
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    ref = reference_model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert compressed_clients["float16"].generate(ids, max_new_tokens=8, min_new_tokens=8,
                                                  do_sample=False).tolist() == ref.tolist()
    with torch.no_grad():  # uncompressed: the swarm's logits equal these within 1e-3 (tests/e2e/test_swarm_e2e.py)
        logits = {"none": reference_model(ref).logits[:, -1]}
    for kind, model in compressed_clients.items():
        with model.inference_session(max_length=ref.shape[1]) as session:
            logits[kind] = session.feed(ref)  # [1, vocab] at the last position
    for kind in ("float16", "blockwise8"):
        print(f"\n{kind}: max |logit - uncompressed| {(logits[kind] - logits['none']).abs().max().item():.4f}")
    assert (logits["float16"] - logits["none"]).abs().max().item() < 0.05
    assert (logits["blockwise8"] - logits["none"]).abs().max().item() < BLOCKWISE8_LOGITS_TOL
    assert logits["blockwise8"].argmax().item() == logits["none"].argmax().item()


def test_a_session_that_asks_for_no_compression_opens_as_before_the_field():
    """Servers from before `OpenSession.compression` reject unknown fields: a session that does not ask for
    compression leaves the field out."""
    import json

    from swarm.wire import protocol as P

    plain = P.OpenSession(session_id="s" * 16, start=0, end=1, max_length=8, batch_size=1)
    assert "compression" not in json.loads(P.encode(plain))
    asked = P.OpenSession(session_id="s" * 16, start=0, end=1, max_length=8, batch_size=1, compression="float16")
    assert P.decode(P.encode(asked), P.OpenSession).compression == "float16"
