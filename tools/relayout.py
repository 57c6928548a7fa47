"""The folder layout of issue 32: `gateway/`, `server/` and `tests/` split into sub-packages along their seams.

    python tools/relayout.py            # move what is still in an old place, then rewrite every reference
    python tools/relayout.py --check    # only list what would change (exit 1 if anything would)

Re-runnable: a file already moved stays where it is, and references already rewritten are left alone, so after
merging a branch written against the old layout, running it again moves nothing and fixes the merged files'
imports and paths. What it does, and nothing else (no other content changes, so that git's rename detection
carries other people's edits of the moved files across):

1. `git mv` each file of `MOVES` still at its old path (and creates the new packages' `__init__.py`, `PACKAGES`).
   In a moved test file, `Path(__file__).resolve().parents[N]` is deepened by the levels it moved down.
2. Rewrites references to moved modules in every tracked text file:
   - Python: the module names of `import` / `from ... import` statements (`from server import spans` becomes
     `from server.placement import spans`; a renamed module keeps its old name as an alias), and dotted names and
     paths inside strings, docstrings and comments. Code itself is not touched: `server.handler` in code is an
     attribute of a variable named `server`, never a module path.
   - Other text (Markdown, YAML, TOML, Makefile, Dockerfile, CI scripts): dotted module names (`gateway.runs`,
     `tests.faulty_server`) and file paths (`server/blocks.py`, `tests/test_verify.py::test_x`).
3. Sorts the import blocks of the files it changed (`ruff check --select I --fix`), when ruff is next to Python.

Where new files go: a new gateway module into the sub-package whose job it shares (`api/`: HTTP routes, request
checks, pages; `serving/`: running generations, sessions, streams; `structured/`: tools and grammars) or at the top
if every part uses it (as `errors`, `metrics`, `schemas`); a new server module into `compute/` (running blocks),
`rpc/` (handlers, limits) or `placement/` (where a server sits in the swarm: span, record, reachability); a new test
into the folder mirroring what it tests (`tests/gateway/`, `tests/server/`, `tests/swarm/<package>/`), or
`tests/e2e/` if it starts a swarm of real processes to test the system end to end; helpers into `tests/fixtures/`.
A module or test added in an old place by a branch written before this layout: add it to `MOVES` and run again.
"""
from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]


def _group(old_dir: str, new_dir: str, names: str) -> Dict[str, str]:
    return {f"{old_dir}/{name}.py": f"{new_dir}/{name}.py" for name in names.split()}


# old path -> new path
MOVES: Dict[str, str] = {
    # gateway: app.py (the process and its app factory), config.py, and what every part uses (errors, metrics,
    # schemas) stay at the top
    **_group("gateway", "gateway/api", "admission auth chat_page completions openapi params state status unsupported"),
    **_group("gateway", "gateway/serving", "engine events runs session_pool sessions textstream tokens verification"),
    **_group("gateway", "gateway/structured", "tools toolparse"),
    "gateway/structured.py": "gateway/structured/grammars.py",
    # server: server.py (the process: `swarmgate server`) and config.py stay at the top
    **_group("server", "server/compute", "blocks cache decode graphs kv_arena"),
    **_group("server", "server/rpc", "handler limits push training"),
    **_group("server", "server/placement", "announce memory pings reachable spans throughput"),
    "server/placement.py": "server/placement/policy.py",
    **_group("server", "server/placement", "liveness relay_watch"),
    **_group("gateway/responses", "gateway/api/responses", "__init__ convert output routes schemas store"),
    # tests: conftest.py and the tests of the project as a whole (layout, deployment files, benchmark reports) stay
    **_group("tests", "tests/fixtures", "browser faulty_server gateway_fixtures lora_fixtures openai_schemas "
                                        "tiny_checkpoints client_doubles openai_responses_schemas"),
    **_group("tests", "tests/server", "test_hole_liveness"),
    **_group("tests", "tests/swarm/client", "test_sole_retry"),
    **_group("tests", "tests/gateway", "test_api_property test_api_table test_responses test_responses_unit "
                                       "test_chat_page test_gateway test_gateway_auth "
                                       "test_gateway_concurrency test_gateway_failover test_gateway_unit "
                                       "test_gateway_verification_unit test_gateway_verify test_lora_gateway_unit "
                                       "test_openai_spec test_quant_gateway test_session_pool test_session_pool_unit "
                                       "test_status test_structured test_tools"),
    **_group("tests", "tests/server", "test_bad_input test_cache_budget test_decode test_fuzz_rpc test_fuzz_training "
                                      "test_graphs test_kv_arena test_limits test_lora test_memory test_placement "
                                      "test_push_binding test_quant test_throughput"),
    **_group("tests", "tests/swarm", "test_units"),
    **_group("tests", "tests/swarm/modeling", "test_disk_cache test_families test_family_bloom_falcon "
                                              "test_family_mixtral test_family_open_models test_layers "
                                              "test_sharded_checkpoint test_sliding_window test_smallgemm "
                                              "test_tensor_parallel test_family_deepseek test_longrope_crossing"),
    **_group("tests", "tests/swarm/client", "test_generation test_liveness test_lora_routing test_quant_routing "
                                            "test_routing test_speculative test_training_units"),
    **_group("tests", "tests/swarm/runtime", "test_dht_traffic test_swarm_key test_taskpool"),
    **_group("tests", "tests/swarm/wire", "test_compression test_reachability"),
    **_group("tests", "tests/swarm/launch", "test_latency_lab test_topology"),
    **_group("tests", "tests/e2e", "test_beam test_failover test_family_swarms test_gap_fill test_gpu_swarm "
                                   "test_lora_swarm test_multihost test_nat test_padding test_private_swarm "
                                   "test_quant_swarm test_self_placement test_shutdown test_swarm_e2e "
                                   "test_swarm_scale test_tensor_parallel_swarm test_training "
                                   "test_training_classification test_training_example test_training_failover "
                                   "test_verify"),
}

# new package -> its docstring (the `__init__.py` written when missing)
PACKAGES: Dict[str, str] = {
    "gateway/api": "The gateway's HTTP side: the OpenAI endpoints, request checks, keys, admission, the pages and the "
                   "process state they share.",
    "gateway/serving": "Running generations: the engine's worker threads, a request's run, sessions and their pool, "
                       "events, text streams, the tokenizer side, spot-check hold-back.",
    "gateway/structured": "Structured output and tools: tools in the prompt, tool calls parsed from the output, and "
                          "the grammar that constrains a request's decoding.",
    "server/compute": "Running a span of blocks: loading it, batched decode and prefill, CUDA graphs, the KV cache "
                      "and its arena.",
    "server/rpc": "A block server's RPCs: the inference, forward, push and training handlers and their limits.",
    "server/placement": "Where a server sits in the swarm: its DHT record, reachability, RTTs, what fits, how fast it "
                        "is, and which span it serves.",
    "tests": "swarmgate's tests; `tests/conftest.py` and `tests/fixtures/` hold the shared fixtures.",
    "tests/fixtures": "Shared test helpers: gateways, tiny checkpoints, LoRA adapters, a faulty server, a browser, "
                      "OpenAI schemas.",
    "tests/gateway": "Tests of the gateway (`gateway/`): in process and over real swarms.",
    "tests/server": "Tests of a block server's parts (`server/`).",
    "tests/swarm": "Tests of the swarm library (`swarm/`), one folder per package.",
    "tests/swarm/modeling": "Tests of `swarm.modeling`: families against transformers, checkpoints, layers.",
    "tests/swarm/client": "Tests of `swarm.client`: routing, generation, speculation, liveness.",
    "tests/swarm/runtime": "Tests of `swarm.runtime`: the compute thread, swarm keys, DHT traffic.",
    "tests/swarm/wire": "Tests of `swarm.wire`: compression, reachability messages.",
    "tests/swarm/launch": "Tests of `swarm.launch`: the topology launcher and the latency lab.",
    "tests/e2e": "End-to-end tests: swarms of real processes against local transformers.",
}

TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".txt", ".sh", ".json"}
TEXT_NAMES = {"Makefile", "Dockerfile", "run", ".dockerignore", ".gitignore"}
TOPS = ("gateway", "server", "tests")
LINE = 120  # ruff's line length (pyproject.toml)


def module_of(path: str) -> str:
    return path[:-len(".py")].replace("/", ".")


OLD_MODULES: Dict[str, str] = {module_of(old): module_of(new) for old, new in MOVES.items()}
NEW_MODULES = set(OLD_MODULES.values()) | {p.replace("/", ".") for p in PACKAGES}


def map_module(name: str) -> str:
    """A dotted name (a module, or a module's attribute) in the new layout; unchanged if nothing of it moved."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):  # already new (a new module, or in a new package): leave it
        if ".".join(parts[:i]) in NEW_MODULES and ".".join(parts[:i]) not in OLD_MODULES:
            return name
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in OLD_MODULES:
            # a name that is both an old module and a new package (server.placement, gateway.structured): new when
            # followed by one of the package's modules
            if i < len(parts) and prefix in NEW_MODULES and ".".join(parts[:i + 1]) in NEW_MODULES:
                return name
            return ".".join([OLD_MODULES[prefix], *parts[i:]])
    return name


DOTTED = re.compile(r"(?<![\w.])(?:" + "|".join(TOPS) + r")(?:\.\w+)+")
PATH = re.compile(r"(?<![\w.-])(?:" + "|".join(TOPS) + r")(?:/[\w.-]+)+\.py\b")


def rewrite_text(text: str) -> str:
    text = PATH.sub(lambda m: MOVES.get(m.group(0), m.group(0)), text)
    return DOTTED.sub(lambda m: map_module(m.group(0)), text)


def _import_edits(tokens: List[tokenize.TokenInfo]) -> List[Tuple[Tuple[int, int], Tuple[int, int], str]]:
    """Edits of the module names in `import` / `from ... import` statements."""
    edits = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        starts_statement = i == 0 or tokens[i - 1].type in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT,
                                                            tokenize.DEDENT, tokenize.COMMENT) or \
            (tokens[i - 1].type == tokenize.OP and tokens[i - 1].string in (":", ";"))
        if tok.type == tokenize.NAME and tok.string in ("import", "from") and starts_statement:
            if tok.string == "from":
                j = i + 1
                if tokens[j].type == tokenize.OP and tokens[j].string == ".":
                    i += 1
                    continue  # relative imports: not used in this project
                name, j = _dotted(tokens, j)
                assert tokens[j].string == "import", tokens[j]
                imported, aliases = _imported_names(tokens, j + 1)
                # `from server.placement import spans`: the new package, not the old module of that name
                new_module = name if any(f"{name}.{n}" in NEW_MODULES for n in imported) else map_module(name)
                moved_names = [n for n in imported if f"{name}.{n}" in OLD_MODULES]
                if moved_names:  # `from server import spans`: the names imported are moved modules
                    if len(imported) != 1:
                        raise SystemExit(f"cannot rewrite `from {name} import {', '.join(imported)}` (line "
                                         f"{tok.start[0]}): one moved module per statement, please")
                    new = OLD_MODULES[f"{name}.{imported[0]}"]
                    parent, _, base = new.rpartition(".")
                    text = f"{parent} import {base}" + ("" if base == imported[0] or aliases else
                                                       f" as {imported[0]}")
                    edits.append((tokens[i + 1].start, tokens[j + 1].end, text))
                elif new_module != name:
                    edits.append((tokens[i + 1].start, tokens[j - 1].end, new_module))
            else:
                j = i + 1
                while True:
                    start = tokens[j].start
                    name, j = _dotted(tokens, j)
                    if map_module(name) != name:
                        edits.append((start, tokens[j - 1].end, map_module(name)))
                    if tokens[j].type == tokenize.NAME and tokens[j].string == "as":
                        j += 2
                    if tokens[j].type == tokenize.OP and tokens[j].string == ",":
                        j += 1
                        continue
                    break
        i += 1
    return edits


def _dotted(tokens: List[tokenize.TokenInfo], j: int) -> Tuple[str, int]:
    parts = [tokens[j].string]
    j += 1
    while tokens[j].type == tokenize.OP and tokens[j].string == "." and tokens[j + 1].type == tokenize.NAME:
        parts.append(tokens[j + 1].string)
        j += 2
    return ".".join(parts), j


def _imported_names(tokens: List[tokenize.TokenInfo], j: int) -> Tuple[List[str], bool]:
    names, aliases = [], False
    while tokens[j].type not in (tokenize.NEWLINE, tokenize.ENDMARKER):
        tok = tokens[j]
        if tok.type == tokenize.NAME:
            if tok.string == "as":
                aliases = True
                j += 2
                continue
            names.append(tok.string)
        j += 1
    return names, aliases


def rewrite_python(source: str) -> str:
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    edits = _import_edits(tokens)
    for tok in tokens:
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            new = rewrite_text(tok.string)
            if new != tok.string:
                edits.append((tok.start, tok.end, new))
    if not edits:
        return source
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))

    def at(pos: Tuple[int, int]) -> int:
        return offsets[pos[0] - 1] + pos[1]

    out = source
    for start, end, text in sorted(edits, key=lambda e: at(e[0]), reverse=True):
        out = out[:at(start)] + text + out[at(end):]
    return out


def wrap_long_lines(source: str, path: Path) -> str:
    """Lines the rewrite made longer than `LINE`, broken at a space: in a comment (continued as a comment below, at
    the line's indentation) or in a docstring (continued at its indentation); others are reported, to fix by hand."""
    for _ in range(20):  # an overflow that joins the next line may make that one too long: it is broken in turn
        lines = source.splitlines(keepends=True)
        long = {i + 1 for i, line in enumerate(lines) if len(line.rstrip("\n")) > LINE and "noqa" not in line}
        if not long:
            return source
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        # line -> (column of the space, what starts the continuation, whether the next line goes on with the text)
        breaks: Dict[int, Tuple[int, str, bool]] = {}
        for k, tok in enumerate(tokens):
            if tok.type == tokenize.COMMENT and tok.start[0] in long and tok.start[1] < LINE - 10:
                row, line = tok.start[0], lines[tok.start[0] - 1]
                if set(line.rstrip("\n")[LINE:]) <= {"-", "="}:  # a rule (`# ---- title ----`): shortened
                    breaks[row] = (LINE, "", False)
                    continue
                cut = line.rfind(" ", tok.start[1] + 2, LINE + 1)
                if cut > 0:
                    prefix = " " * (len(line) - len(line.lstrip())) + "# "
                    whole = line.lstrip().startswith("#") and row < len(lines) and lines[row].startswith(prefix)
                    breaks[row] = (cut, prefix, whole)
            elif tok.type == tokenize.STRING and tok.string.endswith(('"""', "'''")) and \
                    (k == 0 or tokens[k - 1].type in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT,
                                                      tokenize.DEDENT, tokenize.ENCODING, tokenize.COMMENT)):
                indent = lines[tok.start[0] - 1][:tok.start[1]]
                for row in range(tok.start[0], tok.end[0] + 1):
                    if row in long and row not in breaks:
                        line = lines[row - 1]
                        own = indent if row == tok.start[0] else line[:len(line) - len(line.lstrip())]
                        item = re.match(r"(- |\* |\d+\. )", line[len(own):])  # a list item goes on under its text
                        own += " " * len(item.group(1)) if item and row > tok.start[0] else ""
                        first = tok.start[1] + 3 if row == tok.start[0] else 0
                        last = min(LINE + 1, tok.end[1] - 3 if row == tok.end[0] else len(line))
                        cut = line.rfind(" ", first + 1, last)
                        if cut > len(own):
                            breaks[row] = (cut, own if own.strip() == "" else "", row < tok.end[0])
        for row in sorted(breaks, reverse=True):
            cut, prefix, goes_on = breaks[row]
            line = lines[row - 1]
            rest = line[cut + 1:].rstrip("\n")
            if line.rstrip("\n")[cut:].strip("-=") == "":
                lines[row - 1] = line[:cut].rstrip() + "\n"
                continue
            following = lines[row] if row < len(lines) else ""
            if goes_on and following.startswith(prefix) and following[len(prefix):].strip() and \
                    not following[len(prefix):].startswith((" ", '"""', "'''", "- ", "#")):
                # the next line goes on with the same text: the overflow joins it rather than standing alone
                lines[row - 1] = line[:cut].rstrip() + "\n"
                lines[row] = prefix + rest + " " + following[len(prefix):]
            else:
                lines[row - 1] = line[:cut].rstrip() + "\n" + prefix + line[cut + 1:]
        new = "".join(lines)
        if new == source:
            break
        source = new
    for i, line in enumerate(source.splitlines()):
        if len(line) > LINE and "noqa" not in line:
            print(f"{path.relative_to(ROOT)}:{i + 1}: longer than {LINE} characters: wrap it by hand")
    return source


def deepen(source: str, levels: int) -> str:
    """`Path(__file__).resolve().parents[N]` of a file moved `levels` folders deeper."""
    return re.sub(r"(Path\(__file__\)\.resolve\(\)\.parents\[)(\d+)\]",
                  lambda m: f"{m.group(1)}{int(m.group(2)) + levels}]", source)


def tracked_files() -> List[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines() if line]


def is_text(path: Path) -> bool:
    return path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES


def move(check: bool) -> List[str]:
    done = []
    for package, doc in PACKAGES.items():
        init = ROOT / package / "__init__.py"
        if not init.exists():
            done.append(f"create {package}/__init__.py")
            if not check:
                init.parent.mkdir(parents=True, exist_ok=True)
                init.write_text('"""' + textwrap.fill(doc, width=LINE - 3) + '"""\n')
                subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
    for old, new in MOVES.items():
        if not (ROOT / old).exists():
            continue
        if (ROOT / new).exists():
            raise SystemExit(f"both {old} and {new} exist: merge them by hand first")
        done.append(f"git mv {old} {new}")
        if check:
            continue
        (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "mv", old, new], cwd=ROOT, check=True)
        levels = new.count("/") - old.count("/")
        if levels:
            text = (ROOT / new).read_text()
            if deepen(text, levels) != text:
                (ROOT / new).write_text(deepen(text, levels))
    return done


# written for the new layout only: its "server.placement" and "gateway.structured" are the new packages, which the
# old modules' names would rewrite
LAYOUT_TEST = ROOT / "tests" / "test_layout.py"
# imports both layouts on purpose (the decode loop's cost before and after the move)
KEEP = {LAYOUT_TEST, ROOT / "bench" / "bench_decode_loop.py"}


def rewrite(check: bool) -> List[Path]:
    changed = []
    for path in tracked_files():
        if not path.is_file() or not is_text(path) or path == Path(__file__).resolve() or path in KEEP:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new = wrap_long_lines(rewrite_python(text), path) if path.suffix == ".py" else rewrite_text(text)
        if new != text:
            changed.append(path)
            if not check:
                path.write_text(new)
    return changed


def sort_imports(paths: List[Path]) -> None:
    ruff: Optional[Path] = Path(sys.executable).parent / "ruff"
    py = [str(p) for p in paths if p.suffix == ".py"]
    if py and ruff is not None and ruff.exists():
        subprocess.run([str(ruff), "check", "--select", "I", "--fix", "--quiet", *py], cwd=ROOT, check=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="list what would change, change nothing")
    args = parser.parse_args(argv)
    moved = move(args.check)
    changed = rewrite(args.check)
    for line in moved:
        print(line)
    for path in changed:
        print(f"rewrote {path.relative_to(ROOT)}")
    if not args.check:
        sort_imports(changed)
    return 1 if args.check and (moved or changed) else 0


if __name__ == "__main__":
    sys.exit(main())
