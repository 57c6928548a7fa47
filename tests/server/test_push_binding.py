"""Pushes are bound to their session: a peer that knows a live session's stream key cannot push into it.

Each session part gets a secret push token from its client (`OpenSession.push_token`), handed only to the previous
server of the chain (`PushTarget.push_token`); the server accepts a `PushStep` only with that token
(`server.rpc.push.PushRouter`). Here an outsider peer learns the stream key of a live session's second part and
pushes forged hidden states at it (no token, a wrong token, a step id far ahead so that a forged step would win
over the real ones): each push gets a `forbidden` reply, the session goes on with its greedy text equal to the
local reference, and the honest chain's own pushes still get through.
"""
from __future__ import annotations

import asyncio

import torch

from swarm.runtime import aio
from swarm.wire import protocol as P
from tests.fixtures.rpc_fuzzing import HIDDEN, fuzz_env, push_replies  # noqa: F401  (fuzz_env: a fixture)

PROMPT = "A short list of colors:"


def _push(manager, peer_id: str, key: str, token: str, position: int) -> list:
    """The replies to two forged pushes (step ids far ahead of the session's) on one push stream."""
    forged = [P.make_request(P.PushStep(stream_key=key, push_token=token, start_position=position,
                                        step_id=10**9 + i), [torch.full((1, 1, HIDDEN), 50.0)]) for i in range(2)]
    return push_replies(manager, peer_id, "rpc_push", forged)


def test_an_outsider_cannot_push_into_a_live_session(fuzz_env, tokenizer, reference_model):  # noqa: F811
    outsider, swarm, model = fuzz_env  # `outsider`: a SwarmManager with its own peer id, not the model's
    second = swarm["servers"][1].peer_id
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    expected = reference_model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    before = outsider.server_info(second)
    with model.inference_session(max_length=64) as session:
        half = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, session=session)
        victim = session.session._streams[1]  # the live part on the second server: its key is all an attacker needs
        assert victim.hop.peer_id == second
        position = session.session.position
        for token in ["", "x" * 32, victim.push_token[:-1] + ("A" if victim.push_token[-1] != "A" else "B")]:
            replies = _push(outsider, second, victim.key, token, position)
            assert len(replies) == 2 and all(isinstance(r, P.ErrorReply) and r.code == "forbidden"
                                             and "push token" in r.message for r in replies), replies
        out = model.generate(half, max_new_tokens=4, min_new_tokens=4, do_sample=False, session=session)
    assert out.tolist() == expected.tolist()
    after = outsider.server_info(second)
    assert after.pushes_refused - before.pushes_refused == 6
    assert after.steps_from_push - before.steps_from_push >= 6  # the honest chain's decode steps were pushed


def test_pushes_into_a_session_opened_without_a_token_are_refused(fuzz_env):  # noqa: F811
    """An old client's session (no push token) takes no pushes at all: its client's own copies carry the steps."""
    manager, swarm, _ = fuzz_env
    peer = swarm["servers"][1].peer_id
    queue: asyncio.Queue = asyncio.Queue()

    async def open_session():
        async def gen():
            while (item := await queue.get()) is not None:
                yield item

        responses = await manager.stub(peer).rpc_inference(gen())
        queue.put_nowait(P.make_request(P.OpenSession(session_id="tokenless", start=15, end=30, max_length=8)))
        return responses, P.decode_reply((await responses.__anext__()).metadata)

    responses, opened = aio.run(open_session(), timeout=60)
    try:
        assert isinstance(opened, P.StepResult)
        replies = _push(manager, peer, P.stream_key("tokenless", 15), "", 0)
        assert all(isinstance(r, P.ErrorReply) and "takes no pushes" in r.message for r in replies), replies

        async def step():
            queue.put_nowait(P.make_request(P.Step(start_position=0, step_id=1), [torch.randn(1, 1, HIDDEN)]))
            return P.decode_reply((await responses.__anext__()).metadata)

        reply = aio.run(step(), timeout=60)
        assert isinstance(reply, P.StepResult) and reply.position == 1  # nothing forged went in before it
    finally:
        queue.put_nowait(None)
        aio.run(responses.aclose(), timeout=30)
