"""The weight formats a server may serve (`--quant_type`), each one value with every fact about it.

A format's name travels in a server's DHT record (`ServerInfo.quant_type`) and clients choose among them
(`allowed_quant_types`); what the rest of the code needs to know of a format is here, and nowhere else: what its
weights cost in memory (`server.placement.memory`), how far an honest server's outputs may drift under it
(`swarm.client.transport.verify`), whether the rows of several sessions may share one call of its layers and whether
CUDA graphs can capture it (`server.compute.blocks`). `parse_quant_type` is the one validation of a name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class QuantFormat:
    name: str
    # bytes a quantized linear weight's parameter takes with its per-parameter statistics (0: the format quantizes
    # nothing, its weights count at the serving dtype). int8: a byte; nf4: half a byte, and a float32 absmax per 64
    # weights (no double quantization)
    bytes_per_param: float
    # bytes every quantized module holds whatever its size: nf4's code table, 16 float32 values
    bytes_per_module: int
    # what spot-check verification adds to the serving dtype's tolerance (int8 decode vs prefill: ~0.16 seen)
    verify_tolerance: float
    # why rows of different sessions may not share one plain call of its layers (None: they may)
    sessions_alone: Optional[str]
    # why CUDA graphs cannot capture its layers (None: they can)
    graph_refusal: Optional[str]

    # bytes a quantized module holds per row (output feature) of its weight: int8's float32 scale (SCB)
    bytes_per_row: int = 0

    @property
    def quantized(self) -> bool:
        return self.name != "none"

    def module_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of one quantized module of an [out_features, in_features] weight with its statistics and tables, as
        bitsandbytes holds them once loaded (nf4: in_features a multiple of 64, as loading requires)."""
        return int(out_features * in_features * self.bytes_per_param) + out_features * self.bytes_per_row + \
            self.bytes_per_module


NONE = QuantFormat("none", 0.0, 0, 0.0, None, None)
INT8 = QuantFormat(
    "int8", 1.0, 0, 0.3,
    sessions_alone=("LLM.int8() picks its outlier columns (kept in float) from all rows of a call, so other "
                    "sessions' rows change a session's numbers, unless each session's rows are quantized on their "
                    "own (`swarm.modeling.int8_rows`, where a span can: `BlockSpan.groups_int8_rows`)"),
    graph_refusal="int8 weights: LLM.int8() picks outlier columns per input (a host sync), which capture refuses",
    bytes_per_row=4)
NF4 = QuantFormat("nf4", 0.5 + 4 / 64, 16 * 4, 0.3, None, None)

QUANT_FORMATS: Dict[str, QuantFormat] = {f.name: f for f in (NONE, INT8, NF4)}
QUANT_TYPES: Tuple[str, ...] = tuple(QUANT_FORMATS)
UNKNOWN_TOLERANCE = 0.1  # a record that announces a format this release does not know


def parse_quant_type(name, allow_auto: bool = False) -> str:
    """`name` lower-cased and checked: one of QUANT_TYPES (or "auto" where `allow_auto`); ValueError naming the
    choices."""
    text = str(name).strip().lower() if name is not None else ""
    if text in QUANT_FORMATS or (allow_auto and text == "auto"):
        return text
    choices = ", ".join((("auto",) if allow_auto else ()) + QUANT_TYPES)
    raise ValueError(f"unknown quant_type {name!r}; choose {choices}")


def quant_format(name: str) -> QuantFormat:
    """The format called `name` (checked by `parse_quant_type`)."""
    return QUANT_FORMATS[parse_quant_type(name)]
