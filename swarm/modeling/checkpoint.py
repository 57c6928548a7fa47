"""Finding a model checkpoint and reading only selected tensors from it.

A model is named by a local Hugging Face checkpoint directory or a hub repo id; nothing is converted here (a bundled
model's name becomes its directory through `swarm.modeling.prepare.resolve_model`, which the entry points call).
For a hub repo only the config, the tokenizer, the shard index and the shards that hold the requested tensors are
downloaded (into the Hugging Face cache, or `cache_dir`; at `revision`, with `token` where the repo is gated or
private: huggingface_hub's own, HF_TOKEN or the stored login, without one). Tensors are read one by one from
safetensors files (or, failing that, PyTorch `.bin` files), so a block server never holds other blocks.

A checkpoint published quantized (`quantization_config` in config.json: GPT-OSS's MXFP4 experts, DeepSeek-V3's and
Qwen3's block-scaled FP8) is read by its tensors' logical names and dequantized as it is read, one call's tensors (a
block's) at a time (`swarm.modeling.checkpoint_quant`); `check_quantized` checks the stored tensors' headers first.
"""
from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from safetensors import safe_open

from swarm.modeling.checkpoint_quant import QuantFormat, QuantizationError, quant_format, stored_names

logger = logging.getLogger(__name__)

INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")


class CheckpointError(RuntimeError):
    """The checkpoint cannot be found or does not hold what was asked for."""


class Checkpoint:
    """A local directory or hub repo; `load_tensors` fetches and reads only the files it needs."""

    def __init__(self, name_or_path: str, cache_dir: Optional[str] = None, revision: Optional[str] = None,
                 max_disk_space: Optional[int] = None, token: Optional[str] = None):
        self.name = name_or_path
        self.cache_dir, self.revision, self.token = cache_dir, revision, token
        self.max_disk_space = max_disk_space  # bytes; hub downloads evict least recently used files past it
        self.local_dir: Optional[Path]
        if Path(name_or_path).is_dir():
            self.local_dir = Path(name_or_path)
        elif Path(name_or_path).exists():
            raise CheckpointError(f"{name_or_path!r} is a file, not a checkpoint directory")
        else:
            self.local_dir = None  # a hub repo id
        self._weight_map: Optional[Dict[str, str]] = None
        self._stored_names: Dict[str, str] = {}  # tensor name -> its name in the file, where they differ
        self._quant: Optional[Tuple[Optional[QuantFormat]]] = None  # (the format,) once config.json was read
        self.extra_layers_noted = False  # blocks past num_hidden_layers were logged (`server.compute.blocks`)

    # ---- files -------------------------------------------------------------------------------------------
    def file(self, filename: str, required: bool = True) -> Optional[Path]:
        if self.local_dir is not None:
            path = self.local_dir / filename
            if path.is_file():
                return path
            if required:
                raise CheckpointError(f"{filename} not found in {self.local_dir}")
            return None
        from huggingface_hub.utils import EntryNotFoundError

        from swarm.modeling.disk_cache import hub_download  # locked, LRU-evicting (see swarm/modeling/disk_cache.py)

        try:
            return hub_download(self.name, filename, cache_dir=self.cache_dir, revision=self.revision,
                                max_disk_space=self.max_disk_space, token=self.token)
        except EntryNotFoundError:
            if required:
                raise CheckpointError(f"{filename} not found in hub repo {self.name}") from None
            return None
        except Exception as e:  # network errors, missing repo, auth
            if required:
                raise CheckpointError(f"cannot fetch {filename} of {self.name!r} from the hub: {e}") from None
            return None

    @property
    def config_dir(self) -> str:
        """A path or repo id that `AutoConfig` / `AutoTokenizer.from_pretrained` accept."""
        return str(self.local_dir) if self.local_dir is not None else self.name

    def load_config(self):
        """The model's config (`swarm.modeling.model_config`: without importing transformers' model classes)."""
        from swarm.modeling.model_config import model_config

        try:
            return model_config(self._config_json())
        except (CheckpointError, OSError, ValueError, TypeError) as e:
            raise CheckpointError(f"cannot read the model config of {self.name!r}: {e}") from None

    def _config_json(self) -> dict:
        path = self.file("config.json")
        assert path is not None  # required files raise instead
        return json.loads(path.read_text())

    def quantization(self) -> Optional[QuantFormat]:
        """The format the checkpoint's weights are published in (None: as they are); a `CheckpointError` naming
        an unknown `quant_method`."""
        if self._quant is None:
            try:
                fmt = quant_format(self._config_json().get("quantization_config"))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{self.name}: {e}") from None
            self._quant = (fmt,)
        return self._quant[0]

    def check_quantized(self, select: Callable[[str], bool]) -> None:
        """Check the stored tensors of the logical names `select` accepts against the quantization config, from
        the safetensors headers only (no tensor data read): a `CheckpointError` naming the first bad tensor."""
        fmt = self.quantization()
        if fmt is None:
            return
        infos: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]] = {}
        by_file = {f: names for f, names in self._by_file(select).items() if f.endswith(".safetensors")}
        with ThreadPoolExecutor(8) as pool:  # (a hub repo's shards: one small request each)
            headers = dict(zip(by_file, pool.map(self._header, by_file)))
        for filename, names in by_file.items():
            header = headers[filename]
            if header is None:
                continue  # (checked as its tensors are read)
            for name in names:
                info = header[self._stored_names.get(name, name)]
                infos[name] = (SAFETENSORS_DTYPES.get(info["dtype"], torch.uint8), tuple(info["shape"]))
        try:
            fmt.check_tensors(infos)
        except QuantizationError as e:
            raise CheckpointError(f"{self.name}: {e}") from None

    def weight_map(self) -> Dict[str, str]:
        """tensor name -> file name within the checkpoint."""
        if self._weight_map is not None:
            return self._weight_map
        for index_name in INDEX_FILES:
            index_path = self.file(index_name, required=False)
            if index_path is not None:
                self._weight_map = dict(json.loads(index_path.read_text())["weight_map"])
                return self._weight_map
        for single in SINGLE_FILES:
            path = self.file(single, required=False)
            if path is not None:
                self._weight_map = {name: single for name in _tensor_names(path)}
                return self._weight_map
        raise CheckpointError(f"no safetensors or PyTorch weights found in {self.name!r}")

    def expect_prefix(self, prefix: str, keep: str = "lm_head.") -> None:
        """Name the tensors as the causal-LM class does when the checkpoint was saved from the base model without
        its `prefix` (BLOOM's hub checkpoints: `h.0.…`, `word_embeddings.weight`, not `transformer.…`), as
        transformers' loading does; names starting with `keep` stay. No-op when some name has the prefix."""
        names = self.weight_map()
        if not prefix or any(name.startswith(prefix) for name in names):
            return
        renamed = {name: name if name.startswith(keep) else prefix + name for name in names}
        self._stored_names = {new: old for old, new in renamed.items() if new != old}
        self._weight_map = {renamed[name]: filename for name, filename in names.items()}

    def _header(self, filename: str) -> Optional[dict]:
        """A safetensors file's header (tensor name -> {"dtype", "shape", ...}): read from the file where it is
        here (a local directory, the hub cache), else fetched alone from the hub (an HTTP range request, not the
        file); None where that fails (offline: the tensors are checked as they are read)."""
        if self.local_dir is not None:
            path = self.file(filename)
            assert path is not None
            return _read_header(path)
        from huggingface_hub import HfApi, try_to_load_from_cache

        cached = try_to_load_from_cache(self.name, filename, cache_dir=self.cache_dir, revision=self.revision)
        if isinstance(cached, str):
            return _read_header(Path(cached))
        try:
            metadata = HfApi().parse_safetensors_file_metadata(self.name, filename, revision=self.revision,
                                                              token=self.token)
        except Exception as e:  # offline, network, auth: the load itself reports what it cannot read
            logger.debug(f"no header of {filename} from the hub ({e}): its tensors are checked as they are read")
            return None
        return {name: {"dtype": info.dtype, "shape": info.shape} for name, info in metadata.tensors.items()}

    # ---- tensors ----------------------------------------------------------------------------------------
    def load_tensors(
        self, select: Callable[[str], bool], dtype: Optional[torch.dtype] = None
    ) -> Dict[str, torch.Tensor]:
        """Read the tensors whose names `select` accepts, opening only the files that hold them (of a quantized
        checkpoint: the stored tensors of those names, dequantized into `dtype`, float32 if None)."""
        fmt = self.quantization()
        by_file = self._by_file(select)
        every = {name for names in by_file.values() for name in names}
        result: Dict[str, torch.Tensor] = {}
        pending: Dict[str, torch.Tensor] = {}  # (quantized: stored tensors whose group is not all read yet)
        for filename, names in sorted(by_file.items()):
            path = self.file(filename)
            assert path is not None  # required files raise instead
            stored = [self._stored_names.get(name, name) for name in names]
            for name, (_, tensor) in zip(names, _read_tensors(path, stored)):
                if fmt is None:
                    result[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
                    continue
                pending[name] = tensor
                group = fmt.group(name, every)
                if all(n in pending for n in group):  # dequantized as soon as read: one pair's bytes at a time
                    result.update(self._dequantize(fmt, {n: pending.pop(n) for n in group}, dtype))
        if fmt is not None and pending:  # halves without their other half: `dequantize` names them
            result.update(self._dequantize(fmt, pending, dtype))
        return result

    def _dequantize(self, fmt: QuantFormat, tensors: Dict[str, torch.Tensor], dtype: Optional[torch.dtype]
                    ) -> Dict[str, torch.Tensor]:
        try:
            done = fmt.dequantize(tensors, dtype or torch.float32)
        except QuantizationError as e:
            raise CheckpointError(f"{self.name}: {e}") from None
        return {name: t.to(dtype) if dtype is not None and t.is_floating_point() else t for name, t in done.items()}

    def _by_file(self, select: Callable[[str], bool]) -> Dict[str, List[str]]:
        """file name -> the stored tensor names in it whose logical names `select` accepts."""
        weight_map = self.weight_map()
        by_file: Dict[str, List[str]] = {}
        for name in stored_names(self.quantization(), weight_map, select):
            by_file.setdefault(weight_map[name], []).append(name)
        return by_file


def _tensor_names(path: Path) -> Iterable[str]:
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    return list(torch.load(str(path), map_location="cpu", weights_only=True, mmap=True).keys())


# safetensors dtype names (https://github.com/huggingface/safetensors, format: little-endian, C order)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
    "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.uint8,  # (e8m0 scales: read as their bytes, `checkpoint_quant` decodes them)
}


def _read_header(path: Path) -> dict:
    with open(path, "rb", buffering=0) as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def _read_safetensors(path: Path, names: List[str]):
    """Read tensors with plain file reads into memory of their own.

    `safe_open(...).get_tensor` returns views of a mapping of the whole file that lives while any of them does:
    every page ever read (also of tensors later copied and freed, e.g. fused) would stay in the process's
    resident set. Here the file's pages stay in the page cache only, and each tensor owns exactly its bytes.
    """
    with open(path, "rb", buffering=0) as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        base = 8 + header_len
        for name in names:
            info = header[name]
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
            tensor = torch.empty(info["shape"], dtype=SAFETENSORS_DTYPES[info["dtype"]])
            begin, end = info["data_offsets"]
            buffer = tensor.reshape(-1).view(torch.uint8).numpy().data  # a writable memoryview of the tensor
            if end - begin != len(buffer):
                raise CheckpointError(f"{path.name}: tensor {name} has {end - begin} bytes, expected {len(buffer)}")
            f.seek(base + begin)
            done = 0
            while done < len(buffer):
                read = f.readinto(buffer[done:])
                if not read:
                    raise CheckpointError(f"{path.name} is truncated (tensor {name})")
                done += read
            yield name, tensor


def _read_tensors(path: Path, names: List[str]):
    if path.suffix == ".safetensors":
        yield from _read_safetensors(path, names)
    else:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        for name in names:
            yield name, state[name].clone()
        del state
