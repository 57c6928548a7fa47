"""Training through a real 2-server swarm: gradients equal local autograd through transformers, and bad training
calls get a clear error on that call only."""
from __future__ import annotations

import pytest
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import as_aiter

from swarm import AutoDistributedModelForCausalLM
from swarm.client.transport.session import InferenceSession, SessionError
from swarm.runtime import aio
from swarm.wire import protocol as P
from swarm.wire import streaming
from tests.fixtures.training import check_input_gradients, loss_of, reference_grads, reference_logits

SPANS = ("0:15", "15:30")
TEXTS = ["The capital of France is Paris, and the capital", "A quick brown fox jumps over the lazy dog again",
         "def add(a, b):\n    return a + b  # adds two"]
PRE = 3


@pytest.fixture(scope="module")
def swarm(swarms):
    return swarms.get(SPANS)


def client(model_path, swarm, **kwargs):
    return AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm["initial_peers"], dht_prefix=swarm["prefix"], pad_head_rows=False, **kwargs)


@pytest.fixture(scope="module")
def batch(tokenizer):
    ids = [tokenizer(t)["input_ids"][:9] for t in TEXTS]
    assert all(len(i) == 9 for i in ids)
    return torch.tensor(ids)  # [3, 9]


def test_input_gradients_match_transformers(model_path, swarm, reference_model, batch):
    model = client(model_path, swarm, training_sub_batch_tokens=9)  # one row per sub-batch: 3 in parallel
    try:
        check_input_gradients(model, reference_model, batch)
        assert model.remote_blocks is not None and model.remote_blocks.calls >= 3 * 2 * 2  # sub-batches x hops x passes
    finally:
        model.shutdown()


def test_deep_prompt_gradients_match_transformers(model_path, swarm, reference_model, batch):
    model = client(model_path, swarm, tuning_mode="deep_ptune", pre_seq_len=PRE, training_sub_batch_tokens=24)
    try:
        ptune = model.ptune
        assert ptune is not None and ptune.deep_prompts is not None
        torch.manual_seed(1)
        with torch.no_grad():  # non-zero deep prompts, so that they change the activations
            ptune.deep_prompts.normal_(std=0.05)
        loss = loss_of(model(batch).logits, batch)
        loss.backward()
        ref_loss, (_, ref_prompts, ref_deep) = reference_grads(reference_model, batch, ptune.prompts,
                                                               ptune.deep_prompts)
        assert abs(loss.item() - ref_loss.item()) < 1e-4
        assert ptune.deep_prompts.grad is not None and ptune.prompts.grad is not None
        assert ref_deep.abs().max() > 1e-3
        torch.testing.assert_close(ptune.prompts.grad, ref_prompts, atol=1e-4, rtol=0)
        torch.testing.assert_close(ptune.deep_prompts.grad, ref_deep, atol=1e-4, rtol=0)
    finally:
        model.shutdown()


def _call(model, peer_id, rpc: str, message: P.Message, tensors):
    """One raw training call: (reply message or None, tensors), RemoteError on an error reply."""
    requests = streaming.pack(runtime_pb2.ExpertRequest, message, tensors, chunk_bytes=1 << 16)

    async def run():
        responses = await getattr(model.manager.stub(peer_id), rpc)(as_aiter(*requests))
        return await streaming.read_reply(responses, P.TrainResult, max_bytes=1 << 30, peer_id=peer_id)

    return aio.run(run(), timeout=60)


def test_bad_training_calls_get_clear_errors(model_path, swarm):
    model = client(model_path, swarm)
    try:
        first = next(s for s in model.manager.update(force=True) if s.start == 0)
        hidden = torch.randn(2, 5, 576)
        ok = _call(model, first.peer_id, "rpc_train_forward", P.TrainForward(start=0, end=15), [hidden])
        assert ok[1][0].shape == hidden.shape  # a good call works (chunked: 23 KB in 64 KB parts... and back)
        bad = [
            ("rpc_train_forward", P.TrainForward(start=0, end=15), [torch.randn(2, 5, 100)], "shape"),
            ("rpc_train_forward", P.TrainForward(start=15, end=30), [hidden], "not served here"),
            ("rpc_train_backward", P.TrainBackward(start=10, end=20), [hidden, hidden], "not served here"),
            ("rpc_train_backward", P.TrainBackward(start=0, end=15), [hidden, hidden.clone().fill_(float("nan"))],
             "NaN"),
            ("rpc_train_backward", P.TrainBackward(start=0, end=15), [hidden, hidden[:, :3]], "grad_output"),
            ("rpc_train_backward", P.TrainBackward(start=0, end=15), [hidden], "expected 2 tensors"),
            ("rpc_train_forward", P.TrainForward(start=0, end=2, prompts=True), [hidden, torch.randn(2, 1, 9, 576)],
             "prompts must have shape"),
            ("rpc_train_forward", P.TrainForward(start=0, end=2, prompts=True), [hidden, torch.randn(2, 1, 6, 576)],
             "prompts must have shape"),  # pre_seq_len past the sequence
            ("rpc_train_forward", P.TrainForward(start=0, end=2), [torch.randn(1, 9000, 576)], "exceeds"),
        ]
        for rpc, message, tensors, text in bad:
            with pytest.raises(P.RemoteError, match=text) as info:
                _call(model, first.peer_id, rpc, message, tensors)
            assert info.value.code == "bad_request"
        # the server goes on serving
        again = _call(model, first.peer_id, "rpc_train_backward", P.TrainBackward(start=3, end=5), [hidden, hidden])
        assert again[1][0].shape == hidden.shape
    finally:
        model.shutdown()


def test_deep_prompts_in_inference_sessions_match_transformers(model_path, swarm, reference_model, tokenizer):
    """generate() with trained deep prompts: the servers' sessions add them (sent once with OpenSession) at the
    prompt positions of each block, as in training; greedy tokens equal transformers' recomputed step by step."""
    model = client(model_path, swarm, tuning_mode="deep_ptune", pre_seq_len=PRE, max_retries=0)
    try:
        ptune = model.ptune
        assert ptune is not None and ptune.deep_prompts is not None
        torch.manual_seed(2)
        with torch.no_grad():
            ptune.deep_prompts.normal_(std=0.5)
        ids = tokenizer(TEXTS[0], return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        expected = ids
        with torch.no_grad():
            for _ in range(6):
                embeds = reference_model.get_input_embeddings()(expected)
                logits = reference_logits(reference_model, embeds, ptune.prompts, ptune.deep_prompts)
                expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            plain = reference_model.generate(ids, max_new_tokens=6, do_sample=False)
        assert out.tolist() == expected.tolist()
        assert out.tolist() != plain.tolist()  # the prompts did change the answer
        # prompts longer than the session: refused with a clear error when the session opens
        bad = InferenceSession(model.manager, 4, prompts=torch.randn(30, 1, 5, 576))
        with pytest.raises(SessionError, match="prompts must have shape"):
            bad.open(1)
        bad.close()
    finally:
        model.shutdown()
