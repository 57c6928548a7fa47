"""The package layout's rules, read from the source: no import cycles, and each layer imports only those below it.

Every import statement counts, wherever it is: at module level, inside functions (the lazy imports that keep a
process light) and under `if TYPE_CHECKING:`. Layers, lowest first: `swarm.runtime` (process plumbing) and
`swarm.wire` (messages, records); `swarm.modeling` (model code); `swarm.client` (routing, sessions, the client
model); `server` and `gateway`, which never import each other (and `server` never the client); `launch` on
top: the `swarmgate` command imports each subcommand's entry point (`server.server`, `gateway.app`,
`swarm.client.transport.status`, ...), and its topology starts processes by module name. Inside `server` and `gateway`,
the sub-packages have an order too (`SUBLAYERS`): a server's `compute` (running blocks) imports neither its `rpc` nor
its `placement`, `rpc` not `placement`, and its `network` (the DHT peer, p2pd, reachability and relay: one
`ServerNetwork`) neither imports nor is imported by the other three, only by the supervisor; the gateway's
`serving` and `structured` never import its HTTP side, `api`, and `structured` (grammars, the tool format) not
`serving` (which renders tools into prompts through it). Under `tests/`, no module imports a test module (a file
named test_*.py): shared helpers live in `tests/fixtures/`.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("swarm", "server", "gateway", "launch")

# which top-level areas each area may import (itself always included)
ALLOWED = {
    "swarm.runtime": {"swarm.runtime", "swarm"},
    "swarm.wire": {"swarm.wire", "swarm.runtime", "swarm"},
    "swarm.modeling": {"swarm.modeling", "swarm.wire", "swarm.runtime", "swarm"},
    "swarm.client": {"swarm.client", "swarm.wire", "swarm.modeling", "swarm.runtime", "swarm"},
    "launch": {"launch", "server", "gateway", "swarm.client", "swarm.runtime", "swarm.wire",
                     "swarm.modeling", "swarm"},
    "swarm": {"swarm", "swarm.runtime", "swarm.wire", "swarm.client"},  # swarm.wire: __version__ (its release)
    "server": {"server", "swarm.wire", "swarm.modeling", "swarm.runtime", "swarm"},
    "gateway": {"gateway", "swarm.client", "swarm.wire", "swarm.modeling", "swarm.runtime", "swarm"},
}

# sub-package -> the sub-packages of the same process it must not import
SUBLAYERS = {
    # the server: compute < rpc < placement; its network identity (DHT peer, p2pd, reachability, relay) stands apart,
    # seen only by the supervisor (`server.server`): placement and the handlers get a DHT handle or a p2pd from it
    "server.compute": {"server.rpc", "server.placement", "server.network"},
    "server.rpc": {"server.placement", "server.network"},
    "server.placement": {"server.network"},
    "server.network": {"server.compute", "server.rpc", "server.placement"},
    "gateway.serving": {"gateway.api"},
    "gateway.structured": {"gateway.api", "gateway.serving"},  # serving renders tools (structured.tools) in prompts
    "gateway.store": {"gateway.api", "gateway.serving", "gateway.structured"},  # state below the HTTP side
    # the client along its seams: transport (sessions, routing) < decoding (the loop, sampling) < model
    "swarm.client.transport": {"swarm.client.decoding", "swarm.client.model"},
    "swarm.client.decoding": {"swarm.client.model"},
}

# Import cycles known and being removed; each pair imports both ways (checked, so that a stale entry is noticed).
KNOWN_CYCLES: Set[FrozenSet[str]] = set()  # pairs tolerated for now (none: each entry must still be a cycle)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def imports(path: Path, top_level_only: bool) -> Iterator[str]:
    """The project modules `path` imports (`from a.b import c` yields a.b and a.b.c; the caller keeps known ones)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # module-level statements, including those inside `if`/`try` at module level, except the
        # type-only imports under `if TYPE_CHECKING:`, which never run
        nodes = [n for stmt in tree.body for n in ast.walk(stmt)
                 if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and not (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Name)
                          and stmt.test.id == "TYPE_CHECKING")]
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            for alias in node.names:
                yield f"{node.module}.{alias.name}"


def area(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "swarm" and len(parts) > 1 and parts[1] in ("runtime", "wire", "modeling", "client"):
        return ".".join(parts[:2])
    return parts[0]


def graph(top_level_only: bool) -> Dict[str, Set[str]]:
    known = modules()
    return {name: {m for m in imports(path, top_level_only) if m in known and m != name}
            for name, path in known.items()}


def find_cycle(edges: Dict[str, Set[str]]) -> List[str]:
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_import_cycles():
    """Over every import, also those inside functions (a lazy import still ties the two modules together)."""
    edges = graph(top_level_only=False)
    # a package's __init__ importing its own modules is not a cycle through the package
    edges = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in edges.items()}
    for pair in KNOWN_CYCLES:
        a, b = sorted(pair)
        assert b in edges[a] and a in edges[b], f"{a} <-> {b} is no longer a cycle: remove it from KNOWN_CYCLES"
    edges = {m: {d for d in deps if frozenset({m, d}) not in KNOWN_CYCLES} for m, deps in edges.items()}
    assert find_cycle(edges) == []


def test_imports_inside_functions_are_seen(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import a\n\ndef f():\n    from b.c import d\n\nclass K:\n    def g(self):\n        import e\n")
    assert set(imports(source, top_level_only=False)) == {"a", "b.c", "b.c.d", "e"}
    assert set(imports(source, top_level_only=True)) == {"a"}


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def violations() -> List[Tuple[str, str]]:
    out = []
    for name, deps in graph(top_level_only=False).items():
        allowed = ALLOWED[area(name)]
        out += [(name, dep) for dep in sorted(deps) if area(dep) not in allowed]
    return out


def test_layers_import_only_what_is_below_them():
    assert violations() == []


def sub_package(module: str) -> str:
    depth = 3 if module.startswith(("swarm.client.", "swarm.modeling.")) else 2
    return ".".join(module.split(".")[:depth])


def test_sub_packages_import_only_what_is_below_them():
    known = modules()
    assert {sub_package(m) for m in known} >= set(SUBLAYERS), "a sub-package of SUBLAYERS is gone: update it"
    bad = [(name, dep) for name, deps in graph(top_level_only=False).items() for dep in sorted(deps)
           if sub_package(dep) in SUBLAYERS.get(sub_package(name), ())]
    assert bad == []


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_says_what_it_owns(package):
    missing = [name for name, path in modules().items()
               if name.startswith(package) and ast.get_docstring(ast.parse(path.read_text())) is None]
    assert missing == []


def test_the_gateway_uses_the_client_only_through_its_api():
    """One door: `gateway/` imports `swarm.client.api` (the protocols, the decode loop, value types and errors) and
    no other client module, at any depth (the client model itself comes from the `swarm` package's front,
    `swarm.AutoDistributedModelForCausalLM`, in `gateway.app.load_model`)."""
    side_doors = sorted((name, dep) for name, deps in graph(top_level_only=False).items() if area(name) == "gateway"
                        for dep in deps if area(dep) == "swarm.client" and dep != "swarm.client.api")
    assert side_doors == []


def test_a_stale_extended_prefix_is_found(tmp_path):
    """`tests/conftest.py` refuses a run whose EXTENDED names a test that no longer exists (a renamed test would
    otherwise move silently into `make test`, or out of every tier)."""
    from tests.conftest import stale_extended

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("")
    ids = ["tests/test_a.py::test_one[x]", "tests/test_a.py::test_two"]
    prefixes = ("tests/test_a.py::test_one", "tests/test_a.py::test_gone", "tests/test_b.py::", "tests/test_a.py::")
    assert stale_extended(prefixes, ids, tmp_path) == ["tests/test_a.py::test_gone", "tests/test_b.py::"]
    assert stale_extended(prefixes[1:2], [], tmp_path) == []  # a file this run did not collect is not judged


def imported_test_modules(path: Path, root: Path) -> Iterator[str]:
    """The test modules (files named test_*.py under `root`) that `path` imports, at any depth, by absolute or
    relative import (`from tests.a.test_b import x`, `from tests.a import test_b`, `import tests.a.test_b`,
    `from .test_b import x`); once per import of one."""
    package = list(path.relative_to(root).parent.parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (package[:len(package) - node.level + 1] if node.level else []) + (node.module or "").split(".")
            base = [part for part in base if part]
            names = [".".join(base)] + [".".join(base + [alias.name]) for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[-1].startswith("test_") and root.joinpath(*parts).with_suffix(".py").is_file():
                yield name


def test_no_test_module_imports_another():
    """A helper that several test modules use lives in `tests/fixtures/` (or a conftest.py), not in one of them:
    importing a test module into another runs its module-level code twice, and pytest would find the fixtures it
    defines under another module's name (issue 44)."""
    found = sorted((str(path.relative_to(REPO)), name) for path in sorted((REPO / "tests").rglob("*.py"))
                   for name in imported_test_modules(path, REPO))
    assert found == []


def test_an_imported_test_module_is_seen(tmp_path):
    (tmp_path / "tests" / "a").mkdir(parents=True)
    for name in ("test_b.py", "helpers.py", "test_c.py"):
        (tmp_path / "tests" / "a" / name).write_text("")
    source = tmp_path / "tests" / "a" / "test_c.py"
    source.write_text("from tests.a.test_b import x\nfrom tests.a import helpers, test_b\nimport tests.a.test_b\n"
                      "def f():\n    from .test_b import y\n    from . import test_b\n"
                      "    from tests.a.helpers import z\n")
    assert sorted(set(imported_test_modules(source, tmp_path))) == ["tests.a.test_b"]
    assert len(list(imported_test_modules(source, tmp_path))) == 5


def test_unit_files_name_their_real_process_sibling():
    """Test file names follow one rule: `test_X_unit.py` holds the in-process tests (no server or gateway process) of
    what `test_X.py`, somewhere under tests/, checks with real processes; a file with no such sibling has no suffix
    (and no `_units`, `_unit_tests` variants)."""
    names = {path.name for path in (REPO / "tests").rglob("test_*.py")}
    orphans = sorted(name for name in names
                     if name.endswith("_unit.py") and name.replace("_unit.py", ".py") not in names)
    variants = sorted(name for name in names if name.endswith(("_units.py", "_unit_tests.py")))
    assert orphans == [] and variants == []
