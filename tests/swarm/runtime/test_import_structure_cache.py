"""transformers' import structure kept on disk (`swarm.runtime.import_structure_cache`), in fresh interpreters: the
same table as transformers' own scan, no model file read once it is kept, a damaged file scanned again."""
from __future__ import annotations

import pickle

from tests.fixtures.fresh_python import run_python

# the table transformers builds for its models directory (a digest of it), and how many model sources `import
# transformers` read
PROBE = (
    "import sys, hashlib\n"
    "reads = []\n"
    "sys.addaudithook(lambda event, args: reads.append(args[0]) if event == 'open' and isinstance(args[0], str)"
    " and '/transformers/models/' in args[0] and args[0].endswith('.py') else None)\n"
    "import swarm, transformers\n"
    "scanned = len(reads)\n"
    "from transformers import LlamaConfig\n"
    "from transformers.utils import import_utils\n"
    "from pathlib import Path\n"
    "models = Path(transformers.__file__).parent / 'models'\n"
    "table = import_utils.define_import_structure(models, prefix='models')\n"
    "flat = sorted((tuple(sorted(k)), m, tuple(sorted(v))) for k, d in table.items() for m, v in d.items())\n"
    "print(hashlib.sha256(repr(flat).encode()).hexdigest()[:16], len(flat), scanned, LlamaConfig.__name__)\n"
)


def _probe(cache, **env) -> list:
    return run_python(PROBE, env={"SWARMGATE_CACHE": str(cache), **env}).split()


def test_the_kept_table_is_transformers_own_spares_the_scan_and_survives_damage(tmp_path):
    own = _probe(tmp_path / "off", SWARMGATE_IMPORT_CACHE="0")
    assert not (tmp_path / "off").exists()
    assert int(own[1]) > 1000 and int(own[2]) > 1000  # transformers read its model sources
    cold = _probe(tmp_path / "on")
    (file,) = (tmp_path / "on" / "import-structure").iterdir()
    assert file.name.startswith("transformers-")
    warm = _probe(tmp_path / "on")
    assert cold[:2] == own[:2] == warm[:2]  # the same table (digest and size)
    assert int(warm[2]) == 0 and warm[3] == "LlamaConfig"  # no model source read
    file.write_bytes(b"not a pickle")  # damaged: scanned again, and replaced
    assert _probe(tmp_path / "on")[:3] == own[:3]
    assert isinstance(pickle.loads(file.read_bytes()), dict)  # written again whole
