"""BLOOM and Falcon (both layouts, rotary and ALiBi) on tiny random checkpoints the tests build and save sharded,
with the bundled model's real tokenizer: the server's block span against transformers running the same checkpoint
(no cache, prefill + batched decode, chunked prefill), then real swarms of two servers split mid-model (greedy
tokens and logits, a two-turn session, concurrent sessions batched on the servers), quantized servers, and the
gateway (completions; chat completions, or a clear 400 where the tokenizer has no chat template)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.fixtures.family_configs import bloom_falcon_config, build_bloom_falcon

VOCAB = 49152  # the bundled SmolLM2 tokenizer's
PROMPTS = ["The history of the Roman Empire begins", "def fibonacci(n):\n    ", "Three things every gardener"]


CASES = ["bloom", "bloom-post-ln", "falcon-new", "falcon-mq", "falcon-seq", "falcon-alibi", "falcon-alibi-new"]


@pytest.mark.parametrize("case", CASES)
def test_block_span_computes_what_transformers_computes(case, tmp_path, model_path):
    """The server's span (loaded from the sharded checkpoint) inside transformers' own embeddings and head."""
    from server.compute.blocks import BlockSpan
    from swarm.modeling.checkpoint import Checkpoint

    reference = build_bloom_falcon(case, tmp_path, model_path)
    config = reference.config
    blocks = config.num_hidden_layers
    span = BlockSpan.load(Checkpoint(str(tmp_path)), 0, blocks)
    ids = torch.randint(3, VOCAB, (2, 11))
    model = reference.transformer

    def head(hidden: torch.Tensor) -> torch.Tensor:
        return reference.lm_head(model.ln_f(hidden))

    with torch.no_grad():
        expected = reference(ids).logits  # [2, 11, vocab]
        hidden = model.word_embeddings(ids)
        if config.model_type == "bloom":
            hidden = model.word_embeddings_layernorm(hidden)
        assert (head(span(hidden)) - expected).abs().max() < 1e-4  # no cache: the layer modules
        kv = span.new_session_kv(2, 32, 0, blocks)
        parts = [span(hidden[:, :4], 0, kv), span(hidden[:, 4:9], 4, kv)]  # a prefill, then a chunk after it
        # decode steps of two "sessions" (the batch's rows, each with its own cache) in one batched pass
        kv_other = span.new_session_kv(1, 32, 0, blocks)
        span(hidden[1:, :9], 0, kv_other)
        kv_first = span.new_session_kv(1, 32, 0, blocks)
        span(hidden[:1, :9], 0, kv_first)
        for position in (9, 10):
            steps = span.forward_batch([(hidden[:1, position:position + 1], position, kv_first),
                                        (hidden[1:, position:position + 1], position, kv_other)], 0, blocks)
            parts.append(torch.cat(steps))
        got = head(torch.cat(parts, dim=1))
    assert (got - expected).abs().max() < 1e-4


def test_configs_map_to_the_common_sizes(tmp_path):
    from swarm.modeling.checkpoint import Checkpoint
    from swarm.modeling.shape import ModelShape

    expected = {"bloom": (4, 4, 256), "falcon-new": (8, 2, 256), "falcon-mq": (4, 1, 256), "falcon-seq": (4, 4, 256)}
    for case, (heads, kv_heads, intermediate) in expected.items():
        bloom_falcon_config(case).save_pretrained(tmp_path / case)
        shape = ModelShape.from_config(Checkpoint(str(tmp_path / case)).load_config())
        assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.intermediate_size, shape.head_dim) == (
            4, heads, kv_heads, intermediate, 64 // heads), case
    # an older BLOOM file's names for the sizes
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps({"model_type": "bloom", "n_embed": 128, "n_layer": 3,
                                                              "n_head": 8}))
    shape = ModelShape.from_config(Checkpoint(str(tmp_path / "old")).load_config())
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.intermediate_size) == (128, 3, 8, 512)


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
def test_quantized_span_stays_close(quant_type, tmp_path, model_path):
    """int8 / nf4 swap each projection for a bitsandbytes module; outputs stay near the float span's."""
    pytest.importorskip("bitsandbytes")
    from server.compute.blocks import BlockSpan
    from swarm.modeling.checkpoint import Checkpoint

    build_bloom_falcon("falcon-new", tmp_path, model_path)
    checkpoint = Checkpoint(str(tmp_path))
    float_span = BlockSpan.load(checkpoint, 0, 4)
    span = BlockSpan.load(checkpoint, 0, 4, quant_type=quant_type)
    assert span.quant_type == quant_type and not any(
        type(m) is torch.nn.Linear or type(m).__name__ == "FalconLinear" for m in span.modules())
    hidden = torch.randn(1, 6, 64)
    expected = float_span(hidden)
    kv = span.new_session_kv(1, 16, 0, 4)
    got = torch.cat([span(hidden[:, :5], 0, kv), span.forward_batch([(hidden[:, 5:], 5, kv)], 0, 4)[0]], dim=1)
    assert torch.isfinite(got).all()
    assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.95


# ---- real swarms ---------------------------------------------------------------------------------------------

SWARM_CASES = ["bloom", "falcon-new", "falcon-mq", "falcon-alibi"]


@pytest.fixture(scope="module", params=SWARM_CASES)
def family_swarm(request, tmp_path_factory, model_path, bootstrap):
    """A tiny checkpoint of the case, two servers split mid-model, a client model, the local reference."""
    from transformers import AutoTokenizer

    from launch.topology import start_servers, terminate_all
    from swarm import AutoDistributedModelForCausalLM

    case = request.param
    path = tmp_path_factory.mktemp(case)
    reference = build_bloom_falcon(case, path, model_path, chat_template=not case.startswith("bloom"))
    prefix = f"tbf-{case}"
    # split mid-model, and a spare for the second half that `test_failover_replays_the_session` kills one of
    servers = start_servers(str(path), [bootstrap.maddr], ["0:2", "2:4", "2:4"], prefix, threads=1)
    model = None
    try:
        model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=[bootstrap.maddr],
                                                                dht_prefix=prefix, ban_timeout=60, step_timeout=30,
                                                                max_retries=2)
        yield dict(case=case, path=path, prefix=prefix, servers=servers, model=model, reference=reference,
                   tokenizer=AutoTokenizer.from_pretrained(path), initial_peers=[bootstrap.maddr])
    finally:
        if model is not None:
            model.shutdown()
        terminate_all(servers)


def _prompt_ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt")["input_ids"]


def _greedy(reference, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        return reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)


def test_greedy_tokens_and_logits_equal_transformers(family_swarm):
    model, reference, tokenizer = family_swarm["model"], family_swarm["reference"], family_swarm["tokenizer"]
    # the client holds the embeddings (BLOOM: and their LayerNorm), the final norm and the head, no block
    expected_parts = {"embed_tokens.weight", "norm.weight", "norm.bias"}
    if family_swarm["case"].startswith("bloom"):
        expected_parts |= {"embed_norm.weight", "embed_norm.bias"}
    if not reference.config.tie_word_embeddings:
        expected_parts.add("lm_head.weight")
    assert {name for name, _ in model.named_parameters()} == expected_parts
    for text in PROMPTS:
        ids = _prompt_ids(tokenizer, text)
        ours = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert ours.tolist() == _greedy(reference, ids, 10).tolist(), text
        with torch.no_grad():
            expected = reference(ours).logits
        assert (model(ours).logits - expected).abs().max().item() < 1e-4


def test_left_padded_batch_equals_transformers(family_swarm):
    """A batch of prompts of different lengths, left-padded with an attention mask (ALiBi blocks too: the bias is
    shift-invariant per query, the padding keys hidden): greedy tokens and the real positions' logits equal
    transformers' on the same padded batch."""
    model, reference, tokenizer = family_swarm["model"], family_swarm["reference"], family_swarm["tokenizer"]
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert (mask == 0).any()
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                      pad_token_id=tokenizer.pad_token_id)
        logits = reference(ids, attention_mask=mask).logits
    assert ours.tolist() == expected.tolist()
    real = mask.bool()
    assert (model(ids, attention_mask=mask).logits[real] - logits[real]).abs().max().item() < 1e-4


def test_two_turn_session(family_swarm):
    model, reference, tokenizer = family_swarm["model"], family_swarm["reference"], family_swarm["tokenizer"]
    turn1 = _prompt_ids(tokenizer, PROMPTS[0])
    with model.inference_session(max_length=96) as session:
        out1 = model.generate(turn1, session=session, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        turn2 = torch.cat([out1, _prompt_ids(tokenizer, " And then")], dim=1)
        held = session.position
        out2 = model.generate(turn2, session=session, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert held > turn1.shape[1]  # the second turn reused the servers' cache of the first
    assert out1.tolist() == _greedy(reference, turn1, 8).tolist()
    assert out2.tolist() == _greedy(reference, turn2, 8).tolist()


def test_long_prompt_prefills_in_chunks(family_swarm):
    """A prompt over the servers' prefill chunk (256 tokens) runs as several chunks, each attending to the cache
    of those before it (with ALiBi: positions past 256, where Falcon's bfloat16 bias rounds)."""
    model, reference, tokenizer = family_swarm["model"], family_swarm["reference"], family_swarm["tokenizer"]
    ids = _prompt_ids(tokenizer, " ".join(PROMPTS * 18))
    assert ids.shape[1] > 300
    ours = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert ours.tolist() == _greedy(reference, ids, 4).tolist()


def test_concurrent_sessions_batched_equal_single(family_swarm):
    model, tokenizer, servers = family_swarm["model"], family_swarm["tokenizer"], family_swarm["servers"]
    prompts = [_prompt_ids(tokenizer, p) for p in PROMPTS + ["Once upon a time"]]
    single = [model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False) for ids in prompts]
    sessions = [model.inference_session(max_length=64) for _ in prompts]
    outputs = list(prompts)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            for _ in range(8):  # lockstep: every session's step is in flight at once
                logits = list(pool.map(lambda pair: pair[0].feed(pair[1]), zip(sessions, outputs)))
                outputs = [torch.cat([ids, lg.argmax(-1, keepdim=True)], dim=1) for ids, lg in zip(outputs, logits)]
    finally:
        for s in sessions:
            s.close()
    assert [o.tolist() for o in outputs] == [s.tolist() for s in single]
    stats = [model.manager.server_info(s.peer_id) for s in servers]
    assert max(s.largest_batch for s in stats) >= 2


class _AfterTokens:
    """A streamer that runs `action` once `n` new tokens have been produced."""

    def __init__(self, n: int, action):
        self.n, self.action, self.seen = n, action, -1

    def put(self, value):
        self.seen += 1  # the first put is the prompt
        if self.seen == self.n:
            self.action()

    def end(self):
        pass


def test_gateway_completions_and_chat(family_swarm):
    """Completions equal the reference's greedy tokens; chat completions where the tokenizer has a chat template
    (Falcon's here), else a 400 that says so (BLOOM's)."""
    import openai

    from launch.topology import start_gateway

    case, tokenizer = family_swarm["case"], family_swarm["tokenizer"]
    if case not in ("bloom", "falcon-new"):
        pytest.skip("the gateway is checked on one family of each tokenizer kind")
    gateway = start_gateway(str(family_swarm["path"]), family_swarm["initial_peers"], family_swarm["prefix"],
                            threads=1)
    try:
        client = openai.OpenAI(base_url=gateway.ready["url"] + "/v1", api_key="unused", max_retries=0, timeout=180)
        name = family_swarm["path"].name
        completion = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=6, temperature=0)
        ids = _prompt_ids(tokenizer, PROMPTS[0])
        expected = _greedy(family_swarm["reference"], ids, 6)[0, ids.shape[1]:]
        assert completion.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        messages = [{"role": "user", "content": "Hello"}]
        if case == "bloom":
            with pytest.raises(openai.BadRequestError, match="no chat template"):
                client.chat.completions.create(model=name, messages=messages, max_tokens=4)  # type: ignore[arg-type]
        else:
            chat = client.chat.completions.create(model=name, messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                                  temperature=0)
            assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    finally:
        gateway.terminate()


def test_failover_replays_the_session(family_swarm):
    """The server of the second half dies (SIGKILL) mid-generation: the session replays its history through the
    spare, and the greedy tokens equal the reference's. Last of the swarm's tests: it leaves one server fewer."""
    model, reference, tokenizer = family_swarm["model"], family_swarm["reference"], family_swarm["tokenizer"]
    by_peer = {s.peer_id: s for s in family_swarm["servers"]}
    ids = _prompt_ids(tokenizer, PROMPTS[2])
    with model.inference_session(max_length=ids.shape[1] + 12) as session:
        victims = []

        def kill():
            victim = next(hop.peer_id for hop in session.session.chain if hop.start <= 2 < hop.end)
            by_peer[victim].kill()
            victims.append(victim)

        out = model.generate(ids, session=session, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             streamer=_AfterTokens(5, kill))
        assert victims and session.session.failovers >= 1
        assert victims[0] not in [hop.peer_id for hop in session.session.chain]
    assert out.tolist() == _greedy(reference, ids, 12).tolist()


@pytest.mark.parametrize("case, quant_type", [("bloom", "int8"), ("falcon-new", "nf4")])
def test_quantized_servers_generate(case, quant_type, tmp_path, model_path, bootstrap):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoTokenizer

    from launch.topology import start_servers, terminate_all
    from swarm import AutoDistributedModelForCausalLM

    reference = build_bloom_falcon(case, tmp_path, model_path)
    prefix = f"tbfq-{case}"
    servers = start_servers(str(tmp_path), [bootstrap.maddr], ["0:2", "2:4"], prefix,
                            ["--quant_type", quant_type], threads=1)
    model = AutoDistributedModelForCausalLM.from_pretrained(str(tmp_path), initial_peers=[bootstrap.maddr],
                                                            dht_prefix=prefix)
    try:
        assert {s.info.quant_type for s in model.manager.update(force=True)} == {quant_type}
        ids = _prompt_ids(AutoTokenizer.from_pretrained(tmp_path), PROMPTS[0])
        ours = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert ours.shape == (1, ids.shape[1] + 6)
        logits = model(ids).logits
        with torch.no_grad():
            expected = reference(ids).logits
        assert torch.isfinite(logits).all()
        # loosely: quantized weights move the logits, but not far from the float model's
        assert torch.nn.functional.cosine_similarity(logits.flatten(), expected.flatten(), dim=0) > 0.9
    finally:
        model.shutdown()
        terminate_all(servers)


def test_base_model_checkpoint_loads(tmp_path, model_path):
    """BLOOM's hub checkpoints were saved from the base model: `h.0.…`, `word_embeddings.weight`, no
    `transformer.` prefix and no head (tied). Servers and the client name them as the causal-LM class does."""
    from server.compute.blocks import BlockSpan
    from swarm.modeling.checkpoint import Checkpoint

    reference = build_bloom_falcon("bloom", tmp_path / "full", model_path)
    reference.transformer.save_pretrained(tmp_path / "base", max_shard_size="1MB")
    checkpoint = Checkpoint(str(tmp_path / "base"))
    assert not any(name.startswith("transformer.") for name in checkpoint.weight_map())
    span = BlockSpan.load(checkpoint, 2, 4)
    with torch.no_grad():
        # hidden_states[i]: the input of block i; the last one: the output of block 3 through ln_f
        states = reference(torch.randint(3, VOCAB, (1, 5)), output_hidden_states=True).hidden_states
        got = reference.transformer.ln_f(span(states[2]))
        expected = states[4]
    assert (got - expected).abs().max() < 1e-4
    client_part = Checkpoint(str(tmp_path / "base"))
    client_part.expect_prefix("transformer.")
    tensors = client_part.load_tensors(lambda name: name.startswith("transformer.word_embeddings"))
    assert torch.equal(tensors["transformer.word_embeddings.weight"], reference.transformer.word_embeddings.weight)
    assert set(tensors) == {"transformer.word_embeddings.weight", "transformer.word_embeddings_layernorm.weight",
                            "transformer.word_embeddings_layernorm.bias"}


def test_a_server_of_the_family_imports_no_transformers_model_module(tmp_path, model_path):
    """Blocks (prefill and a batched decode step), config and the client's norms come from swarm.modeling: no
    process pays for transformers' modeling modules (torch._dynamo, sympy, ...; README's memory paragraph). Each
    case in turn in one process (one interpreter start for all; what any case imports is named after it)."""
    from tests.fixtures.fresh_python import run_python

    cases = ["bloom", "falcon-new", "falcon-alibi"]
    paths = {}
    for case in cases:
        build_bloom_falcon(case, tmp_path / case, model_path)
        paths[case] = str(tmp_path / case)
    code = (
        "import json, sys, swarm, torch, server.server\n"
        "from server.compute.blocks import BlockSpan\n"
        "from swarm.modeling.checkpoint import Checkpoint\n"
        "from swarm.modeling.families import family_for\n"
        "heavy = {}\n"
        f"for case, path in {paths!r}.items():\n"
        "    checkpoint = Checkpoint(path)\n"
        "    span = BlockSpan.load(checkpoint, 0, 2, 'float32')\n"
        "    kv = span.new_session_kv(1, 8, 0, 2)\n"
        "    span.forward(torch.randn(1, 5, span.hidden_size), 0, kv)\n"
        "    span.forward_batch([(torch.randn(1, 1, span.hidden_size), 5, kv)], 0, 2)\n"
        "    family = family_for(checkpoint.load_config())\n"
        "    family.norm(span.hidden_size)\n"
        "    heavy[case] = [m for m in sys.modules if m.startswith('transformers.models.') or m in "
        "('transformers.modeling_utils', 'transformers.activations', 'torch._dynamo')]\n"
        "print(json.dumps(heavy))\n"
    )
    assert json.loads(run_python(code)) == {case: [] for case in cases}


@pytest.mark.parametrize("case", ["falcon-new", "falcon-mq"])
def test_cuda_graph_step_of_rotary_falcon_on_cpu(case, tmp_path, model_path):
    """Rotary Falcon spans take CUDA graphs like Llama's: the step a graph captures
    (`server.compute.graphs.StaticSteps`, attention over the whole cache with a mask) equals the lean path's (ALiBi
    Falcon: tests/server/test_graphs.py)."""
    from server.compute.blocks import BlockSpan
    from server.compute.graphs import StaticSteps
    from swarm.modeling.checkpoint import Checkpoint
    from tests.fixtures.span_checks import graph_sessions, run_graph_steps

    build_bloom_falcon(case, tmp_path, model_path)
    span = BlockSpan.load(Checkpoint(str(tmp_path)), 1, 4, "float32")
    assert not span.alibi
    pairs, positions = graph_sessions(span, [(2, 5, None), (1, 3, None)], 24, 2, 4)
    run_graph_steps(span, StaticSteps(), pairs, positions, 2, 4, steps=4, tol=1e-4)
