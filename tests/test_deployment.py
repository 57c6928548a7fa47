"""The deployment files: docker-compose.yml, the Dockerfile and configs/*.yaml are valid for our own CLI.

No Docker engine runs here. The compose file is validated by a real compose implementation (`docker-compose
config`, Debian's `docker-compose` package, installed by the `docker_compose` fixture when missing and this is
root; the test skips, saying why, where it cannot be), and every `swarmgate` command in it, as compose resolves
it, is checked with the real argument parsers and typed configs of its subcommand; the servers must cover every
block, and every service has a healthcheck whose probe is real Python.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
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
        from launch.bootstrap import BootstrapConfig

        return BootstrapConfig, None
    raise AssertionError(f"unexpected subcommand {subcommand}")


def _swarmgate_argv(command) -> list:
    """The argv after `swarmgate` in a compose command (a list, or `sh -c '... exec swarmgate ...'`)."""
    if command[:2] == ["sh", "-c"]:
        script = command[2].replace("$$", "$")  # compose's escape: the container's shell sees one `$`
        script = re.sub(r"\$\(head -n 1 [^)]*\)", "/ip4/10.0.0.1/tcp/31337/p2p/QmPeer", script)
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
    _check_topology(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def _ports(service: dict) -> set:
    """(published, target) pairs, from the short "8000:8000" form or compose's resolved long form."""
    pairs = set()
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            pairs.add((int(entry["published"]), int(entry["target"])))
        else:
            published, target = str(entry).split(":")[-2:]
            pairs.add((int(published), int(target)))
    return pairs


def _check_topology(compose: dict) -> None:
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
    assert (8000, 8000) in _ports(services[gateway]) and parsed[gateway][1].port == 8000
    for service in services.values():
        assert service["volumes"] and service["build"] in (".", {"context": str(ROOT)})
    assert set(compose["volumes"]) >= {"shared", "cache"}


@pytest.fixture(scope="session")
def docker_compose() -> str:
    """The `docker-compose` command: Debian's package, installed here (as root, with apt) when missing."""
    found = shutil.which("docker-compose")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("docker-compose is not installed and cannot be (needs root and apt-get): "
                    "apt-get install docker-compose")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    result = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "docker-compose"],
                            capture_output=True, text=True, env=env, timeout=900)
    if result.returncode != 0:  # e.g. stale package lists: refresh once
        subprocess.run(["apt-get", "update"], capture_output=True, env=env, timeout=300)
        result = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "docker-compose"],
                                capture_output=True, text=True, env=env, timeout=900)
    found = shutil.which("docker-compose")
    if not found:
        pytest.skip(f"docker-compose could not be installed with apt-get: {result.stderr.strip()[-300:]}")
    return found


def test_docker_compose_config_accepts_the_file_with_healthchecks(docker_compose):
    result = subprocess.run([docker_compose, "-f", str(ROOT / "docker-compose.yml"), "config"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env={**os.environ, "DOCKER_HOST": ""})
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)  # the file as compose would run it: anchors merged, `$$` kept
    _check_topology(resolved)
    ports = {"bootstrap": 31337, "server0": 31338, "server1": 31339, "gateway": 8000}
    for name, service in resolved["services"].items():
        check = service["healthcheck"]
        assert check["test"][:3] == ["CMD", "python", "-c"], name
        compile(check["test"][3], f"{name} healthcheck", "exec")  # the probe is valid Python
        assert str(ports[name]) in check["test"][3], name
        assert {"interval", "timeout", "retries", "start_period"} <= set(check), name
    assert "/health" in resolved["services"]["gateway"]["healthcheck"]["test"][3]
    for server in ("server0", "server1"):
        assert resolved["services"][server]["depends_on"]["bootstrap"]["condition"] == "service_healthy"


def test_docker_compose_config_rejects_a_broken_file(docker_compose, tmp_path):
    """The validator is not a rubber stamp: an unescaped `$(...)` (compose interpolation) is an error."""
    broken = (ROOT / "docker-compose.yml").read_text().replace("$$(head", "$(head")
    (tmp_path / "docker-compose.yml").write_text(broken)
    result = subprocess.run([docker_compose, "-f", str(tmp_path / "docker-compose.yml"), "config"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "interpolation" in result.stderr


def test_dockerfile_pins_torch_before_the_project():
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    torch_line = next(i for i, line in enumerate(lines) if "torch==2.13.0" in line)
    project_line = next(i for i, line in enumerate(lines) if "pip install --no-cache-dir ." in line)
    assert torch_line < project_line


def test_local_yaml_matches_compose_topology():
    from launch.local_swarm import UpConfig

    config = load_config(UpConfig, yaml_path=str(ROOT / "configs" / "local.yaml"), environ={})
    covered = sorted(b for entry in config.servers for b in range(*parse_span(entry.block_indices)))
    assert covered == list(range(NUM_BLOCKS)) and config.gateway.enabled and config.gateway.port == 8000


def test_example_configs_load():
    from server.server import ServerConfig

    config = load_config(ServerConfig, yaml_path=str(ROOT / "configs" / "server.yaml"), environ={})
    assert config.model == "smollm2-135m-instruct"
