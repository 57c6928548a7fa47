"""Phi-3 with LongRoPE whose session crosses `original_max_position_embeddings` (12 here) mid-generation.

What transformers does (5.24, `Phi3ForCausalLM.prepare_inputs_for_generation` and `longrope_frequency_update`): each
forward call rotates with the short factors while its largest position is below the original length and with the
long ones past it; and `generate` drops its cache at the first step whose sequence reaches past that length while
the cache holds no more than it, computing the whole sequence again (so every key then has the long factors). Its
greedy tokens and logits are therefore those of a pass without a cache over the whole sequence at every step. The
swarm matches that: the client sends the whole sequence again from position 0 at that step
(`phi3.recomputes_cache`, `swarm.client.model.model_session`), in process and through a server; keeping the cache
instead (the earlier keys with the short factors) gives other logits, which this test also shows.

A step computed in parts (passes of a few positions on a server, messages of a few tokens from the client) has the
whole step's factors in every part (`Step.rope_length`, `SessionKV.rope_length`): each part picking by its own end
(the first parts below the boundary, short) is what these tests show differs.
"""
from __future__ import annotations

import pytest
import torch

from server.compute.blocks import BlockSpan
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.families.phi3 import recomputes_cache
from tests.fixtures.family_configs import LONGROPE, VOCAB
from tests.fixtures.span_checks import embed_ids, final_logits, greedy_steps
from tests.fixtures.tiny_checkpoints import save_tiny


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    path = tmp_path_factory.mktemp("longrope")
    reference = save_tiny("phi3", path, None, vocab_size=VOCAB, **LONGROPE)
    return path, reference


def test_the_boundary_rule():
    from swarm.modeling.model_config import model_config

    config = model_config({"model_type": "phi3", **LONGROPE})
    assert [recomputes_cache(config, held, held + 1) for held in (0, 5, 11, 12, 13)] == [False, False, False, True,
                                                                                          False]
    assert recomputes_cache(config, 8, 20) and not recomputes_cache(config, 8, 12)
    assert not recomputes_cache(model_config({"model_type": "phi3", "original_max_position_embeddings": 12}), 12, 13)


def test_a_session_crossing_the_original_length_matches_transformers(longrope):
    """A 9-token prompt and 8 greedy tokens (positions 9..16): tokens equal transformers' generate and every step's
    logits equal its scores within 1e-4; without computing the session again the logits past the boundary differ."""
    path, reference = longrope
    span = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32")
    torch.manual_seed(11)
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        out = reference.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    kv = span.new_session_kv(2, 32, 0, 4)
    tokens = greedy_steps(reference, span, kv, ids, span.forward(embed_ids(reference, ids), 0, kv), 8)
    assert tokens.tolist() == out.sequences.tolist()
    # the same steps, each step's logits against transformers' (the last position's after each step)
    kept = span.new_session_kv(2, 32, 0, 4)  # (the cache kept across the boundary: what transformers does not do)
    kv = span.new_session_kv(2, 32, 0, 4)
    hidden, stale = span.forward(embed_ids(reference, ids), 0, kv), span.forward(embed_ids(reference, ids), 0, kept)
    differ = 0.0
    for step, position in enumerate(range(9, 17)):
        assert (final_logits(reference, hidden[:, -1]) - out.logits[step]).abs().max().item() < 1e-4
        differ = max(differ, (final_logits(reference, stale[:, -1]) - out.logits[step]).abs().max().item())
        token = tokens[:, position:position + 1]
        if recomputes_cache(span.config, position, position + 1):
            hidden = span.forward(embed_ids(reference, tokens[:, :position + 1]), 0, kv)
        else:
            hidden = span.forward_batch([(embed_ids(reference, token), position, kv)], 0, 4)[0]
        stale = span.forward_batch([(embed_ids(reference, token), position, kept)], 0, 4)[0]
    assert differ > 1e-3


def _sharp_checkpoint(path, model_path):
    """The tiny LongRoPE Phi-3 saved at `path` with the bundled tokenizer, with sharper attention (random q/k weights
    of std 0.02 attend almost uniformly: the rotation's factors then move the tokens); returns transformers' model."""
    reference = save_tiny("phi3", path, model_path, **LONGROPE)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "qkv_proj" in name:
                param.normal_(0.0, 0.3)
    reference.save_pretrained(path)
    return reference


LONG_PROMPT = ("The history of the Roman Empire begins with the founding of the city of Rome in the eighth century "
               "before the common era")


@pytest.mark.extended
def test_a_swarm_session_crossing_the_original_length(tmp_path, bootstrap, model_path, tokenizer):
    """Through two servers (0:2, 2:4) and the client's `generate`: a 9-token prompt and 8 new tokens cross the
    boundary, the tokens and the last logits equal transformers'."""
    from launch.topology import start_servers, terminate_all
    from swarm import AutoDistributedModelForCausalLM

    reference = _sharp_checkpoint(tmp_path, model_path)
    servers = start_servers(str(tmp_path), [bootstrap.maddr], ["0:2", "2:4"], "tlr", threads=1)
    model = AutoDistributedModelForCausalLM.from_pretrained(str(tmp_path), initial_peers=[bootstrap.maddr],
                                                            dht_prefix="tlr")
    try:
        ids = tokenizer("The history of the Roman Empire begins with the", return_tensors="pt")["input_ids"][:, :9]
        assert ids.shape[1] == 9
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            expected_logits = reference(expected).logits[:, -1]
        with model.inference_session(max_length=32) as session:
            ours = model.generate(ids, session=session, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            logits = model(ours).logits[:, -1]
        assert ours.tolist() == expected.tolist()
        assert (logits - expected_logits).abs().max().item() < 1e-3
    finally:
        model.shutdown()
        terminate_all(servers)


def _chunked(span, kv, hidden: torch.Tensor, start: int, chunk: int, rope_length) -> torch.Tensor:
    """hidden [batch, seq, hidden] for positions start.. through `span` in passes of `chunk` positions, each picking
    LongRoPE's factors by `rope_length` (what the handler sets per step: `Step.rope_length`; None: each pass's end)."""
    kv.rope_length = rope_length
    return torch.cat([span.forward(hidden[:, offset:offset + chunk], start + offset, kv)
                      for offset in range(0, hidden.shape[1], chunk)], dim=1)


def test_a_step_in_chunks_across_the_boundary_has_the_whole_steps_factors(longrope):
    """One 20-token step (past the original length 12) in passes of 8 positions: the first pass ends before the
    boundary. With the step's `rope_length` every pass has the long factors, as transformers' one call over the
    whole step: logits within 1e-4 of `Phi3ForCausalLM`; each pass picking by its own end (before the fix) differs.
    In a batched prefill pass and a batched decode step, each session's rows have their own step's factors (a
    session below the boundary next to one past it)."""
    path, reference = longrope
    span = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32")
    torch.manual_seed(12)
    ids = torch.randint(3, VOCAB, (2, 21))
    with torch.no_grad():
        expected = reference(ids[:, :20]).logits  # [2, 20, vocab]
    kv = span.new_session_kv(2, 32, 0, 4)
    ours = final_logits(reference, _chunked(span, kv, embed_ids(reference, ids[:, :20]), 0, 8, 20))
    assert (ours - expected).abs().max().item() < 1e-4
    per_pass = final_logits(reference, _chunked(span, span.new_session_kv(2, 32, 0, 4),
                                                embed_ids(reference, ids[:, :20]), 0, 8, None))
    assert (per_pass - expected).abs().max().item() > 1e-3  # the first passes' short factors
    assert (per_pass[:, 16:] - expected[:, 16:]).abs().max().item() > 1e-3  # and every key the later ones read

    # a batched decode step: this session at position 20 (long factors) with a session at position 8 (short)
    short = span.new_session_kv(1, 32, 0, 4)
    _chunked(span, short, embed_ids(reference, ids[:1, :8]), 0, 8, 8)
    one, two = span.forward_batch([(embed_ids(reference, ids[:, 20:21]), 20, kv),
                                   (embed_ids(reference, ids[:1, 8:9]), 8, short)], 0, 4)
    with torch.no_grad():
        assert (final_logits(reference, one[:, -1]) - reference(ids).logits[:, -1]).abs().max().item() < 1e-4
        assert (final_logits(reference, two[:, -1]) - reference(ids[:1, :9]).logits[:, -1]).abs().max().item() < 1e-4

    # a batched prefill pass: the first 8 positions of a 20-token step (long) with an 8-token step (short)
    first, second = span.new_session_kv(1, 32, 0, 4), span.new_session_kv(1, 32, 0, 4)
    first.rope_length, second.rope_length = 20, 8
    embeds = embed_ids(reference, ids[:2, :8])
    a, b = span.forward_prefill_batch([(embeds[:1], 0, first), (embeds[1:], 0, second)], 0, 4)
    assert torch.allclose(a, _chunked(span, span.new_session_kv(1, 32, 0, 4), embeds[:1], 0, 8, 20), atol=1e-5)
    with torch.no_grad():
        assert (final_logits(reference, b) - reference(ids[1:2, :8]).logits).abs().max().item() < 1e-4

    # a spot-check's replay of the step's first 8 positions (`ForwardRequest.rope_length`: a pass without a cache)
    replayed = span.forward(embed_ids(reference, ids[:, :8]), 0, None, rope_length=20)
    assert torch.allclose(replayed, _chunked(span, span.new_session_kv(2, 32, 0, 4), embed_ids(reference, ids[:, :20]),
                                             0, 8, 20)[:, :8], atol=1e-5)


@pytest.mark.extended
def test_a_swarm_step_in_messages_across_the_boundary(tmp_path, bootstrap, model_path, tokenizer):
    """Two servers (0:2, 2:4) that take at most 5 tokens a message (`--max_step_tokens`), so the client sends a step
    in parts whose first ones end before the original length (12): a 20-token step's logits within 1e-4 of
    transformers' (float32; its later messages pushed server to server), and a 9-token prompt's 8 greedy tokens,
    whose step past the boundary sends the whole sequence again in 5-token messages (`phi3.recomputes_cache`), equal
    transformers' generate."""
    from launch.topology import start_servers, terminate_all
    from swarm import AutoDistributedModelForCausalLM

    reference = _sharp_checkpoint(tmp_path, model_path)
    servers = start_servers(str(tmp_path), [bootstrap.maddr], ["0:2", "2:4"], "tlrm", ["--max_step_tokens", "5"],
                            threads=1)
    model = AutoDistributedModelForCausalLM.from_pretrained(str(tmp_path), initial_peers=[bootstrap.maddr],
                                                            dht_prefix="tlrm")
    try:
        ids = tokenizer(LONG_PROMPT, return_tensors="pt")["input_ids"][:, :20]
        assert ids.shape[1] == 20
        with torch.no_grad():
            expected = reference(ids).logits
            with model.inference_session(max_length=32) as session:
                logits = model.head(session.session.step(model.embed(ids)))
        assert (logits - expected).abs().max().item() < 1e-4
        # the 2:4 server got the messages after the first (once its part was open) pushed by the 0:2 server, with
        # their rope_length (`PushStep`)
        assert max(model.manager.server_info(server.peer_id).steps_from_push for server in servers) >= 2
        with torch.no_grad():
            tokens = reference.generate(ids[:, :9], max_new_tokens=8, min_new_tokens=8, do_sample=False)
        with model.inference_session(max_length=32) as session:
            ours = model.generate(ids[:, :9], session=session, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert ours.tolist() == tokens.tolist()
    finally:
        model.shutdown()
        terminate_all(servers)


@pytest.mark.extended
def test_a_failover_in_the_middle_of_a_step_replays_with_its_factors(tmp_path, bootstrap, model_path, tokenizer):
    """Servers 0:2, 2:4, 2:4 taking 5 tokens a message; the session's 2:4 server is killed once 2 messages of a
    20-token step are through: the replacement replays positions 0..10 with the step's factors (the long ones, its
    `rope_length` 20, not the replay's own 10), and the step's logits equal transformers' within 1e-4."""
    from launch.topology import start_servers
    from swarm import AutoDistributedModelForCausalLM

    reference = _sharp_checkpoint(tmp_path, model_path)
    servers = {s.peer_id: s for s in start_servers(str(tmp_path), [bootstrap.maddr], ["0:2", "2:4", "2:4"], "tlrf",
                                                   ["--max_step_tokens", "5"], threads=1)}
    model = AutoDistributedModelForCausalLM.from_pretrained(str(tmp_path), initial_peers=[bootstrap.maddr],
                                                            dht_prefix="tlrf", ban_timeout=60, max_retries=2)
    try:
        ids = tokenizer(LONG_PROMPT, return_tensors="pt")["input_ids"][:, :20]
        with torch.no_grad():
            expected = reference(ids).logits
        with model.inference_session(max_length=32) as session:
            inner = session.session
            send = inner._step_chunk
            sent = []

            async def kill_after_two(x, *args):  # the real step, then the kill between two messages
                out = await send(x, *args)
                sent.append(x.shape[1])
                if len(sent) == 2:
                    servers[next(hop.peer_id for hop in inner.chain if hop.start <= 2 < hop.end)].kill()
                return out

            inner._step_chunk = kill_after_two
            with torch.no_grad():
                logits = model.head(inner.step(model.embed(ids)))
            assert inner.failovers >= 1 and sent == [5, 5, 5, 5]
        assert (logits - expected).abs().max().item() < 1e-4
    finally:
        model.shutdown()
        for server in servers.values():
            server.kill()
