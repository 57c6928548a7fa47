"""The dtype names of the project: hidden states on the wire, serving dtypes in configs and on the command line.

One table: `DTYPES` (the floating dtypes a tensor of hidden states, a server's weights or a client's head may have)
and `INDEX_DTYPES` (integer tensors the protocol also carries). The names are torch's own (`torch.bfloat16` is
"bfloat16") and are what travels in `runtime_pb2.Tensor.dtype`. `QUANT_TYPES`: the names of the weight formats a
server may serve and announce in its DHT record (`ServerInfo.quant_type`); each format's facts are in
`swarm.wire.quant`.
"""
from __future__ import annotations

from typing import Dict

import torch

from swarm.wire.quant import QUANT_TYPES

__all__ = ["DTYPES", "INDEX_DTYPES", "WIRE_DTYPES", "QUANT_TYPES", "parse_dtype", "dtype_name"]

DTYPES: Dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
INDEX_DTYPES: Dict[str, torch.dtype] = {"int64": torch.int64}
WIRE_DTYPES: Dict[str, torch.dtype] = {**DTYPES, **INDEX_DTYPES}  # every dtype a serialized tensor may have


def parse_dtype(name: str) -> torch.dtype:
    """The floating dtype called `name` ("float32", "float16", "bfloat16"); ValueError naming the choices."""
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of `dtype` ("bfloat16" for torch.bfloat16), whether or not the protocol accepts it."""
    return str(dtype).replace("torch.", "")
