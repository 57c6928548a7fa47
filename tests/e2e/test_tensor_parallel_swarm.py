"""A split server in a real swarm: two server processes on a tiny random qwen2 checkpoint (q/k/v biases, a sliding
window of 4 on its upper layers that the prompts outgrow), blocks 0:2 unsplit and 2:4 with
`--tensor_parallel_devices cpu cpu`, against transformers running the same checkpoint: greedy tokens for 3 prompts,
4 concurrent sessions (batched on the servers) equal their single runs, a beam search, and a training step's input
gradients; the split server's DHT record says it is split. Bad `--tensor_parallel_devices` values: one line,
exit 2, before the DHT starts. Extended tier: a session fails over between two split servers.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from launch.topology import REPO, start_server, terminate_all, wait_all
from swarm import AutoDistributedModelForCausalLM
from tests.fixtures.swarm_checks import lockstep_sessions
from tests.fixtures.tiny_checkpoints import save_tiny
from tests.fixtures.training import loss_of, reference_grads

PROMPTS = ["The history of the Roman Empire begins", "def fibonacci(n):\n    ",
           "Three things every gardener should know about soil are", "Once upon a time, in a land far away"]
NEW_TOKENS = 8
WINDOW = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_path):
    path = tmp_path_factory.mktemp("tp-swarm") / "tiny-qwen2"
    reference = save_tiny("qwen2", path, model_path, chat_template=False, **WINDOW)
    return path, reference


@pytest.fixture(scope="module")
def split_swarm(tiny, bootstrap):
    path, _ = tiny
    prefix = "tp-swarm"
    servers = wait_all([start_server(str(path), [bootstrap.maddr], "0:2", prefix, threads=1),
                        start_server(str(path), [bootstrap.maddr], "2:4", prefix, threads=1,
                                     extra=["--tensor_parallel_devices", "cpu", "cpu"])])
    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=[bootstrap.maddr],
                                                            dht_prefix=prefix, pad_head_rows=False)
    yield servers, model
    model.shutdown()
    terminate_all(servers)


def _generate(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


def test_split_server_generates_as_transformers(tiny, split_swarm, tokenizer):
    path, reference = tiny
    servers, model = split_swarm
    assert servers[1].ready["tensor_parallel_devices"] == ["cpu", "cpu"]
    records = {s.start: s.info for s in model.manager.update(force=True)}
    assert records[2].tensor_parallel == 2 and records[0].tensor_parallel == 1
    prompts = [tokenizer(p, return_tensors="pt")["input_ids"] for p in PROMPTS]
    assert all(ids.shape[1] > 4 for ids in prompts)  # past the window
    singles = []
    for ids in prompts:
        ours = _generate(model, ids)
        assert ours.tolist() == _generate(reference, ids).tolist()
        singles.append(ours)
    beams = _generate(model, prompts[0], num_beams=3)  # the split cache's rows reordered by the beams
    assert beams.tolist() == _generate(reference, prompts[0], num_beams=3).tolist()

    # four sessions in lockstep: their steps batch on the servers, each equals its single run
    outputs = lockstep_sessions(model, prompts, NEW_TOKENS)
    assert [o.tolist() for o in outputs] == [s.tolist() for s in singles]
    assert model.manager.server_info(servers[1].ready["peer_id"]).largest_batch >= 2


def test_split_server_training_gradients_equal_transformers(tiny, split_swarm, tokenizer):
    _, reference = tiny
    _, model = split_swarm
    batch = torch.tensor([tokenizer(t)["input_ids"][:6] for t in PROMPTS[:3]])  # [3, 6]
    embeds = model.embed_tokens(batch).detach().requires_grad_(True)
    loss = loss_of(model(inputs_embeds=embeds).logits, batch)
    loss.backward()
    ref_loss, (ref_grad,) = reference_grads(reference, batch)
    assert abs(loss.item() - ref_loss.item()) < 1e-4
    assert embeds.grad is not None and embeds.grad.abs().max() > 1e-6
    torch.testing.assert_close(embeds.grad, ref_grad, atol=1e-5, rtol=1e-3)


def test_bad_tensor_parallel_devices_exit_2_before_the_dht(tiny, model_path, capsys, monkeypatch):
    """Each: one `error:` line naming the reason, exit 2, before the DHT starts (in process: `start_dht` never
    called); once through the real command line."""
    import server.network.identity as network_module
    import server.server as server_module
    from server.config import ServerConfig

    path, _ = tiny
    started: list = []
    monkeypatch.setattr(network_module, "start_dht", lambda config: started.append(config))

    def errors() -> list:
        return [line for line in capsys.readouterr().err.splitlines() if "error:" in line]

    for devices, message in [(["cpu", "nonsense"], "unknown device 'nonsense'"),
                             (["cuda:0", "cuda:0"], "cuda:0 is named twice"), (["cpu"], "at least 2 devices")]:
        with pytest.raises(SystemExit) as exit_info:  # a config error: argparse's usage line and one error line
            server_module.main([str(path), "--new_swarm", "--tensor_parallel_devices", *devices])
        lines = errors()
        assert exit_info.value.code == 2 and len(lines) == 1 and message in lines[0]
    for model, devices, message in [(path, ["cpu"] * 3, "3 devices do not divide the model's 2 key/value heads"),
                                    (model_path, ["cpu"] * 2, "2 devices do not divide the model's 3 key/value heads")]:
        assert server_module.main([str(model), "--new_swarm", "--tensor_parallel_devices", *devices]) == 2
        lines = errors()
        assert len(lines) == 1 and message in lines[0] and lines[0].startswith("error: --tensor_parallel_devices")
    monkeypatch.setenv("SWARMGATE_TENSOR_PARALLEL_DEVICES", "cpu cpu cpu")  # the environment, like every flag
    assert server_module.main([str(path), "--new_swarm"]) == 2 and "3 devices" in errors()[0]
    assert ServerConfig(model="m", tensor_parallel_devices=["cpu", "cpu"]).devices == ["cpu"]
    assert not started

    r = subprocess.run([sys.executable, "-m", "launch.cli", "server", model_path, "--new_swarm",
                        "--tensor_parallel_devices", "cpu", "cpu"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and "do not divide the model's 3 key/value heads" in lines[0]


def test_failover_replays_a_session_onto_a_split_server(tiny, bootstrap, tokenizer):
    """(extended) Two split servers of blocks 2:4: the one a session uses dies mid-generation (past the window);
    the session replays its history onto the other and the greedy tokens equal transformers'."""
    from tests.fixtures.swarm_checks import check_failover_replay

    path, reference = tiny
    prefix = "tp-failover"
    split = ["--tensor_parallel_devices", "cpu", "cpu"]
    servers = wait_all([start_server(str(path), [bootstrap.maddr], "0:2", prefix, threads=1),
                        start_server(str(path), [bootstrap.maddr], "2:4", prefix, split, threads=1, name="tp-a"),
                        start_server(str(path), [bootstrap.maddr], "2:4", prefix, split, threads=1, name="tp-b")])
    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=[bootstrap.maddr],
                                                            dht_prefix=prefix, ban_timeout=60, max_retries=2)
    try:
        check_failover_replay(model, reference, tokenizer(PROMPTS[2], return_tensors="pt")["input_ids"],
                              {s.peer_id: s for s in servers})
    finally:
        model.shutdown()
        terminate_all(servers)
