"""A family's facts live in its spec (`swarm.modeling.families.FamilySpec`) and nowhere else: no code outside the
families package decides by a family's name (`model_type`). Read from the source: a string literal equal to a
`FAMILIES` key is a decision when it is compared (`==`, `!=`, `in`, `not in`, alone or in a tuple, list or set of
them), a dict key, or an element of a tuple / list / set (a table of families). Allowed: the families package
itself, and the conversion of a checkpoint's config into a model config (`swarm.modeling.model_config`: each
family's defaults and the names of its config fields, as transformers' config classes have them per family)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Tuple

from swarm.modeling.families import FAMILIES

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("swarm", "server", "gateway", "launch")
ALLOWED = ("swarm/modeling/families/", "swarm/modeling/model_config.py")


def _family(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in FAMILIES


def _decisions(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """(line, literal) of each family name the tree decides by."""
    for node in ast.walk(tree):
        operands: List[ast.AST] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            operands = [key for key in node.keys if key is not None]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            operands = list(node.elts)
        for operand in operands:
            for part in ([operand] if not isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else operand.elts):
                if _family(part):
                    yield part.lineno, part.value  # type: ignore[attr-defined]


def _sources() -> Iterator[Tuple[str, str]]:
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if not relative.startswith(ALLOWED):
                yield relative, path.read_text()


def test_no_family_name_decides_outside_the_families_package():
    found = sorted({f"{path}:{line}: {name!r}" for path, source in _sources()
                    for line, name in _decisions(ast.parse(source))})
    assert not found, ("family names deciding behaviour outside swarm.modeling.families (make it a field of "
                       "FamilySpec):\n" + "\n".join(found))


def test_the_scan_finds_the_decisions_it_forbids():
    """The scan's own check: each form of decision by name is found, a name in a message or a dict value is not."""
    source = '''
a = config.model_type == "mixtral"
b = model_type in ("bloom", "falcon")
c = {"phi3": 1}
d = ("qwen2", "qwen3")
e = f"{model_type} is not mixtral"
f = model_config({"model_type": "deepseek_v3"})
'''
    assert sorted(set(_decisions(ast.parse(source)))) == [(2, "mixtral"), (3, "bloom"), (3, "falcon"), (4, "phi3"),
                                                      (5, "qwen2"), (5, "qwen3")]
