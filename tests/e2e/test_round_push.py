"""Round pushes (capability `round_push`, issue 46) on real processes: the bundled model over a chain of three servers
(0:10, 10:20, 20:30). A round's rows go client -> s1 -> s2 -> s3 -> client, each server pushing the rows on to the
next in one message and answering the client on its round stream; the client's own messages go to the first server
only (the first round attaches the parts on the others). Greedy generation through pushed rounds equals
transformers and a client without push (`use_push=False`, which relays every hop itself); a client that gives up
on every push at once (`push_timeout` of a microsecond, so its own copies race the pushes) gets the same tokens; and
a peer that knows a live part's key but not its push token cannot push rows into it."""
from __future__ import annotations

import pytest
import torch

from launch.topology import start_bootstrap, start_servers, terminate_all
from swarm import AutoDistributedModelForCausalLM
from swarm.client.transport import rounds
from swarm.runtime import aio
from swarm.wire import protocol as P
from swarm.wire import rounds as R
from tests.fixtures.round_checks import greedy_rounds
from tests.fixtures.rpc_fuzzing import HIDDEN, fuzz_env, push_replies  # noqa: F401  (fuzz_env: a fixture)

SPANS = ("0:10", "10:20", "20:30")
PROMPTS = ["The history of the Roman Empire begins", "Hi", "def fibonacci(n):", "Once upon a time"]
NEW = 8


@pytest.fixture(scope="module")
def chain(model_path):
    """The three servers in a DHT of their own: a module swarm in the session's DHT holds replicas of the main
    swarm's records while it runs, and takes them along when it ends (until their servers store them again)."""
    boot = start_bootstrap(threads=1)
    servers = []
    try:
        servers = start_servers(model_path, [boot.maddr], list(SPANS), "tpush3", [], threads=1)
        yield {"prefix": "tpush3", "servers": servers, "initial_peers": [boot.maddr]}
    finally:
        terminate_all(servers + [boot])


def _client(model_path, swarm, **config):
    return AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=swarm["initial_peers"],
                                                           dht_prefix=swarm["prefix"], **config)


def _greedy_rounds(model, prompts) -> list:
    """Each prompt's greedy continuation, all of them stepped together in rounds, over the three servers."""
    ids, chains = greedy_rounds(model, prompts, NEW)
    assert chains == [len(SPANS)] * len(prompts)
    return ids


def test_rows_pushed_along_a_chain_of_three_give_transformers_tokens(chain, model_path, tokenizer, reference_model):
    prompts = [tokenizer(text, return_tensors="pt")["input_ids"] for text in PROMPTS]
    expected = [reference_model.generate(p, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False).tolist()
                for p in prompts]
    pushing, relaying = _client(model_path, chain), _client(model_path, chain, use_push=False)
    try:
        peers = [server.peer_id for server in chain["servers"]]
        before = {peer: aio.run(rounds.round_stats(pushing.manager, peer)) for peer in peers}
        assert _greedy_rounds(pushing, prompts) == expected
        after = {peer: aio.run(rounds.round_stats(pushing.manager, peer)) for peer in peers}
        messages = [after[peer].messages - before[peer].messages for peer in peers]
        # the first step opens the sessions (their own streams); the next round attaches the parts everywhere;
        # then the client sends each round to the first server only, and the others' rows come pushed
        assert messages == [NEW - 1, 1, 1], messages
        streams = rounds.ROUND_STREAMS.current(pushing.manager)
        assert [streams[peer].pushed_rows for peer in peers] == [0] + [len(PROMPTS) * (NEW - 2)] * 2
        assert all(after[peer].row_errors == before[peer].row_errors for peer in peers)

        assert _greedy_rounds(relaying, prompts) == expected
        again = {peer: aio.run(rounds.round_stats(pushing.manager, peer)) for peer in peers}
        assert [again[peer].messages - after[peer].messages for peer in peers] == [NEW - 1] * 3  # it relays every hop
        assert not any(stream.pushed_rows for stream in rounds.ROUND_STREAMS.current(relaying.manager).values())
    finally:
        pushing.shutdown()
        relaying.shutdown()


def test_a_client_that_sends_its_own_copy_of_every_pushed_row_gets_the_same_tokens(chain, model_path, tokenizer,
                                                                                   reference_model):
    """With `push_timeout` of a microsecond the client sends every pushed row itself at once: each server takes
    whichever copy comes first; a copy that comes second is answered with the output the server kept from the
    push, or dropped (a push behind the client's own copy). Which one wins varies; the tokens may not."""
    prompts = [tokenizer(text, return_tensors="pt")["input_ids"] for text in PROMPTS]
    expected = [reference_model.generate(p, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False).tolist()
                for p in prompts]
    impatient = _client(model_path, chain, push_timeout=1e-6)
    try:
        peers = [server.peer_id for server in chain["servers"]]
        before = [impatient.manager.server_info(peer) for peer in peers]
        rows_before = [aio.run(rounds.round_stats(impatient.manager, peer)) for peer in peers]
        assert _greedy_rounds(impatient, prompts) == expected
        after = [impatient.manager.server_info(peer) for peer in peers]
        rows_after = [aio.run(rounds.round_stats(impatient.manager, peer)) for peer in peers]
        # a second copy is never an error: a late copy is answered from the push, a late push is dropped
        assert [a.row_errors - b.row_errors for b, a in zip(rows_before, rows_after)] == [0, 0, 0]
        # no step ran twice on a server: each server's steps are the rounds' (one per session and round)
        steps = [a.inference_steps - b.inference_steps for b, a in zip(before, after)]
        assert steps == [len(PROMPTS) * NEW] * 3, steps
    finally:
        impatient.shutdown()


def _round_push(manager, peer_id: str, key: str, token: str, position: int) -> list:
    """The replies to a forged round push (a step id far ahead of the session's) and a malformed one, on one stream."""
    forged = P.make_request(R.RoundPush(rows=[R.RoundPushRow(stream_key=key, token=token, start_position=position,
                                                             step_id=10 ** 9, batch=1, seq=1)]),
                            [torch.full((1, HIDDEN), 50.0)])
    malformed = P.make_request(R.RoundPush(rows=[R.RoundPushRow(stream_key=key, token=token, start_position=position,
                                                                step_id=10 ** 9, batch=1, seq=2)]),
                               [torch.full((1, HIDDEN), 50.0)])  # one token's states for two

    return push_replies(manager, peer_id, "rpc_round_push", [forged, malformed, forged])


def test_an_outsider_cannot_push_round_rows_into_a_live_session(fuzz_env, tokenizer, reference_model):  # noqa: F811
    outsider, swarm, model = fuzz_env  # `outsider`: a SwarmManager with its own peer id, not the model's
    second = swarm["servers"][1].peer_id
    ids = tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
    expected = reference_model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0].tolist()
    before = outsider.server_info(second)
    with model.inference_session(max_length=48) as session:
        head, tokens = session.head, ids[0].tolist()
        x = head.embed(ids)
        for step in range(NEW):
            [out] = rounds.step_round([(session.session, x, None)])
            assert not isinstance(out, BaseException), out
            token = head.head(out[:, -1]).argmax(-1, keepdim=True)  # [1, 1]
            tokens.append(int(token))
            x = head.embed(token)
            if step == NEW // 2:  # the part is attached to the client's round stream there and takes pushes
                victim = session.session._streams[1]
                assert victim.hop.peer_id == second
                for wrong in ["x" * 32, victim.push_token[:-1] + ("A" if victim.push_token[-1] != "A" else "B")]:
                    replies = _round_push(outsider, second, victim.key, wrong, session.session.position)
                    assert len(replies) == 2 and all(isinstance(r, P.ErrorReply) and r.code == "forbidden"
                                                     and "push token" in r.message for r in replies), replies
    assert tokens == expected
    after = outsider.server_info(second)
    assert after.pushes_refused - before.pushes_refused == 4
    assert after.steps_from_push - before.steps_from_push == NEW - 2  # the honest rounds' rows came pushed
