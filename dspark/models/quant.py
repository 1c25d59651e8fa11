"""Weight-only quantized and pre-packed linears for the target's decoder layers.

``--quantization`` picks how the decoder layers' projections (q/k/v, o, gate/up, down) hold
their weights:

* ``none``: dense weights in the model dtype. On CPU in bf16/fp16 they are re-laid once into
  oneDNN's blocked format (a pre-packed linear), which skips the per-call weight reorder that
  ``aten::mm`` pays.
* ``int4``: 4-bit codes in groups of 32 with a scale and an offset per group, multiplied by
  torch's packed CPU kernel (``_weight_int4pack_mm_for_cpu``). A GGUF's own Q4_0/Q4_1 blocks
  are kept as they are (only their fp16 scales are rounded to the activation dtype, which the
  kernel requires); other weights are quantized at load.
* ``int8``: 8-bit codes with one scale per output channel (``_weight_int8pack_mm``).
* ``auto``: keep what the file holds: a GGUF's Q4_0/Q4_1 layers run as ``int4``, Q8_0 ones as
  ``int8``, anything else (and every safetensors model) as ``none``.

Every kernel here computes each output row from its input row alone, in the same order whatever
the number of rows, so a token decoded alone and the same token verified in a chain get the same
bits: speculative output stays equal to plain output of the same quantized model. The embedding
and LM head stay dense (the drafter reads the target's head weights).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from dspark.config import QUANTIZATION_CHOICES
from dspark.models.llama import Linear, cpu_reduced_precision

log = logging.getLogger(__name__)

GROUP = 32  # GGUF's block length, and the int4 group length used when quantizing at load
_LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def check_quantization(mode: str) -> None:
    """Raise ValueError naming the choices when ``mode`` is not one of them."""
    if mode not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {mode!r}: choose {', '.join(QUANTIZATION_CHOICES)}")


# --------------------------------------------------------------------------- quantized tensors
@dataclass
class Int4Weight:
    """4-bit codes ``q`` in [0, 15] ([N, K] int32) with per-group ``scale`` and ``zero``
    ([N, K / GROUP] float32): w = (q - 8) * scale + zero (the packed kernel's convention)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        g = (self.q.float() - 8).view(n, k // GROUP, GROUP)
        return (g * self.scale[..., None] + self.zero[..., None]).view(n, k)


@dataclass
class Int8Weight:
    """8-bit codes ([N, K] int8) with one float32 scale per output channel: w = q * scale."""

    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


def quantize_int4(w: torch.Tensor) -> Int4Weight:
    """Asymmetric 4-bit groups of 32 along the input dimension (as GGUF's Q4_1)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return Int4Weight(q.to(torch.int32).view(n, k), scale, lo + 8 * scale)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric 8-bit codes with one scale per output row."""
    scale = (w.float().abs().amax(-1) / 127).clamp_min(1e-12)
    return Int8Weight(torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale)


# --------------------------------------------------------------------------- linear modules
class PackedLinear(nn.Module):
    """A dense bf16/fp16 linear on CPU with its weight re-laid once into oneDNN's blocked
    format; each output row depends only on its input row (checked by the tests for the
    layer shapes), so one-row calls need no two-row detour."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                               "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """Weight-only int4 linear: torch's packed CPU kernel over groups of 32."""

    def __init__(self, w: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = w.q.shape
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.contiguous(), 2))
        # [K / GROUP, N, 2]: the kernel reads scales and offsets in the activation dtype
        self.register_buffer("scale_zero", torch.stack([w.scale.t(), w.zero.t()], -1).contiguous().to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).contiguous(), self.packed, GROUP,
                                                       self.scale_zero)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """Weight-only int8 linear with per-channel scales (``_weight_int8pack_mm``)."""

    def __init__(self, w: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = w.q.shape
        self.register_buffer("q", w.q.contiguous())
        self.register_buffer("scale", w.scale.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).contiguous(), self.q, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


# --------------------------------------------------------------------------- applying a mode
def _resolve(mode: str, file_kind: str | None, device: torch.device) -> str:
    if device.type != "cpu" or mode == "none":
        return "none"
    if mode != "auto":
        return mode
    return {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}.get(file_kind or "", "none")


def quantize_model(model: nn.Module, mode: str, file_weights: dict[str, tuple[str, object]] | None = None) -> dict:
    """Swap the decoder layers' linears of ``model`` (already on its device and dtype) for the
    kernels ``mode`` asks for; also pre-pack the dense LM head on CPU. ``file_weights`` maps a
    fused linear's name (``layers.0.mlp.gate_up_proj``) to its GGUF parts, as returned by
    :func:`dspark.models.gguf_blocks.gguf_linear_parts`. Returns a summary: kernel -> count and bytes."""
    check_quantization(mode)
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if mode in ("int4", "int8") and dev.type != "cpu":
        log.warning("--quantization %s has no %s kernel yet: the layers stay dense %s", mode, dev.type, dtype)
    summary: dict[str, list[int]] = {}
    file_weights = file_weights or {}
    for i, layer in enumerate(model.layers):
        for path in _LAYER_LINEARS:
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            lin = getattr(parent, attr)
            full = f"layers.{i}.{path}"
            parts = file_weights.get(full)
            kind = _resolve(mode, parts[0] if parts else None, dev)
            new = _build(lin, kind, parts, dtype)
            setattr(parent, attr, new)
            stats = summary.setdefault(type(new).__name__, [0, 0])
            stats[0] += 1
            stats[1] += sum(b.numel() * b.element_size() for b in new.buffers())
            stats[1] += sum(p.numel() * p.element_size() for p in new.parameters())
    if dev.type == "cpu" and cpu_reduced_precision(model.lm_head.weight):
        model.lm_head = _PackedHead(model.lm_head)
    return {k: {"count": c, "bytes": b} for k, (c, b) in summary.items()}


def _build(lin: Linear, kind: str, parts, dtype: torch.dtype) -> nn.Module:
    cpu_packable = lin.weight.device.type == "cpu" and cpu_reduced_precision(lin.weight)
    if kind == "none":
        return PackedLinear(lin.weight, lin.bias) if cpu_packable else lin
    if parts is not None and (kind == "int4") == parts[0].startswith("Q4"):
        w = parts[1]  # the file's own codes, fused along the output dimension
    else:
        w = (quantize_int4 if kind == "int4" else quantize_int8)(lin.weight.detach().float())
    return Int4Linear(w, lin.bias, dtype) if kind == "int4" else Int8Linear(w, lin.bias, dtype)


class _PackedHead(nn.Module):
    """The LM head as a pre-packed linear that still exposes ``weight`` (tied to the embedding,
    and read by drafters that share the target's head)."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.weight = head.weight
        self.linear = PackedLinear(head.weight, head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def quantize_target(model: nn.Module, mode: str, model_arg: str | None) -> dict:
    """:func:`quantize_model` for a target loaded from ``model_arg`` (a ``--model`` value): when
    that is a GGUF and the layers may stay quantized on CPU, its own blocks are read back."""
    from dspark.models.gguf_blocks import gguf_linear_parts
    from dspark.models.loader import source_gguf

    check_quantization(mode)
    parts = None
    on_cpu = next(model.parameters()).device.type == "cpu"
    if mode != "none" and on_cpu and (gguf := source_gguf(model_arg)) is not None:
        parts = gguf_linear_parts(gguf)
    summary = quantize_model(model, mode, parts)
    log.info("decoder-layer linears (--quantization %s): %s", mode, summary)
    return summary
