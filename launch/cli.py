"""The `swarmgate` command: one entry point, a subcommand per process kind.

Each subcommand's `main` is imported when that subcommand runs (`run_command`), which keeps `swarmgate dht` and
`--help` light; the imports are plain ones, so that the layout test sees them: `launch` is the layer above
`server` and `gateway`, the only one that may import both.

The process ends here (`swarm.runtime.lifecycle.finish`): once the subcommand returned, its descendants are reaped
and the process exits without the interpreter's finalization (seconds of freeing a loaded model on a busy machine).
The subcommands' `main` functions do not reap nor exit, so that tests may call them in-process."""
from __future__ import annotations

import os
import sys
from typing import List

COMMANDS = {
    "prepare-model": "convert the bundled model into a safetensors checkpoint, print its path",
    "dht": "run a bootstrap DHT peer",
    "server": "serve a range of a model's blocks",
    "gateway": "serve the OpenAI-compatible HTTP API over the swarm",
    "keys": "create, list and revoke the gateway's API keys, read their usage (its state store)",
    "status": "print a swarm's servers and block coverage (no gateway needed)",
    "up": "start a local swarm (bootstrap, servers, gateway) from a YAML file",
    "lab": "a local swarm over emulated wide-area links (needs root; README)",
}


def run_command(name: str, argv: List[str]) -> int:
    """Import the entry point of subcommand `name` (only that one) and run it."""
    if name == "prepare-model":
        from swarm.modeling.prepare import main as entry
    elif name == "dht":
        from launch.bootstrap import main as entry
    elif name == "server":
        from server.server import main as entry
    elif name == "gateway":
        from gateway.app import main as entry
    elif name == "keys":
        from gateway.keys_cli import main as entry
    elif name == "status":
        from swarm.client.transport.status import main as entry
    elif name == "up":
        from launch.local_swarm import main as entry
    elif name == "lab":
        from launch.latency_lab import main as entry
    else:
        raise ValueError(f"unknown command {name!r}")
    return entry(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from swarm.wire.capabilities import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, release

        print(f"swarmgate {release()} (protocol {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION})")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: swarmgate {" + ",".join(COMMANDS) + "} ...  (or --version)\n")
        for name, text in COMMANDS.items():
            print(f"  {name:14s} {text}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nerror: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    from swarm.runtime import lifecycle, malloc
    from swarm.runtime.threads import tune_openmp_env

    tune_openmp_env()
    if argv[0] == "server":  # its weights stream through the cores every step: huge pages (swarm.runtime.malloc)
        malloc.tune_allocator_env()
        # hivemind's MPFuture state bytes in shared memory by fd, not as files, which start a torch_shm_manager
        # process per server (56 MB of its own, a third of an idle server's); set before hivemind is imported
        os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
    lifecycle.become_subreaper()  # p2pd stays our descendant even if its DHT process dies first
    try:
        code = run_command(argv[0], argv[1:]) or 0
    except SystemExit as e:  # argparse errors and --help, a server whose DHT process died
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        lifecycle.reap_descendants()
        raise
    return lifecycle.finish(code)


if __name__ == "__main__":
    sys.exit(main())
