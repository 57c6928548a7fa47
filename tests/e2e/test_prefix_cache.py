"""Shared prefixes on real processes (issue 47): conversations that start with one long system prompt adopt the pages
of it that the servers keep (`server.compute.prefix_cache`) instead of computing it again, and their greedy tokens
equal transformers'; a conversation's next turn is served from its own session; other salts never share; a failover
after an adopted prefix gives the same tokens: the servers keep their outputs at the adopted positions (not sent at
the opening), fetched when a replay needs them, or recomputed where the server that kept them is the one that died."""
from __future__ import annotations

import threading
import uuid

import pytest
import torch

from launch.topology import start_server, start_servers
from swarm import AutoDistributedModelForCausalLM
from swarm.client.transport.status import collect_status
from swarm.runtime import aio
from tests.fixtures.swarm_checks import KillAfter

PAGE = 64
SYSTEM_PAGES = 16  # a 1,024-token system prompt
NEW = 6
USERS = 8


@pytest.fixture(scope="module")
def prefix_swarm(model_path, bootstrap):
    prefix = "tprefix"
    servers = start_servers(model_path, [bootstrap.maddr], ["0:15", "15:30"], prefix,
                            ["--update_period", "5", "--prefix_page_tokens", str(PAGE)], threads=1)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=[bootstrap.maddr], dht_prefix=prefix, ban_timeout=60, step_timeout=60,
        max_retries=2)
    yield model, servers, prefix
    model.shutdown()
    for s in servers:
        s.kill()


@pytest.fixture(scope="module")
def system_ids(tokenizer):
    text = " ".join(f"Rule {i}: answer briefly, politely and truthfully about topic number {i}." for i in range(120))
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= SYSTEM_PAGES * PAGE
    return ids[:SYSTEM_PAGES * PAGE]


def _prompt(tokenizer, system_ids, user: str) -> torch.Tensor:
    return torch.tensor([system_ids + tokenizer(f" Question: {user}? Answer:")["input_ids"]])


def _reports(model, servers):
    return {s.peer_id: aio.run(model.manager.prefix_cache(s.peer_id)) for s in servers}


def _generate(model, ids: torch.Tensor, salt: str):
    """Greedy tokens of a fresh session that declares its prompt with `salt`, and the session (the caller closes it)."""
    session = model.inference_session(max_length=ids.shape[1] + 4 * NEW + 32)
    session.prefix_salt = salt
    out = model.generate(ids, session=session, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out, session


@pytest.fixture(scope="module")
def shared_swarm(swarms, model_path):
    """The session's 0:15 + 15:30 swarm (`tests/conftest.py`'s `swarms`: no servers of its own; their pages are the
    default 64 tokens) and a client model on it."""
    swarm = swarms.get(("0:15", "15:30"))
    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=swarm["initial_peers"],
                                                            dht_prefix=swarm["prefix"])
    yield model, swarm["servers"]
    model.shutdown()


def test_a_later_conversation_adopts_the_shared_prompt(shared_swarm, system_ids, tokenizer, reference_model):
    """The default tier's end-to-end check (the others are extended): a 256-token system prompt computed by one
    conversation, adopted by the next of the same salt and not by one of another salt; greedy tokens equal
    transformers' in all three."""
    model, servers = shared_swarm
    system = system_ids[:4 * PAGE]
    prompts = [_prompt(tokenizer, system, question) for question in ("what is two plus two", "name a colour",
                                                                     "name a fruit")]
    before = _reports(model, servers)
    x, y = f"tenant-x-{uuid.uuid4().hex}", f"tenant-y-{uuid.uuid4().hex}"  # (nothing kept from an earlier test)
    runs = [_generate(model, prompts[0], x), _generate(model, prompts[1], x), _generate(model, prompts[2], y)]
    try:
        assert [session.session.adopted_tokens for _, session in runs] == [0, 4 * PAGE, 0]
        for (out, _), ids in zip(runs, prompts):
            ref = reference_model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            assert out.tolist() == ref.tolist()
        after = _reports(model, servers)
        for peer in after:
            assert after[peer].pages_hit - before[peer].pages_hit == 4
            own = sum(p.shape[1] // PAGE for p in prompts) - 4  # every full page, but the 4 adopted
            assert after[peer].pages_computed - before[peer].pages_computed == own
        # the swarm's status (`/status.json`, `swarmgate status`) shows each server's counters, as it reports them
        shown = {s.peer_id: s.prefix_pages for s in collect_status(model.manager, "m").servers}
        for peer, report in after.items():
            assert shown[peer] is not None and shown[peer].page_tokens == PAGE
            assert (shown[peer].hit, shown[peer].computed) == (report.pages_hit, report.pages_computed)
    finally:
        for _, session in runs:
            session.close()


def test_concurrent_conversations_compute_the_shared_prompt_once(prefix_swarm, system_ids, tokenizer,
                                                                 reference_model):
    """Eight users who send the same 1,024-token system prompt at the same instant (a barrier): the servers compute
    it once (single-flight: the others wait for its pages in flight and adopt them; `pages_computed` counts every
    page any session computed, stored or not), and greedy tokens equal transformers'."""
    model, servers, _ = prefix_swarm
    prompts = [_prompt(tokenizer, system_ids, f"what is {i} plus {i + 1}") for i in range(USERS)]
    results: dict = {}
    barrier = threading.Barrier(USERS)

    def user(i: int) -> None:
        try:
            barrier.wait(120)  # all arrive together: the later ones open while the first computes the prompt
            results[i] = _generate(model, prompts[i], salt="tenant-a")
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=user, args=(i,)) for i in range(USERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    errors = [r for r in results.values() if isinstance(r, BaseException)]
    assert not errors, errors
    adopted = sorted(results[i][1].session.adopted_tokens for i in range(USERS))
    try:
        for i in range(USERS):
            ref = reference_model.generate(prompts[i], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            assert results[i][0].tolist() == ref.tolist(), f"user {i}"
        # one user computed the system prompt; the seven others adopted all of it (waiting for it, or after it)
        assert adopted == [0] + [SYSTEM_PAGES * PAGE] * (USERS - 1)
        own_pages = sum(p.shape[1] // PAGE - SYSTEM_PAGES for p in prompts)  # each prompt's own full pages
        for peer, report in _reports(model, servers).items():
            assert report.enabled and report.page_tokens == PAGE
            assert report.pages_computed == SYSTEM_PAGES + own_pages, (peer, report)  # the shared ones once
            assert report.pages_hit == SYSTEM_PAGES * (USERS - 1), (peer, report)

        # a conversation's own next turn is served from its session (not adopted again), still equal to transformers
        out, session = results[0]
        adopted_at_first_turn = session.session.adopted_tokens  # (0 or the system prompt: whoever came first)
        before = _reports(model, servers)
        turn = torch.cat([out, torch.tensor([tokenizer(" And twice that? Answer:")["input_ids"]])], dim=1)
        second = model.generate(turn, session=session, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        ref = reference_model.generate(turn, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        assert second.tolist() == ref.tolist()
        assert session.session.adopted_tokens == adopted_at_first_turn and session.session.failovers == 0
        after = _reports(model, servers)
        assert all(after[p].pages_hit == before[p].pages_hit for p in after)
    finally:
        for r in results.values():
            r[1].close()


def test_failover_after_an_adopted_prefix_gives_the_same_tokens(prefix_swarm, model_path, bootstrap, system_ids,
                                                                 tokenizer, reference_model):
    """The session adopts the system prompt from the servers, then its second span's server dies mid-generation:
    a fresh server (no pages) replays the history, whose adopted positions are the first server's outputs there,
    which it kept (`rpc_prefix_outputs`): fetched for the replay, equal to transformers' hidden states."""
    model, servers, prefix = prefix_swarm
    _generate(model, _prompt(tokenizer, system_ids, "what is two plus two"), "tenant-a")[1].close()  # the system
    # prompt's pages on both servers (what the earlier tests leave there), so that this test also stands alone
    ids = _prompt(tokenizer, system_ids, "what colour is the sky")
    session = model.inference_session(max_length=ids.shape[1] + 4 * NEW)
    session.prefix_salt = "tenant-a"
    spare = None
    try:
        session.feed(ids)  # opens and adopts the system prompt from both servers
        held = SYSTEM_PAGES * PAGE
        assert session.session.adopted_tokens == held
        boundary = session.session._history[15]
        assert boundary.remote == held  # the first server kept its outputs there: none came with the opening
        with pytest.raises(RuntimeError, match="held by a server"):
            boundary.read(held)
        spare = start_server(model_path, [bootstrap.maddr], "15:30", prefix,
                             ["--update_period", "5", "--prefix_page_tokens", str(PAGE)], name="server-spare",
                             threads=1)
        spare.wait_ready(300)
        model.manager.update(force=True)
        victim = next(s for s in servers if s.peer_id == session.session.chain[-1].peer_id)
        out = model.generate(ids, session=session, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             streamer=KillAfter(2, victim.kill))
        assert session.session.failovers >= 1 and session.session.chain[-1].peer_id == spare.peer_id
        ref = reference_model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        assert out.tolist() == ref.tolist()
        assert boundary.remote == 0  # fetched for the replay: transformers' inputs to block 15
        _assert_block_inputs(reference_model, ids, 15, boundary.read(held))
    finally:
        session.close()
        if spare is not None:
            spare.kill()


def _assert_block_inputs(reference_model, ids: torch.Tensor, block: int, got: torch.Tensor) -> None:
    """`got` [1, n, hidden] are transformers' inputs to `block` at the first n positions of `ids`."""
    with torch.no_grad():
        want = reference_model(ids, output_hidden_states=True).hidden_states[block][:, :got.shape[1]]
    assert got.shape == want.shape
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < 1e-3


def test_failover_of_the_server_that_kept_the_prefix_outputs_recomputes_them(
        prefix_swarm, model_path, bootstrap, system_ids, tokenizer, reference_model):
    """The first span's server, which kept its outputs at the adopted positions (the second span's inputs there), dies
    mid-generation: its replacement replays the client's own embeddings and its outputs are the second span's
    history now (equal to transformers'), and the tokens equal transformers'. (Last in this file: the earlier test
    killed the module's 15:30 server, so both spans get spares here.)"""
    model, servers, prefix = prefix_swarm
    extra = ["--update_period", "5", "--prefix_page_tokens", str(PAGE)]
    spares = [start_server(model_path, [bootstrap.maddr], span, prefix, extra, name=f"server-kept-{i}", threads=1)
              for i, span in enumerate(["0:15", "15:30"])]
    ids = _prompt(tokenizer, system_ids, "how many legs has a spider")
    session = model.inference_session(max_length=ids.shape[1] + 4 * NEW)
    session.prefix_salt = "tenant-a"
    try:
        for spare in spares:
            spare.wait_ready(300)
        model.manager.update(force=True)
        session.feed(ids)  # adopts the system prompt (written by the earlier tests' sessions on the 0:15 server)
        held = SYSTEM_PAGES * PAGE
        boundary = session.session._history[15]
        first = session.session.chain[0].peer_id
        if session.session.adopted_tokens != held:  # (routed to a spare with no pages: the next session adopts)
            session.close()
            session = model.inference_session(max_length=ids.shape[1] + 4 * NEW)
            session.prefix_salt = "tenant-a"
            session.feed(ids)
            boundary, first = session.session._history[15], session.session.chain[0].peer_id
        assert session.session.adopted_tokens == held and boundary.remote == held
        assert boundary.remote_source is not None and boundary.remote_source.hop.peer_id == first
        victim = next(s for s in [*servers, *spares] if s.peer_id == first)
        out = model.generate(ids, session=session, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             streamer=KillAfter(2, victim.kill))
        assert session.session.failovers >= 1 and session.session.chain[0].peer_id != first
        ref = reference_model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        assert out.tolist() == ref.tolist()
        assert boundary.remote == 0  # recomputed by the replacement's replay
        _assert_block_inputs(reference_model, ids, 15, boundary.read(held))
    finally:
        session.close()
        for spare in spares:
            spare.kill()
