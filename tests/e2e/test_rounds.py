"""Many sessions in one round, one message per server (issue 46), on real processes: the bundled model split 0:15 and
15:30 over two servers, the client's `step_round` against each session's lone `astep`, greedy generation through
rounds against transformers, a bad row that errors only its session, a server without the capability (masked in
the client's view) served through the per-session fallback, and the messages counted at the servers."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm import AutoDistributedModelForCausalLM
from swarm.client.transport import rounds
from swarm.client.transport.span_stream import SpanStream
from swarm.runtime import aio
from swarm.wire import protocol as P
from tests.fixtures.numerics import assert_close_at_scale
from tests.fixtures.round_checks import greedy_rounds

SPANS = ("0:15", "15:30")
PROMPTS = ["The history of the Roman Empire begins", "Hi", "def fibonacci(n):", "Three things every gardener",
           "Once upon a time", "The capital of France is", "import numpy as np", "Water boils at"]


@pytest.fixture(scope="module")
def model(swarms, model_path):
    swarm = swarms.get(SPANS)
    client = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=swarm["initial_peers"],
                                                             dht_prefix=swarm["prefix"])
    yield client
    rounds.close_round_streams(client.manager)
    client.shutdown()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(text, return_tensors="pt")["input_ids"] for text in PROMPTS]


def _sessions(model, count: int, max_length: int = 48):
    return [model.inference_session(max_length=max_length) for _ in range(count)]


def _chain_peers(session) -> list:
    return [s.hop.peer_id for s in session.session._streams]


def test_rounds_give_each_session_its_lone_outputs_in_one_message_per_server(model, prompts):
    """8 sessions stepped in rounds and 8 twins stepped alone (`astep`, one after the other) with the same inputs:
    the same outputs at every step; each round is one message per server and no session stream carried a step."""
    together, alone = _sessions(model, 8), _sessions(model, 8)
    try:
        head = together[0].head
        ids = list(prompts)
        first = rounds.step_round([(s.session, head.embed(p), None) for s, p in zip(together, ids)])  # opens them
        for s, p, out in zip(alone, ids, first):
            assert not isinstance(out, BaseException), out
            assert_close_at_scale(out, s.session.step(head.embed(p)), what="prefill")
        peers = sorted({peer for s in together for peer in _chain_peers(s)})
        assert len(peers) == 2
        before = {peer: aio.run(rounds.round_stats(model.manager, peer)) for peer in peers}
        pushed_before = {peer: getattr(rounds.ROUND_STREAMS.peek(model.manager, peer), "pushed_rows", 0)
                         for peer in peers}
        last = [out[:, -1] for out in first]  # [1, hidden]
        steps = 3
        for _ in range(steps):
            tokens = [head.head(x).argmax(-1, keepdim=True) for x in last]  # [1, 1]
            outs = rounds.step_round([(s.session, head.embed(t), None) for s, t in zip(together, tokens)])
            for s, t, out in zip(alone, tokens, outs):
                assert not isinstance(out, BaseException), out
                assert_close_at_scale(out, s.session.step(head.embed(t)), what="decode")
            last = [out[:, -1] for out in outs]
        after = {peer: aio.run(rounds.round_stats(model.manager, peer)) for peer in peers}
        first_hop, second_hop = _chain_peers(together[0])
        streams = rounds.ROUND_STREAMS.current(model.manager)
        # one message per round to the first server; the second got the first round's (which attached its parts),
        # then every row pushed by the first server (`round_push`), its results sent back on the client's stream
        assert after[first_hop].messages - before[first_hop].messages == steps
        assert after[second_hop].messages - before[second_hop].messages == 1
        assert streams[second_hop].pushed_rows - pushed_before[second_hop] == 8 * (steps - 1)
        assert streams[first_hop].pushed_rows == pushed_before[first_hop]
        for peer in peers:
            assert after[peer].rows - before[peer].rows == 8 * steps
            assert after[peer].row_errors == before[peer].row_errors
            # the twins' lone steps went on their own streams; the round's sessions sent none
            assert after[peer].session_steps - before[peer].session_steps == 8 * steps
            # this client's rounds opened one stream here (the swarm is the session's: other modules' clients, such
            # as the shared gateway, may hold round streams of their own there)
            assert after[peer].round_streams - before[peer].round_streams == 1
        # one round stream per server, the rounds' every message on it
        assert sorted(streams) == peers and not any(stream.closed for stream in streams.values())
        assert all(s.session.position == p.shape[1] + steps for s, p in zip(together, ids))
    finally:
        for s in together + alone:
            s.close()


def test_greedy_generation_through_rounds_equals_transformers(model, prompts, reference_model):
    new = 8
    ours, _ = greedy_rounds(model, prompts[:4], new)
    for prompt, ids in zip(prompts[:4], ours):
        ref = reference_model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert ids == ref.tolist()


def test_a_bad_row_errors_only_its_session(model, prompts):
    """On one round stream: a good row, a row at a wrong position, a row of a session part that does not exist and
    one attached with a wrong token: only the good row runs (its output equals its twin's lone step); the others
    get their own errors, their sessions are left as they were and step on afterwards."""
    good, bad, twin = _sessions(model, 3)
    try:
        head = good.head
        for s in (good, bad, twin):
            s.session.step(head.embed(prompts[0]))
        x = head.embed(torch.tensor([[42]]))
        first = good.session._streams[0]
        peer = first.hop.peer_id
        bad_stream = bad.session._streams[0]
        ghost = SpanStream(model.manager, first.hop, "no-such-session", 48, 1)
        thief = SpanStream(model.manager, first.hop, twin.session.session_id, 48, 1)  # twin's key, another token
        stream = rounds.round_stream(model.manager, peer)
        position = good.session.position
        outcomes, _ = aio.run(stream.step([(first, x, position, good.session._next_step_id()),
                                           (bad_stream, x, position + 3, bad.session._next_step_id()),
                                           (ghost, x, 0, 1), (thief, x, position, 10 ** 6)]))
        assert isinstance(outcomes[0], torch.Tensor)
        lone = aio.run(twin.session._streams[0].step(x, position, twin.session._next_step_id()))
        assert_close_at_scale(outcomes[0], lone)
        assert isinstance(outcomes[1], P.RemoteError) and "past the" in outcomes[1].message
        assert isinstance(outcomes[2], P.RemoteError) and "no session part" in outcomes[2].message
        assert isinstance(outcomes[3], P.RemoteError) and outcomes[3].code == "forbidden"
        # the bad session still holds what it held, and steps on (through rounds) with the right numbers
        good.session.rewind(position)
        twin.session.rewind(position)
        outs = rounds.step_round([(s.session, x, None) for s in (good, bad, twin)])
        assert all(isinstance(out, torch.Tensor) for out in outs), outs
        assert_close_at_scale(outs[1], outs[2], what="bad session after its error")
        assert_close_at_scale(outs[0], outs[2], what="good session")
        assert bad.session.failovers == 0 and good.session.failovers == 0
    finally:
        for s in (good, bad, twin):
            s.close()


def test_a_server_without_the_capability_is_served_through_the_fallback(model, prompts):
    """Sessions whose view of a server lacks `rounds` (an older release's record): one with both servers so steps on
    its own streams (`astep`) inside the round; one with only its first server so takes that hop on its own stream
    and the second in the round message; the others share one message per server; every output is its lone
    twin's."""
    sessions, twins = _sessions(model, 4), _sessions(model, 4)
    try:
        head = sessions[0].head
        for s, t in zip(sessions, twins):
            s.session.step(head.embed(prompts[1]))
            t.session.step(head.embed(prompts[1]))
        old, mixed = sessions[2].session, sessions[3].session
        for stream in old._streams + mixed._streams[:1]:  # the record of an older release: no "rounds"
            stream.hop = dataclasses.replace(stream.hop, capabilities=stream.hop.capabilities - {"rounds"})
        x = head.embed(torch.tensor([[7]]))
        assert not rounds.round_ready(old, x, None) and rounds.round_ready(mixed, x, None)
        first, second = _chain_peers(sessions[0])
        before = {peer: aio.run(rounds.round_stats(model.manager, peer)) for peer in (first, second)}
        for token in (7, 8):
            x = head.embed(torch.tensor([[token]]))
            outs = rounds.step_round([(s.session, x, None) for s in sessions])
            for out, t in zip(outs, twins):
                assert isinstance(out, torch.Tensor), out
                assert_close_at_scale(out, t.session.step(x))
        after = {peer: aio.run(rounds.round_stats(model.manager, peer)) for peer in (first, second)}
        delta = {peer: {field: getattr(after[peer], field) - getattr(before[peer], field)
                        for field in ("messages", "rows", "session_steps", "row_errors")} for peer in after}
        # per round: one round message per server; the first server's rows: the two sessions with the capability
        # there, its own-stream steps: the old one's, the mixed one's and the 4 twins'; the second server's rows:
        # three sessions, its own-stream steps: the old one's and the twins'
        assert delta[first] == {"messages": 2, "rows": 2 * 2, "session_steps": 2 * 6, "row_errors": 0}, delta
        assert delta[second] == {"messages": 2, "rows": 2 * 3, "session_steps": 2 * 5, "row_errors": 0}, delta
        assert old.failovers == mixed.failovers == 0
    finally:
        for s in sessions + twins:
            s.close()


def test_round_items_with_options_or_errors_do_not_fail_the_others(model, prompts):
    """An item whose step cannot be taken (past its max_length; a closed session) gets its own exception; an item
    with row edits goes through `astep`; the rest of the round runs."""
    ok, edited, closed, full = _sessions(model, 4)
    sessions = [ok, edited, closed, full]
    try:
        head = ok.head
        ok.session.step(head.embed(prompts[0]))
        edited.session.step(head.embed(prompts[0]))
        full.session.step(head.embed(prompts[0]))
        x = head.embed(torch.tensor([[5]]))
        closed.close()
        outs = rounds.step_round([(ok.session, x, None), (edited.session, x, {"hypo_ids": [0]}),
                                  (closed.session, head.embed(prompts[0]), None),
                                  (full.session, head.embed(torch.zeros(1, 48, dtype=torch.long)), None)])
        assert isinstance(outs[0], torch.Tensor) and isinstance(outs[1], torch.Tensor)
        assert_close_at_scale(outs[0], outs[1])
        assert isinstance(outs[2], Exception) and "closed" in str(outs[2])
        assert isinstance(outs[3], Exception) and "max_length" in str(outs[3])
    finally:
        for s in sessions:
            s.close()


def test_a_row_that_fails_in_the_round_is_stepped_again_alone(model, prompts):
    """A session whose part on the second server refuses the round (its attach token is wrong here, as after a
    mix-up): its first hop ran in the round, the second failed, so the whole step goes again through `astep`, the
    first server overwriting the same position; its output is its twin's, its position advances once, the other
    session of the round is not touched."""
    sessions, twins = _sessions(model, 2), _sessions(model, 2)
    try:
        head = sessions[0].head
        for s in sessions + twins:
            s.session.step(head.embed(prompts[2]))
        victim = sessions[1].session._streams[1]
        peer = victim.hop.peer_id
        token, victim.push_token = victim.push_token, "w" * 32
        before = aio.run(rounds.round_stats(model.manager, peer))
        x = head.embed(torch.tensor([[11]]))
        position = sessions[1].session.position
        outs = rounds.step_round([(s.session, x, None) for s in sessions])
        after = aio.run(rounds.round_stats(model.manager, peer))
        assert after.row_errors - before.row_errors == 1
        assert sessions[1].session.position == position + 1 and sessions[1].session.failovers == 0
        for out, twin in zip(outs, twins):
            assert isinstance(out, torch.Tensor), out
            assert_close_at_scale(out, twin.session.step(x))
        victim.push_token = token
    finally:
        for s in sessions + twins:
            s.close()


def test_another_client_cannot_step_a_session_even_with_its_token(model, prompts, swarms):
    """A round stream from another peer that names a session part and even carries its secret is refused (the part
    was not opened by that peer); the session steps on, unchanged, for its own client."""
    from swarm.client.transport.manager import ClientConfig, SwarmManager

    swarm = swarms.get(SPANS)
    other = SwarmManager(ClientConfig(initial_peers=swarm["initial_peers"], measure_rtt=False), swarm["prefix"],
                         model.manager.num_blocks)
    session, twin = _sessions(model, 2)
    try:
        head = session.head
        for s in (session, twin):
            s.session.step(head.embed(prompts[4]))
        part = session.session._streams[0]
        stolen = SpanStream(other, part.hop, session.session.session_id, 48, 1)
        stolen.push_token = part.push_token
        x = head.embed(torch.tensor([[3]]))
        [outcome], _ = aio.run(rounds.round_stream(other, part.hop.peer_id).step(
            [(stolen, x, session.session.position, 10 ** 6)]))
        assert isinstance(outcome, P.RemoteError) and "no session part" in outcome.message, outcome
        [out, lone] = rounds.step_round([(session.session, x, None)]) + [twin.session.step(x)]
        assert isinstance(out, torch.Tensor), out
        assert_close_at_scale(out, lone)
    finally:
        session.close()
        twin.close()
        other.shutdown()
