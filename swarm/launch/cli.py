"""The `swarmgate` command: one entry point, a subcommand per process kind.

Each subcommand's `main` is imported by a function of its own when that subcommand runs, which keeps `swarmgate dht`
and `--help` light; the imports are plain ones, so that the layout test sees them: `swarm.launch` is the layer above
`server` and `gateway`, the only one that may import both.

The process ends here (`swarm.runtime.lifecycle.finish`): once the subcommand returned, its descendants are reaped
and the process exits without the interpreter's finalization (seconds of freeing a loaded model on a busy machine).
The subcommands' `main` functions do not reap nor exit, so that tests may call them in-process."""
from __future__ import annotations

import os
import sys
from typing import Callable, Dict, List, Tuple


def _prepare_model(argv: List[str]) -> int:
    from swarm.modeling.prepare import main as run

    return run(argv)


def _dht(argv: List[str]) -> int:
    from swarm.launch.bootstrap import main as run

    return run(argv)


def _server(argv: List[str]) -> int:
    from server.server import main as run

    return run(argv)


def _gateway(argv: List[str]) -> int:
    from gateway.app import main as run

    return run(argv)


def _status(argv: List[str]) -> int:
    from swarm.client.status import main as run

    return run(argv)


def _up(argv: List[str]) -> int:
    from swarm.launch.local_swarm import main as run

    return run(argv)


def _lab(argv: List[str]) -> int:
    from swarm.launch.latency_lab import main as run

    return run(argv)


COMMANDS: Dict[str, Tuple[Callable[[List[str]], int], str]] = {
    "prepare-model": (_prepare_model, "convert the bundled model into a safetensors checkpoint, print its path"),
    "dht": (_dht, "run a bootstrap DHT peer"),
    "server": (_server, "serve a range of a model's blocks"),
    "gateway": (_gateway, "serve the OpenAI-compatible HTTP API over the swarm"),
    "status": (_status, "print a swarm's servers and block coverage (no gateway needed)"),
    "up": (_up, "start a local swarm (bootstrap, servers, gateway) from a YAML file"),
    "lab": (_lab, "a local swarm over emulated wide-area links (needs root; README)"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: swarmgate {" + ",".join(COMMANDS) + "} ...\n")
        for name, (_, text) in COMMANDS.items():
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
    run = COMMANDS[argv[0]][0]
    try:
        code = run(argv[1:]) or 0
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
