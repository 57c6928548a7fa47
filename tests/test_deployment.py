"""The deployment files: docker-compose.yml, the Dockerfile and configs/*.yaml are valid for our own CLI.

No Docker engine runs here, so the compose file is parsed and every `swarmgate` command in it is checked with
the real argument parsers and typed configs of its subcommand; the servers must cover every block.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from swarm.runtime.config import build_parser, load_config, parse_span

ROOT = Path(__file__).resolve().parents[1]
NUM_BLOCKS = 30


def _config_class(subcommand: str):
    if subcommand == "server":
        from server.server import ServerConfig

        return ServerConfig, "model"
    if subcommand == "gateway":
        from gateway.config import GatewayConfig

        return GatewayConfig, "model"
    if subcommand == "dht":
        from swarm.launch.bootstrap import BootstrapConfig

        return BootstrapConfig, None
    raise AssertionError(f"unexpected subcommand {subcommand}")


def _swarmgate_argv(command) -> list:
    """The argv after `swarmgate` in a compose command (a list, or `sh -c '... exec swarmgate ...'`)."""
    if command[:2] == ["sh", "-c"]:
        script = re.sub(r"\$\(head -n 1 [^)]*\)", "/ip4/10.0.0.1/tcp/31337/p2p/QmPeer", command[2])
        words = shlex.split(script.split("exec ", 1)[1])
    else:
        words = list(command)
    assert words[0] == "swarmgate", words
    return words[1:]


def _validate(argv: list):
    subcommand, args = argv[0], argv[1:]
    config_cls, positional = _config_class(subcommand)
    parser = build_parser(config_cls, f"swarmgate {subcommand}", "", positional=positional)
    return subcommand, load_config(config_cls, parser.parse_args(args), environ={})


def test_compose_topology_is_valid():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    parsed = {name: _validate(_swarmgate_argv(service["command"])) for name, service in services.items()}
    kinds = [kind for kind, _ in parsed.values()]
    assert kinds.count("dht") == 1 and kinds.count("gateway") == 1 and kinds.count("server") >= 2
    covered = []
    for name, (kind, config) in parsed.items():
        if kind == "server":
            start, end = parse_span(config.block_indices)
            covered += range(start, end)
            assert "bootstrap" in services[name]["depends_on"]
            assert config.initial_peers, name
    assert sorted(set(covered)) == list(range(NUM_BLOCKS))
    gateway = next(name for name, (kind, _) in parsed.items() if kind == "gateway")
    assert "8000:8000" in services[gateway]["ports"] and parsed[gateway][1].port == 8000
    for service in services.values():
        assert service["volumes"] and service["build"] == "."
    assert set(compose["volumes"]) >= {"shared", "cache"}


def test_dockerfile_pins_torch_before_the_project():
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    torch_line = next(i for i, line in enumerate(lines) if "torch==2.13.0" in line)
    project_line = next(i for i, line in enumerate(lines) if "pip install --no-cache-dir ." in line)
    assert torch_line < project_line


def test_local_yaml_matches_compose_topology():
    from swarm.launch.local_swarm import UpConfig

    config = load_config(UpConfig, yaml_path=str(ROOT / "configs" / "local.yaml"), environ={})
    covered = sorted(b for entry in config.servers for b in range(*parse_span(entry.block_indices)))
    assert covered == list(range(NUM_BLOCKS)) and config.gateway.enabled and config.gateway.port == 8000


def test_example_configs_load():
    from server.server import ServerConfig

    config = load_config(ServerConfig, yaml_path=str(ROOT / "configs" / "server.yaml"), environ={})
    assert config.model == "smollm2-135m-instruct"
