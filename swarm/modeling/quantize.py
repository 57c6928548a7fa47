"""Quantized block weights (int8, nf4) through bitsandbytes: what a server's `--quant_type` does to its blocks.

A block is quantized after it is fused (`swarm.modeling.families.llama.fuse_layer`): its fused float weights (q;k;v rows
concatenated, gate;up rows concatenated, o, down) each become one bitsandbytes linear module, so the server's
steps still run four projections per block. Quantizing the concatenated rows gives the same values as
quantizing each projection on its own (what transformers' `BitsAndBytesConfig` does to the checkpoint's
modules):
- int8 (LLM.int8(), `Linear8bitLt`, outlier threshold 6.0): one absmax scale per output row; the outlier columns
  are picked from the input, which q/k/v (and gate/up) share;
- nf4 (`Linear4bit`, blocksize 64, no double quantization, as `BitsAndBytesConfig`'s defaults): one absmax per
  64 consecutive values of the row-major weight; with in_features % 64 == 0 no block straddles two rows, so
  none straddles two projections (`QuantizedLayer` checks it).
Quantization happens when the parameters move `.to(device)`; the float tensors are dropped right after, block by
block (`server.compute.blocks.BlockSpan.load`). Norms (and the client's embeddings and LM head) stay in float.

A family whose layer is its own `BlockLayer` (BLOOM, Falcon: q/k/v fused in the checkpoint; Gemma; DeepSeek-V3, whose
`kv_b_proj` stays in float: `deepseek_v3.QUANT_KEEP`) keeps its layer and gets its `nn.Linear`s swapped for
bitsandbytes modules (`quantize_linears`).

`QuantizedLayer` has `FusedLayer`'s methods (`block_step` reads it: batched decode, chunked prefill) and
`DecoderLayer`'s `forward` (passes without a cache), so one set of quantized weights serves every path and no
float copy of a linear weight stays resident. bitsandbytes dequantizes per call into temporaries (nf4 on the
CPU: the whole weight, then a float matmul; on CUDA a fused kernel for single-token rows), never into a kept
copy. In a merged decode batch or prefill of an int8 span, `QuantizedLayer.linear` quantizes each session's rows on
their own (`swarm.modeling.int8_rows`: LLM.int8()'s outlier columns are per call, so per session), bit for bit what
the session's calls alone compute.

CUDA graphs (`server.compute.graphs`): nf4 spans replay their decode steps as graphs (`Linear4bit`'s single-row gemv
kernel, and for several rows its dequantization and a float matmul, are plain kernels on the stream).
`Linear8bitLt` picks its outlier columns from each input (data-dependent shapes and a host sync), which graph
capture refuses, so int8 spans run their decode steps eagerly (`BlockSpan.enable_cuda_graphs` declines; the
capture error is in docs/benchmarks-gpu.md).

The families' own quantized blocks live here too: Mixtral's experts (`QuantizedMoeLayer`, one module per expert's
gate/up and down), Qwen3's q/k norms (`QuantizedQkNormLayer`) and Qwen3-MoE's both (`QuantizedQkNormMoeLayer`). Which
one a family's blocks become, and what each keeps in float, is the family's `FamilySpec.quant`
(`swarm.modeling.families.Quantization`), which memory planning counts and loading checks.
"""
from __future__ import annotations

import logging
from typing import Collection, Optional

import torch
import torch.nn.functional as F
from torch import nn

from swarm.modeling import int8_rows
from swarm.modeling.families.llama import FusedLayer, block_step
from swarm.modeling.families.mixtral import FusedMoeLayer, moe_block_step
from swarm.modeling.families.qwen3 import FusedQkNormLayer, normed_qk
from swarm.modeling.families.qwen3_moe import FusedQkNormMoeLayer
from swarm.modeling.layers import step_forward
from swarm.wire.quant import parse_quant_type

INT8_THRESHOLD = 6.0  # LLM.int8()'s outlier threshold (transformers' `llm_int8_threshold` default)
NF4_BLOCKSIZE = 64
QUANT_TYPE_HELP = ("linear weights of the served blocks: none, int8 (LLM.int8(), bitsandbytes Linear8bitLt, outlier "
                   "threshold 6) or nf4 (bitsandbytes 4-bit NF4, blocksize 64); norms stay in float. auto: nf4 on "
                   "CUDA; none on the CPU, where bitsandbytes' kernels are slower than float matmuls where compute "
                   "counts (measured, 15 SmolLM2-135M blocks, 2 cores: int8 decode 22 vs 12 ms/step, nf4 prefill "
                   "109 vs 67 ms per 128 tokens; nf4 decode is faster, 6 ms) and quantization costs accuracy; "
                   "choose int8/nf4 on the CPU for 3.5x/5x less weight memory (61/41 vs 211 MiB)")


class _DropCastNotice(logging.Filter):
    """bitsandbytes logs a warning on every LLM.int8() matmul whose input is not float16 ("inputs will be cast
    ... to float16"): that cast is how int8 works here, and one line per projection per step would flood a
    server's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast")


logging.getLogger("bitsandbytes.autograd._functions").addFilter(_DropCastNotice())


def resolve_quant_type(name: Optional[str], device: torch.device | str) -> str:
    """`name` ("auto" or one of QUANT_TYPES) for `device`: auto is nf4 on CUDA and none elsewhere."""
    name = parse_quant_type(name or "auto", allow_auto=True)
    if name == "auto":
        return "nf4" if torch.device(device).type == "cuda" else "none"
    return name


def check_quant_support(quant_type: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
    """Raise ValueError (one line) unless bitsandbytes can quantize and run a `quant_type` layer on `device`."""
    if quant_type == "none":
        return
    try:
        import bitsandbytes  # noqa: F401
    except Exception as e:  # ImportError, or a library that fails to load its native code
        raise ValueError(f"--quant_type {quant_type} needs bitsandbytes, which cannot be imported: "
                         f"{type(e).__name__}: {e}".splitlines()[0]) from None
    try:
        weight = torch.linspace(-1, 1, NF4_BLOCKSIZE * NF4_BLOCKSIZE).reshape(NF4_BLOCKSIZE, NF4_BLOCKSIZE)
        module = quantized_linear(weight.to(dtype), None, quant_type, dtype, torch.device(device))
        with torch.inference_mode():
            out = module(torch.ones(2, NF4_BLOCKSIZE, dtype=dtype, device=device))
        if out.shape != (2, NF4_BLOCKSIZE) or not bool(torch.isfinite(out).all()):
            raise RuntimeError("a test layer gave a wrong result")
    except Exception as e:
        message = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"--quant_type {quant_type} cannot run on {device} with this bitsandbytes: {message}"
                         ) from None

# bitsandbytes' CPU nf4 kernel computes outputs in blocks of 32
NF4_CPU_OUTPUTS = 32


def quantized_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], quant_type: str, compute_dtype: torch.dtype,
                     device: torch.device) -> nn.Module:
    """A bitsandbytes linear module for float `weight` [out, in] (and `bias` [out]) quantized on `device`."""
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    if quant_type == "nf4" and device.type == "cpu" and out_features % NF4_CPU_OUTPUTS:
        # bitsandbytes' CPU 4-bit kernel (AVX512-BF16 machines) asserts `N must be divisible by block_n` at the first
        # matmul: refused here, at load time, on every CPU alike
        raise ValueError(f"nf4 on the CPU needs output sizes divisible by {NF4_CPU_OUTPUTS}: a projection has "
                         f"{out_features} outputs")
    with torch.device("meta"):  # no float weight is allocated (nor initialized) for the module's constructor
        if quant_type == "int8":
            module: nn.Module = bnb.nn.Linear8bitLt(in_features, out_features, bias=bias is not None,
                                                    has_fp16_weights=False, threshold=INT8_THRESHOLD)
        elif quant_type == "nf4":
            module = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype,
                                       compress_statistics=False, quant_type="nf4")
        else:
            raise ValueError(f"cannot quantize to {quant_type!r}; choose int8 or nf4")
    data = weight.detach().contiguous()
    if quant_type == "int8":
        module.weight = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False)
    else:
        module.weight = bnb.nn.Params4bit(data, requires_grad=False, blocksize=NF4_BLOCKSIZE, compress_statistics=False,
                                          quant_type="nf4", module=module)  # type: ignore[arg-type]
    if bias is not None:
        module.bias = nn.Parameter(bias.detach().to(compute_dtype), requires_grad=False)
    # `.to` quantizes the weight (bitsandbytes' `Int8Params.to` / `Params4bit.to`); eval mode matters for int8:
    # a training-mode Linear8bitLt on the CPU dequantizes its whole weight for a float matmul every call instead
    # of LLM.int8()'s int8 matmul
    return module.to(device).eval().requires_grad_(False)


class QuantizedLayer(nn.Module):
    """One block with quantized projections: `FusedLayer`'s methods for `block_step`, `DecoderLayer`'s `forward`.

    qkv_proj: [(heads + 2 * kv_heads) * head_dim, hidden], o_proj: [hidden, heads * head_dim],
    gate_up_proj: [2 * intermediate, hidden], down_proj: [hidden, intermediate] (bitsandbytes modules).
    """

    step = block_step  # layer.step(x, cos, sin, attend)

    def __init__(self, fused: FusedLayer, quant_type: str, dtype: torch.dtype, device: torch.device):
        super().__init__()
        hidden = fused.qkv_weight.shape[1]
        intermediate = fused.down_weight_t.shape[0]
        if quant_type == "nf4" and (hidden % NF4_BLOCKSIZE or intermediate % NF4_BLOCKSIZE):
            # a 64-value block would straddle rows (and the fused q/k/v, gate/up seams): not what per-module
            # quantization gives
            raise ValueError(f"nf4 needs hidden ({hidden}) and intermediate ({intermediate}) sizes divisible by "
                             f"{NF4_BLOCKSIZE}")
        self.quant_type = quant_type
        self.heads, self.kv_heads, self.head_dim = fused.heads, fused.kv_heads, fused.head_dim
        self.scaling, self.layer_idx, self.eps = fused.scaling, fused.layer_idx, fused.eps
        self.sliding_window = fused.sliding_window
        self.input_norm_weight = nn.Parameter(fused.input_norm_weight.detach().to(device, dtype), requires_grad=False)
        self.post_norm_weight = nn.Parameter(fused.post_norm_weight.detach().to(device, dtype), requires_grad=False)
        self.qkv_proj = quantized_linear(fused.qkv_weight, fused.qkv_bias, quant_type, dtype, device)
        self.o_proj = quantized_linear(fused.o_weight_t.t(), fused.o_bias, quant_type, dtype, device)
        self.gate_up_proj = quantized_linear(fused.gate_up_weight, fused.gate_up_bias, quant_type, dtype, device)
        self.down_proj = quantized_linear(fused.down_weight_t.t(), fused.down_bias, quant_type, dtype, device)
        self.act = fused.act
        self.eval()

    forward = step_forward  # transformers' layer call, through `step` (`layers.step_forward`)

    # what block_step reads

    def input_norm(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.input_norm_weight, self.eps)

    def post_norm(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.post_norm_weight, self.eps)

    def linear(self, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """One of the projections on h [..., in]: an int8 one per session's rows where the step set row groups
        (`swarm.modeling.int8_rows`: a merged decode batch), else the module's own call."""
        return int8_rows.linear(module, h) if self.quant_type == "int8" else module(h)

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., heads + 2 * kv_heads, head_dim]"""
        return self.linear(self.qkv_proj, h).to(h.dtype).unflatten(-1, (-1, self.head_dim))

    def add_o_proj(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.o_proj, o).to(x.dtype)

    def gate_up(self, h: torch.Tensor):
        return self.linear(self.gate_up_proj, h).to(h.dtype).chunk(2, dim=-1)

    def add_down(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.down_proj, h).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, op for op (`swarm.modeling.layers.RMSNorm`): int8 layers quantize their input per
    row, so a last-bit difference in the norm's output can move an activation a whole int8 step."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def quantize_linears(layer: nn.Module, quant_type: str, dtype: torch.dtype, device: torch.device,
                     keep: Collection[str] = ()) -> nn.Module:
    """`layer` with each `nn.Linear` (subclasses included) replaced by a bitsandbytes module of its weight, and
    its other tensors (norms, routers, the linear modules named in `keep`) moved to `device` (parameters at `dtype`):
    for layers that call their projections as modules and cast their outputs to the input's dtype
    (`swarm.modeling.families.bloom`, `swarm.modeling.families.falcon`, `swarm.modeling.families.gemma`,
    `swarm.modeling.families.deepseek_v3`, which keeps its `kv_b_proj` in float). A fused q/k/v projection is one module
    already, quantized row by row as transformers' `BitsAndBytesConfig` would."""
    unknown = set(keep) - {name for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
    if unknown:
        raise ValueError(f"no linear modules {sorted(unknown)} to keep in float")
    linears = [(name, m) for name, m in layer.named_modules() if isinstance(m, nn.Linear) and name not in keep]
    if quant_type == "nf4":
        for name, linear in linears:
            if linear.in_features % NF4_BLOCKSIZE:
                raise ValueError(f"nf4 needs input sizes divisible by {NF4_BLOCKSIZE}: {name} has "
                                 f"{linear.in_features}")
    quantized = set()
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        module = quantized_linear(linear.weight, linear.bias, quant_type, dtype, device)
        setattr(parent, child, module)
        quantized.add(module)
    # the float tensors left (norms, routers, kept linears) to the device; bitsandbytes' modules are there already
    for sub in layer.modules():
        if sub in quantized:
            continue
        for key, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[key] = nn.Parameter(param.detach().to(device, dtype), requires_grad=False)
        for key, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[key] = buffer.to(device)
    return layer.eval().requires_grad_(False)


def quantized_weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's quantized linear weights with their scales (int8 SCB, nf4 absmax and code)."""
    import bitsandbytes as bnb

    total = 0
    for sub in module.modules():
        if isinstance(sub, bnb.nn.Linear8bitLt):
            total += sub.weight.numel() * sub.weight.element_size()
            scb = sub.state.SCB if sub.state.SCB is not None else getattr(sub.weight, "SCB", None)
            total += 0 if scb is None else scb.numel() * scb.element_size()
        elif isinstance(sub, bnb.nn.Linear4bit):
            state = getattr(sub.weight, "quant_state")
            total += sub.weight.numel() * sub.weight.element_size()
            total += state.absmax.numel() * state.absmax.element_size() + state.code.numel() * state.code.element_size()
    return total


# the families' quantized blocks: Mixtral's experts, Qwen3's q/k norms, both (Qwen3-MoE)

def quantized_qk_norm(layer, qkv: torch.Tensor) -> torch.Tensor:
    """`normed_qk` with the op-for-op RMSNorm of the quantized layers (`quantize._rms_norm`)."""
    return normed_qk(qkv, layer.heads, layer.kv_heads, lambda q: _rms_norm(q, layer.q_norm_weight, layer.eps),
                     lambda k: _rms_norm(k, layer.k_norm_weight, layer.eps))


class QuantizedMoeLayer(nn.Module):
    """One Mixtral block with int8 / nf4 projections (`swarm.modeling.quantize`): q/k/v in one quantized module, o,
    and per expert its gate/up rows in one and its down projection in one; the router and the norms stay in float
    (the router is tiny, and its top-k choice is what quantization noise should not flip). `FusedMoeLayer`'s
    methods for `moe_block_step`, `MixtralDecoderLayer`'s `forward`."""

    step = moe_block_step

    def __init__(self, fused: FusedMoeLayer, quant_type: str, dtype: torch.dtype, device: torch.device):
        super().__init__()
        num_experts, two_intermediate, hidden = fused.gate_up_weight.shape
        if quant_type == "nf4" and (hidden % NF4_BLOCKSIZE or (two_intermediate // 2) % NF4_BLOCKSIZE):
            raise ValueError(f"nf4 needs hidden ({hidden}) and intermediate ({two_intermediate // 2}) sizes divisible "
                             f"by {NF4_BLOCKSIZE}")
        self.quant_type = quant_type
        self.heads, self.kv_heads, self.head_dim = fused.heads, fused.kv_heads, fused.head_dim
        self.scaling, self.layer_idx, self.eps = fused.scaling, fused.layer_idx, fused.eps
        self.sliding_window, self.num_experts, self.top_k = fused.sliding_window, num_experts, fused.top_k
        self.input_norm_weight = nn.Parameter(fused.input_norm_weight.detach().to(device, dtype), requires_grad=False)
        self.post_norm_weight = nn.Parameter(fused.post_norm_weight.detach().to(device, dtype), requires_grad=False)
        self.router_weight = nn.Parameter(fused.router_weight.detach().to(device, dtype), requires_grad=False)
        self.qkv_proj = quantized_linear(fused.qkv_weight, None, quant_type, dtype, device)
        self.o_proj = quantized_linear(fused.o_weight_t.t(), None, quant_type, dtype, device)
        self.gate_up_projs = nn.ModuleList(quantized_linear(fused.gate_up_weight[e], None, quant_type, dtype, device)
                                           for e in range(num_experts))
        self.down_projs = nn.ModuleList(quantized_linear(fused.down_weight[e], None, quant_type, dtype, device)
                                        for e in range(num_experts))
        self.act = fused.act
        self.eval()

    forward = step_forward  # transformers' layer call, through `step` (`layers.step_forward`)

    input_norm = QuantizedLayer.input_norm
    post_norm = QuantizedLayer.post_norm
    linear = QuantizedLayer.linear  # (a MoE span's sessions run alone: its experts see routed subsets of the rows)
    qkv = QuantizedLayer.qkv
    add_o_proj = QuantizedLayer.add_o_proj

    def router(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.router_weight)

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return self.expert_down(e, self.expert_act(self.expert_gate_up(e, h)))

    # the expert in parts, where a LoRA adapter adds its deltas (`swarm.modeling.lora_experts`)
    def expert_gate_up(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return self.gate_up_projs[e](h).to(h.dtype)  # [n, 2 * intermediate]

    def expert_act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate).mul_(up)  # [n, intermediate]

    def expert_down(self, e: int, a: torch.Tensor) -> torch.Tensor:
        return self.down_projs[e](a).to(a.dtype)  # [n, hidden]


class QuantizedQkNormLayer(QuantizedLayer):
    """`quantize.QuantizedLayer` (int8 / nf4 projections) with the query and key norms in float."""

    def __init__(self, fused: FusedQkNormLayer, quant_type: str, dtype: torch.dtype, device: torch.device):
        super().__init__(fused, quant_type, dtype, device)
        assert fused.q_norm_weight is not None and fused.k_norm_weight is not None
        self.q_norm_weight = torch.nn.Parameter(fused.q_norm_weight.detach().to(device, dtype), requires_grad=False)
        self.k_norm_weight = torch.nn.Parameter(fused.k_norm_weight.detach().to(device, dtype), requires_grad=False)

    def qkv_projection(self, h: torch.Tensor) -> torch.Tensor:
        return QuantizedLayer.qkv(self, h)

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        return quantized_qk_norm(self, qkv)

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        return self.qk_norm(self.qkv_projection(h))


class QuantizedQkNormMoeLayer(QuantizedMoeLayer):
    """`mixtral.QuantizedMoeLayer` with the query and key norms in float."""

    def __init__(self, fused: FusedQkNormMoeLayer, quant_type: str, dtype: torch.dtype, device: torch.device):
        if fused.qkv_bias is not None or fused.o_bias is not None:
            raise ValueError("quantized Qwen3-MoE blocks with attention biases are not supported")
        super().__init__(fused, quant_type, dtype, device)
        assert fused.q_norm_weight is not None and fused.k_norm_weight is not None
        self.norm_topk_prob = fused.norm_topk_prob
        self.q_norm_weight = nn.Parameter(fused.q_norm_weight.detach().to(device, dtype), requires_grad=False)
        self.k_norm_weight = nn.Parameter(fused.k_norm_weight.detach().to(device, dtype), requires_grad=False)

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        return quantized_qk_norm(self, qkv)

    def qkv_projection(self, h: torch.Tensor) -> torch.Tensor:
        return self.qkv_proj(h).to(h.dtype).unflatten(-1, (-1, self.head_dim))  # (as QuantizedLayer.qkv)

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        return self.qk_norm(self.qkv_projection(h))
