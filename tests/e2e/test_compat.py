"""Releases that mix (issue 45): the previous release (the commit in `compat/previous_release`, exported with
`git archive` into a temporary folder and run with this venv, `PYTHONPATH` and the working directory pointing at it)
beside the current code, in one swarm of real processes.

- an old server 0:15 + a new server 15:30 under a new gateway: greedy chats equal transformers, the old server
  pushes decode steps to the new one, and the status shows both releases (make test: the one representative);
- the same two servers under `step_round` (issue 46): the old server's hops on the sessions' own streams, the new
  server's in round messages; greedy tokens equal transformers (make test: the only real old server under rounds);
- a new server 0:15 + an old server 15:30 under an old client: greedy `generate` equals transformers (extended);
- failover from an old server to a new one mid-generation (extended);
- training (gradients equal transformers' autograd) across an old and a new server (extended);
- a rolling upgrade: four old servers (two per span) replaced one at a time by new ones while four users stream
  greedy chats through a gateway: no request fails, every reply is transformers' text (extended).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Dict, List

import httpx
import pytest
import torch

from launch.topology import REPO, ManagedProcess, start_gateway, start_server, terminate_all, wait_all
from swarm import AutoDistributedModelForCausalLM
from swarm.wire import capabilities as C
from swarm.wire.records import ServerState, fetch_block_records
from tests.fixtures.gateway_fixtures import reference_text
from tests.fixtures.swarm_checks import KillAfter

PREVIOUS = (REPO / "compat" / "previous_release").read_text().strip()
PREVIOUS_RELEASE = "0.1.0"


@pytest.fixture(scope="module")
def previous_tree(tmp_path_factory) -> Path:
    """The previous release's source tree (`git archive`), run with this venv."""
    folder = tmp_path_factory.mktemp("previous_release")
    archive = folder / "tree.tar"
    try:
        with open(archive, "wb") as out:
            subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", PREVIOUS], stdout=out, check=True,
                           timeout=120)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot export the previous release {PREVIOUS[:10]} (no git history here?): {e}")
    tree = folder / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    archive.unlink()
    return tree


def old_env(tree: Path) -> Dict[str, str]:
    return {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}


def start_old_server(tree: Path, model_path: str, peers: List[str], span: str, prefix: str,
                     extra: List[str] = ()) -> ManagedProcess:  # type: ignore[assignment]
    """`swarmgate server` of the previous release (not yet waited for)."""
    args = ["server", model_path, "--initial_peers", *peers, "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
            "--block_indices", span, "--dht_prefix", prefix, "--num_threads", "1", *extra]
    return ManagedProcess(args, f"old-server-{prefix}-{span.replace(':', '-')}", env=old_env(tree), cwd=str(tree))


def releases(model, prefix: str) -> Dict[str, tuple]:
    """peer id -> (release, announced capabilities) of the online servers, as this release reads the records."""
    records = fetch_block_records(model.manager.dht, prefix, 30)
    return {peer: (info.version, info.capabilities) for block in records for peer, info in block.items()
            if info.state == ServerState.ONLINE}


def client(model_path: str, bootstrap, prefix: str, **kwargs):
    return AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[bootstrap.maddr],
                                                           dht_prefix=prefix, pad_head_rows=False, **kwargs)


# ---- old server first, new server second --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def old_first(previous_tree, model_path, bootstrap):
    prefix = "compat-old-first"
    old = start_old_server(previous_tree, model_path, [bootstrap.maddr], "0:15", prefix)
    new = start_server(model_path, [bootstrap.maddr], "15:30", prefix, threads=1, name=f"new-server-{prefix}")
    try:
        wait_all([old, new], 240)
    except BaseException:
        terminate_all([old, new])
        raise
    yield {"prefix": prefix, "old": old, "new": new}
    terminate_all([old, new])


def test_an_old_server_and_a_new_one_under_a_new_gateway(old_first, model_path, bootstrap, tokenizer,
                                                         reference_model):
    prefix, old, new = old_first["prefix"], old_first["old"], old_first["new"]
    model = client(model_path, bootstrap, prefix)
    gateway = start_gateway(model_path, [bootstrap.maddr], prefix, threads=1, name=f"gateway-{prefix}")
    try:
        # the old server really runs the previous release: a first-release record, without capabilities
        seen = releases(model, prefix)
        assert seen[old.peer_id] == (PREVIOUS_RELEASE, None), seen
        assert seen[new.peer_id] == (C.release(), C.OWN_CAPABILITIES), seen
        before = model.manager.server_info(old.peer_id).pushes_sent  # the old server's stats parse here
        url = gateway.ready["url"]
        for question in ("Name three rivers of Europe.", "What is 2 + 2?"):
            messages = [{"role": "user", "content": question}]
            body = {"model": "smollm2-135m-instruct", "messages": messages, "temperature": 0, "max_tokens": 16}
            reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == reference_text(tokenizer, reference_model,
                                                                                      messages, 16)
        # the client's own `generate` steps its session alone, with pushes: the old server pushes to the new one (the
        # gateway's engine rounds step a chain that mixes releases hop by hop through the client: issue 46)
        ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
        assert out.tolist() == reference_model.generate(ids, max_new_tokens=8, do_sample=False).tolist()
        assert model.manager.server_info(old.peer_id).pushes_sent > before  # old -> new pushes
        status = httpx.get(url + "/status.json", timeout=120).json()
        shown = {s["peer_id"]: s["version"] for s in status["servers"]}
        assert shown == {old.peer_id: PREVIOUS_RELEASE, new.peer_id: C.release()}, shown
    finally:
        gateway.terminate()
        model.close()


def test_rounds_across_an_old_server_and_a_new_one(old_first, model_path, bootstrap, tokenizer, reference_model):
    """`step_round` (issue 46) over a chain of an old server (no `rounds`, no `rpc_round`) and a new one: each
    session's hop on the old server goes on its own stream, the new server's hop in one round message; greedy tokens
    equal transformers."""
    from swarm.client.transport import rounds
    from swarm.runtime import aio

    prefix, new = old_first["prefix"], old_first["new"]
    model = client(model_path, bootstrap, prefix)
    sessions = [model.inference_session(max_length=32) for _ in range(3)]
    prompts = [tokenizer(text, return_tensors="pt")["input_ids"] for text in ("Rivers of Europe:", "2 + 2 =", "Hi")]
    try:
        head, ids, steps = sessions[0].head, [p.clone() for p in prompts], 5
        inputs = [head.embed(p) for p in ids]
        before = None
        for step in range(steps):
            outs = rounds.step_round([(s.session, x, None) for s, x in zip(sessions, inputs)])
            assert all(isinstance(out, torch.Tensor) for out in outs), outs
            if step == 0:  # the sessions are open now (the first step opened them)
                before = aio.run(rounds.round_stats(model.manager, new.peer_id))
            tokens = [head.head(out[:, -1]).argmax(-1, keepdim=True) for out in outs]  # [1, 1] each
            ids = [torch.cat([i, t], dim=1) for i, t in zip(ids, tokens)]
            inputs = [head.embed(t) for t in tokens]
        after = aio.run(rounds.round_stats(model.manager, new.peer_id))
        assert before is not None and after.messages - before.messages == steps - 1
        assert after.rows - before.rows == 3 * (steps - 1) and after.session_steps == before.session_steps
    finally:
        for s in sessions:
            s.close()
        rounds.close_round_streams(model.manager)
        model.close()
    for prompt, ours in zip(prompts, ids):
        ref = reference_model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        assert ours.tolist() == ref.tolist()


TEXTS = ["The capital of France is Paris, and the capital", "A quick brown fox jumps over the lazy dog again"]


def test_training_across_an_old_and_a_new_server(old_first, model_path, bootstrap, tokenizer, reference_model):
    """Forward and backward through an old server's blocks and a new server's: input gradients equal transformers'
    autograd."""
    from tests.fixtures.training import check_input_gradients  # the training tests' reference

    batch = torch.tensor([tokenizer(t)["input_ids"][:9] for t in TEXTS])  # [2, 9]
    model = client(model_path, bootstrap, old_first["prefix"])
    try:
        check_input_gradients(model, reference_model, batch)
        stats = model.manager.server_info(old_first["old"].peer_id)
        assert stats.training_tokens_processed > 0  # the old server did train
    finally:
        model.close()


# ---- new server first, old server second, old client ----------------------------------------------------------------
OLD_CLIENT = """
import json, sys, torch
from swarm import AutoDistributedModelForCausalLM
import swarm
assert swarm.__file__.startswith(sys.argv[4]), swarm.__file__  # the previous release's code
model = AutoDistributedModelForCausalLM.from_pretrained(sys.argv[1], initial_peers=[sys.argv[2]],
                                                        dht_prefix=sys.argv[3])
ids = torch.tensor([json.loads(sys.argv[5])])
out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
print("TOKENS " + json.dumps(out[0].tolist()), flush=True)
model.shutdown()
"""


def test_a_new_server_and_an_old_one_under_an_old_client(previous_tree, model_path, bootstrap, tokenizer,
                                                         reference_model):
    prefix = "compat-new-first"
    new = start_server(model_path, [bootstrap.maddr], "0:15", prefix, threads=1, name=f"new-server-{prefix}")
    old = start_old_server(previous_tree, model_path, [bootstrap.maddr], "15:30", prefix)
    try:
        wait_all([new, old], 240)
        ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
        run = subprocess.run([sys.executable, "-c", OLD_CLIENT, model_path, bootstrap.maddr, prefix,
                              str(previous_tree), json.dumps(ids[0].tolist())], capture_output=True, text=True,
                             timeout=300, cwd=previous_tree, env={**os.environ, **old_env(previous_tree)})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        tokens = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("TOKENS "))[7:])
        expected = reference_model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert tokens == expected[0].tolist()
    finally:
        terminate_all([new, old])


# ---- failover from an old server to a new one -----------------------------------------------------------------------
def test_failover_from_an_old_server_to_a_new_one(previous_tree, model_path, bootstrap, tokenizer, reference_model):
    prefix = "compat-failover"
    # the old server announces a higher throughput, so that sessions start on it
    old = start_old_server(previous_tree, model_path, [bootstrap.maddr], "0:30", prefix, ["--throughput", "1000"])
    new = start_server(model_path, [bootstrap.maddr], "0:30", prefix, ["--throughput", "10"], threads=1,
                       name=f"new-server-{prefix}")
    model = None
    try:
        wait_all([old, new], 240)
        model = client(model_path, bootstrap, prefix)
        ids = tokenizer("Rivers of Europe, from west to east:", return_tensors="pt")["input_ids"]
        with model.inference_session(max_length=ids.shape[1] + 16) as session:
            killed = []

            def kill_old():
                killed.append(session.session.chain[0].peer_id)  # the server the session ran on until now
                old.kill()

            out = model.generate(ids, session=session, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                 streamer=KillAfter(5, kill_old))
            assert killed == [old.peer_id] and session.session.failovers >= 1
            assert [hop.peer_id for hop in session.session.chain] == [new.peer_id]
        expected = reference_model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.tolist() == expected.tolist()
    finally:
        if model is not None:
            model.close()
        terminate_all([old, new])


# ---- a rolling upgrade ----------------------------------------------------------------------------------------------
QUESTIONS = ["Name three rivers of Europe.", "What is 2 + 2?", "Say hello in French.", "Name a large planet."]


class Chats(threading.Thread):
    """One user chatting through the gateway again and again (streamed, greedy) until `stop`: every reply is kept
    as (HTTP status, finish reason, text) or as the error that broke it."""

    def __init__(self, url: str, question: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.question, self.stop = url, question, stop
        self.replies: List[tuple] = []

    def run(self) -> None:
        body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": self.question}],
                "temperature": 0, "max_tokens": 16, "stream": True}
        while not self.stop.is_set() or not self.replies:
            text, finish, status = "", None, 0
            try:
                with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=300) as response:
                    status = response.status_code
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[len("data: "):])
                        if "error" in chunk:
                            finish = f"error: {chunk['error']}"
                            continue
                        for choice in chunk.get("choices", []):
                            text += (choice.get("delta") or {}).get("content") or ""
                            finish = choice.get("finish_reason") or finish
                self.replies.append((status, finish, text))
            except httpx.HTTPError as e:
                self.replies.append((status, f"broken: {e!r}", text))


def test_a_rolling_upgrade_under_streaming_chats(previous_tree, model_path, bootstrap, tokenizer, reference_model):
    """Four servers of the previous release (two per span) are replaced one at a time by the current release (stop,
    then start the new one on the same span) while four users stream greedy chats through a gateway: no request
    fails, and every reply is transformers' greedy text."""
    prefix = "compat-rolling"
    spans = ["0:15", "15:30", "0:15", "15:30"]
    olds = [start_old_server(previous_tree, model_path, [bootstrap.maddr], span, prefix) for span in spans]
    news: List[ManagedProcess] = []
    gateway = None
    stop = threading.Event()
    users: List[Chats] = []
    try:
        for i, proc in enumerate(olds):
            proc.name = f"{proc.name}-{i}"
        wait_all(olds, 300)
        expected = {q: reference_text(tokenizer, reference_model, [{"role": "user", "content": q}], 16)
                    for q in QUESTIONS}
        gateway = start_gateway(model_path, [bootstrap.maddr], prefix, threads=1, name=f"gateway-{prefix}")
        users = [Chats(gateway.ready["url"], q, stop) for q in QUESTIONS]
        for user in users:
            user.start()
        for i, (old, span) in enumerate(zip(olds, spans)):
            while sum(len(user.replies) for user in users) < i + 1:  # chats flow before each replacement
                assert all(user.is_alive() for user in users)
                time.sleep(0.5)
            assert old.terminate() == 0, old.log_tail()
            new = start_server(model_path, [bootstrap.maddr], span, prefix, threads=1,
                               name=f"new-server-{prefix}-{i}")
            news.append(new)
            new.wait_ready(300)
        stop.set()
        for user in users:
            user.join(600)
        model = client(model_path, bootstrap, prefix)
        try:
            seen = releases(model, prefix)
        finally:
            model.close()
        assert {peer: release for peer, (release, _) in seen.items()} == {n.peer_id: C.release() for n in news}
        for user in users:
            good = [reply for reply in user.replies
                    if reply[0] == 200 and reply[1] in ("stop", "length") and reply[2] == expected[user.question]]
            assert user.replies and len(good) == len(user.replies), \
                (user.question, expected[user.question], [r for r in user.replies if r not in good])
        print(f"\nrolling upgrade: {sum(len(user.replies) for user in users)} streamed chats, all complete and equal")
    finally:
        stop.set()
        if gateway is not None:
            gateway.terminate()
        terminate_all([*olds, *news])
