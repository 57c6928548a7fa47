"""The GPU default path end to end: real server processes with a tiny random Llama checkpoint, the client model on
the same device. The half-precision case runs on the CPU too (CI has no GPU: the CUDA cases skip there).

- bfloat16 and float16 servers (on CUDA: with CUDA graphs) against local transformers in the same dtype on the same
  device. The kernels differ (the servers' fused projections and, on CUDA, graphed attention over the whole cache;
  transformers' modules and SDPA over the filled prefix), so results agree to rounding, not bit for bit. What is
  asserted: along transformers' own greedy sequence, every step's logits within `ROUNDING_STEPS` units of the
  dtype's resolution at the largest logit (bfloat16: 2^-7 of it; float16: 2^-10); our pick equal to transformers'
  wherever its top two logits are further apart than twice our measured difference at that step (at least half
  the steps); and `generate`'s own greedy tokens equal up to the first step where they are not (a tie within
  rounding can go either way);
- nf4 servers (the CUDA default) with graphs against nf4 servers without: token for token, one session and four
  concurrent ones (same kernels for the weights; attention differs only in the last bits, float32 compute).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from launch.topology import start_servers, terminate_all
from swarm import AutoDistributedModelForCausalLM

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROUNDING_STEPS = 8
SHAPE = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, eos_token_id=1, bos_token_id=0,
             tie_word_embeddings=False)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE))
    with torch.no_grad():  # larger logits than the random init's, so that greedy picks are not near-ties
        model.lm_head.weight.mul_(8)
    path = tmp_path_factory.mktemp("gpu-llama")
    model.save_pretrained(path)
    return str(path)


def _swarm(checkpoint, bootstrap, prefix, *extra, device="cuda"):
    return start_servers(checkpoint, [bootstrap.maddr], ["0:2", "2:4"], prefix,
                         ["--device", device, "--throughput", "1", *extra], threads=1)


def _client(checkpoint, bootstrap, prefix, dtype, device="cuda"):
    return AutoDistributedModelForCausalLM.from_pretrained(checkpoint, initial_peers=[bootstrap.maddr],
                                                            dht_prefix=prefix, device=device, torch_dtype=dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_servers_agree_with_transformers_to_rounding(checkpoint, bootstrap, dtype, device):
    from transformers import AutoModelForCausalLM

    name = str(dtype).replace("torch.", "")
    prefix = f"half-{device}-{name}"
    servers = _swarm(checkpoint, bootstrap, prefix, "--torch_dtype", name, "--quant_type", "none", device=device)
    model = _client(checkpoint, bootstrap, prefix, dtype, device)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    try:
        assert all(s.ready["quant_type"] == "none" for s in servers)
        torch.manual_seed(1)
        for prompt in (torch.randint(2, 1000, (1, 9)), torch.randint(2, 1000, (1, 40))):
            with torch.no_grad():
                ref = reference.generate(prompt.to(device), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                         do_sample=False).cpu()
                ref_logits = reference(ref.to(device)).logits[0, prompt.shape[1] - 1:-1].float().cpu()
            ours = model.generate(prompt.to(device), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False).cpu()
            rows = []  # our logits along the reference's sequence, a decode step at a time (CUDA: the graphed path)
            with model.inference_session(max_length=ref.shape[1]) as session:
                for end in range(prompt.shape[1], ref.shape[1]):
                    rows.append(session.feed(ref[:, :end].to(device))[0].float().cpu())
            logits = torch.stack(rows)  # [new_tokens, vocab]
            bound = ROUNDING_STEPS * torch.finfo(dtype).eps * ref_logits.abs().max().item()
            diff = (logits - ref_logits).abs().amax(dim=-1)  # [new_tokens]: each step's largest difference
            assert diff.max().item() <= bound
            # where the reference's top two are further apart than twice our difference, our pick must be its pick
            # (random weights give near-ties everywhere at the rounding bound itself: 2026-11-28 on an H100 and
            # on the CPU)
            top2 = ref_logits.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * diff  # [new_tokens]
            assert int(clear.sum()) >= NEW_TOKENS // 2, "the checkpoint's logits should have clear greedy picks"
            assert logits.argmax(-1)[clear].tolist() == ref_logits.argmax(-1)[clear].tolist()
            # generate's own tokens (its own run, against transformers' cached decoding): up to the first step whose
            # top two are within twice the rounding bound (often none in bfloat16: the picks above carry the test)
            near_tie = ((top2[:, 0] - top2[:, 1]) <= 2 * bound).nonzero()
            checked = int(near_tie[0]) if len(near_tie) else NEW_TOKENS
            new = prompt.shape[1]
            assert ours[0, new:new + checked].tolist() == ref[0, new:new + checked].tolist()
    finally:
        model.shutdown()
        terminate_all(servers)


@CUDA
def test_nf4_servers_with_graphs_equal_nf4_servers_without_token_for_token(checkpoint, bootstrap):
    common = ("--torch_dtype", "float32", "--quant_type", "nf4")
    graphed = _swarm(checkpoint, bootstrap, "gpu-nf4-graphs", *common, "--cuda_graphs")
    eager = _swarm(checkpoint, bootstrap, "gpu-nf4-eager", *common, "--no-cuda_graphs")
    models = [_client(checkpoint, bootstrap, prefix, torch.float32) for prefix in ("gpu-nf4-graphs", "gpu-nf4-eager")]
    try:
        assert all(s.ready["quant_type"] == "nf4" for s in graphed + eager)
        torch.manual_seed(2)
        prompts = [torch.randint(2, 1000, (1, n)).cuda() for n in (5, 11, 17, 23)]

        def run(model, prompt):
            return model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False).cpu().tolist()

        single = {i: [run(model, prompt) for prompt in prompts] for i, model in enumerate(models)}
        assert single[0] == single[1]
        with ThreadPoolExecutor(4) as pool:  # four sessions at once: the servers batch their decode steps
            together = list(pool.map(lambda prompt: run(models[0], prompt), prompts))
        assert together == single[0]
    finally:
        for model in models:
            model.shutdown()
        terminate_all(graphed + eager)
