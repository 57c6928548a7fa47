"""Activation compression on the wire: hidden states sent as float16 or 8-bit blockwise codes for slow links.

`none` sends a tensor's raw bytes in its own dtype (`swarm.wire.protocol.serialize_tensor`); `float16` halves a
float32 tensor (values clamped to float16's range; a float16 tensor is unchanged, bfloat16 is sent as it is, since
float16 would lose its range); `blockwise8` quantizes to one byte per value with bitsandbytes' dynamic blockwise
code (blocks of 4096 values, one float32 absmax per block, plus the 256-entry codebook: 1,024 bytes per tensor, so
it pays off from a few thousand values, i.e. prefill chunks, more than single decode steps of a small model).
Both are hivemind's codecs (`hivemind.compression`); the receiver checks the buffer's layout against the declared
shape before decoding anything (`decompress`), and gets the sender's dtype back.

A session's compression is chosen by the client (`OpenSession.compression`, from `ClientConfig.compression` /
the gateway's `--compression`), else the server's `--compression`; it applies to the client's steps, the
server's replies and the pushes between servers of that session.
"""
from __future__ import annotations

import math
from typing import Dict, Final, Literal, Tuple

import torch
from hivemind.proto import runtime_pb2

COMPRESSIONS: Final = ("none", "float16", "blockwise8")
Compression = Literal["none", "float16", "blockwise8"]
COMPRESSION_HELP = ("activation compression of hidden states on the wire: none, float16 (half the bytes of float32) "
                    "or blockwise8 (8-bit blockwise codes, about a quarter, plus 1 KiB per tensor)")
BLOCK = 4096  # hivemind's blockwise quantization block size
CODEBOOK = 256
_TYPES: Dict[str, int] = {"float16": runtime_pb2.CompressionType.FLOAT16,
                          "blockwise8": runtime_pb2.CompressionType.BLOCKWISE_8BIT}
_FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CompressionError(ValueError):
    """A compressed tensor whose layout does not match its declared shape or dtype."""


def _codec(kind: str):
    from hivemind.compression import BlockwiseQuantization, Float16Compression

    return Float16Compression() if kind == "float16" else BlockwiseQuantization()


def applies(tensor: torch.Tensor, kind: str) -> bool:
    """Whether `kind` compresses this tensor (float16 of float32 only; blockwise8 of float32/float16/bfloat16)."""
    if kind == "float16":
        return tensor.dtype == torch.float32
    if kind == "blockwise8":
        return tensor.dtype in (torch.float32, torch.float16, torch.bfloat16) and tensor.numel() > 0
    return False


def compress(tensor: torch.Tensor, kind: str) -> runtime_pb2.Tensor:
    """`tensor` [any shape] compressed with `kind` (`applies` must be true)."""
    from hivemind.compression import CompressionInfo

    tensor = tensor.detach().cpu().contiguous()
    proto = _codec(kind).compress(tensor, CompressionInfo.from_tensor(tensor))
    proto.dtype = str(tensor.dtype).replace("torch.", "")
    return proto


def expected_bytes(kind: str, shape: Tuple[int, ...]) -> int:
    numel = math.prod(shape)
    if kind == "float16":
        return 2 * numel
    return 16 + 4 * math.ceil(numel / BLOCK) + 4 * CODEBOOK + numel


def decompress(proto: runtime_pb2.Tensor, max_elements: int, allowed: Dict[str, torch.dtype]) -> torch.Tensor:
    """The tensor of a compressed `proto`, after checking its kind, dtype, shape and buffer layout."""
    kind = next((name for name, value in _TYPES.items() if value == proto.compression), None)
    if kind is None:
        raise CompressionError(f"compression type {proto.compression} is not accepted")
    dtype = _FLOATS.get(proto.dtype)
    if dtype is None or proto.dtype not in allowed or (kind == "float16" and dtype != torch.float32):
        raise CompressionError(f"dtype {proto.dtype!r} cannot arrive {kind}-compressed")
    shape = tuple(proto.size)
    if any(d < 0 for d in shape) or math.prod(shape) > max_elements or math.prod(shape) == 0:
        raise CompressionError(f"shape {shape} is empty, negative or over the limit of {max_elements} elements")
    if len(proto.buffer) != expected_bytes(kind, shape):
        raise CompressionError(f"{kind} buffer has {len(proto.buffer)} bytes, shape {shape} needs "
                               f"{expected_bytes(kind, shape)}")
    if kind == "blockwise8":
        header = torch.frombuffer(bytearray(proto.buffer[:16]), dtype=torch.int64).tolist()
        if header != [math.ceil(math.prod(shape) / BLOCK), CODEBOOK]:
            raise CompressionError(f"blockwise8 header {header} does not match shape {shape}")
    proto.requires_grad = False
    if kind == "float16":
        return _codec(kind).extract(proto).to(dtype).contiguous()
    return _dequantize_blockwise(proto.buffer, shape).to(dtype).contiguous()


def _dequantize_blockwise(buffer: bytes, shape: Tuple[int, ...]) -> torch.Tensor:
    """hivemind's `BlockwiseQuantization` layout (int64 absmax count, int64 codebook size, float32 absmax, float32
    codebook, uint8 codes), decoded here: hivemind 1.1.12's own `extract` fails with numpy 2."""
    from bitsandbytes.functional import dequantize_blockwise

    blocks = math.ceil(math.prod(shape) / BLOCK)
    data = bytearray(buffer)
    absmax = torch.frombuffer(data, dtype=torch.float32, offset=16, count=blocks)
    code = torch.frombuffer(data, dtype=torch.float32, offset=16 + 4 * blocks, count=CODEBOOK)
    codes = torch.frombuffer(data, dtype=torch.uint8, offset=16 + 4 * blocks + 4 * CODEBOOK).reshape(shape)
    return dequantize_blockwise(codes, absmax=absmax, code=code, blocksize=BLOCK, nested=False)
