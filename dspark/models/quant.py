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
stays dense; so does the LM head, except where ``cpu_ops.quant()`` has kernels (AMX, or
AVX512-VNNI with AVX512-BF16, for bf16; AVX2 for float32) and the layers are quantized: there it
runs as int8 with int8 rows (``Int8Head``, a Q8_0 product as llama.cpp runs it) and keeps its
dense weight for drafters that read it. ``quantize.py`` decides which linear becomes which.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dspark.models import cpu_ops
from dspark.models.llama import cpu_reduced_precision
from dspark.models.packed import PackedLinear, RowSplit

log = logging.getLogger(__name__)

GROUP = 32  # GGUF's block length, and the int4 group length used when quantizing at load


# --------------------------------------------------------------------------- quantized tensors
@dataclass
class Q4KScales:
    """A Q4_K tensor's scales as its file keeps them: fp16 ``d`` and ``dmin`` per super-block of 256
    inputs ([N, K / 256] float32) and 6-bit ``sc`` and ``mn`` per group of 32 ([N, K / 32] uint8):
    a group's scale is fp16(d * sc) and its offset (w = scale * q + offset, q in [0, 15]) -fp16(dmin * mn)."""

    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor

    def scale_offset(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, offset) [N, K / 32] float32, the values the kernels compute."""
        scale = (self.d.repeat_interleave(8, 1) * self.sc.float()).half().float()
        return scale, -(self.dmin.repeat_interleave(8, 1) * self.mn.float()).half().float()

    @staticmethod
    def cat(parts: list[Q4KScales]) -> Q4KScales:
        return Q4KScales(*(torch.cat([getattr(p, f) for p in parts]) for f in ("d", "dmin", "sc", "mn")))


@dataclass
class Int4Weight:
    """4-bit codes ``q`` in [0, 15] ([N, K] int32, or uint8 as read from a file) with per-group ``scale`` and ``zero``
    ([N, K / GROUP] float32): w = (q - 8) * scale + zero (the packed kernel's convention). ``q4k``: a
    GGUF Q4_K tensor's own super-block values (:class:`Q4KScales`), which our kernels keep as they are."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    q4k: Q4KScales | None = None

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        g = (self.q.float() - 8).view(n, k // GROUP, GROUP)
        return (g * self.scale[..., None] + self.zero[..., None]).view(n, k)


@dataclass
class Int8Weight:
    """8-bit codes ([N, K] int8) with float32 scales, one per output channel ([N]) or, as a GGUF's
    Q8_0 blocks, one per group of 32 inputs ([N, K / GROUP]): w = q * scale. The k-quant form (a
    GGUF's Q6_K / Q5_K / Q4_K blocks as int8 codes) has a scale per 16 inputs ([N, K / 16]) and/or
    an offset per group (``zero`` [N, K / GROUP]): w = q * scale + zero."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    @property
    def split(self) -> bool:
        """Whether this is the k-quant form (per-16 scales or offsets)."""
        return self.zero is not None or (self.scale.dim() == 2 and self.scale.shape[1] == 2 * self.q.shape[1] // GROUP)

    def dequantize(self) -> torch.Tensor:
        if self.scale.dim() == 1:
            return self.q.float() * self.scale[:, None]
        n, k = self.q.shape
        per = k // self.scale.shape[1]
        w = (self.q.float().view(n, -1, per) * self.scale[..., None]).view(n, k)
        if self.zero is not None:
            w = (w.view(n, k // GROUP, GROUP) + self.zero[..., None]).view(n, k)
        return w

    def as_split(self) -> Int8Weight:
        """The same weight in the k-quant form (per-16 scales, offsets), to fuse with such parts."""
        if self.scale.dim() == 1:
            raise ValueError("a per-channel int8 weight has no k-quant form")
        scale = self.scale if self.split else self.scale.repeat_interleave(2, 1)
        zero = self.zero if self.zero is not None else torch.zeros(self.q.shape[0], self.q.shape[1] // GROUP)
        return Int8Weight(self.q, scale, zero)


def quantize_int4(w: torch.Tensor) -> Int4Weight:
    """Asymmetric 4-bit groups of 32 along the input dimension (as GGUF's Q4_1)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return Int4Weight(q.to(torch.int32).view(n, k), scale, lo + 8 * scale)


def _scaled_codes(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """w = scale * q + offset per group of 32 (the AMX kernel's form), float32 [N, K]."""
    n, k = q.shape
    return (q.float().view(n, k // GROUP, GROUP) * scale[..., None] + offset[..., None]).view(n, k)


def quantize_q8_0(w: torch.Tensor | nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0 scheme: int8 codes [N, K] and an fp16-representable scale per 32 inputs
    [N, K / 32] (float32), w ~ scale * q. w: a tensor, or rows kept in a file's blocks
    (``BlockRows``), de-quantized as they are quantized. Goes 4096 rows at a time: a 2B model's
    head in float32 temporaries would take gigabytes."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, k // GROUP)
    for r in range(0, n, 4096):
        part = w[r:r + 4096] if isinstance(w, torch.Tensor) else w.dense(r, r + 4096)
        g = part.float().view(-1, k // GROUP, GROUP)
        s = (g.abs().amax(-1) / 127).half().float()
        q[r:r + 4096] = torch.round(g / s.clamp_min(1e-30)[..., None]).clamp(-128, 127).to(torch.int8).view(-1, k)
        scale[r:r + 4096] = s
    return q, scale


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric 8-bit codes with one scale per output row."""
    scale = (w.float().abs().amax(-1) / 127).clamp_min(1e-12)
    return Int8Weight(torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale)


# --------------------------------------------------------------------------- linear modules
class _WeightOnly(nn.Module):
    """Shared forward of the weight-only kernels: bias, shapes, and the dense path for prompt rows."""

    prefill: PackedLinear | None

    def _attach(self, shape: torch.Size, bias: torch.Tensor | None, dtype: torch.dtype,
                dense: Callable[[], torch.Tensor] | None) -> None:
        """dense: makes the weights the kernel multiplies by, de-quantized (float32), for the
        prompt rows' copy; None: no copy."""
        self.out_features, self.in_features = shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.prefill = PackedLinear(dense().to(dtype), self.bias) if dense is not None else None

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        """[M, out] from any 2-D x [M, in]."""
        raise NotImplementedError

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        y = self._kernel(x)
        return y if self.bias is None else y + self.bias

    def _prompt_args(self) -> tuple[torch.Tensor, ...] | None:
        """The packed weight as ``mm_prompt`` takes it where prompt rows have that kernel (AMX
        builds: the codes expanded to bf16 once per call, a GEMM on bf16 tiles, no resident copy);
        None: prompt rows take the decode kernel."""
        return None

    def prompt_path(self) -> str:
        """Which kernel takes prompt rows: "dense" (the prefill copy), "prompt" (``mm_prompt``) or
        "decode" (the decode kernel, as every other row)."""
        if self.prefill is not None:
            return "dense"
        return "prompt" if self._prompt_args() is not None else "decode"

    def _prompt(self, x: torch.Tensor) -> torch.Tensor:
        y = self.amx.mm_prompt(x, *self._prompt_args())
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        # a decode step's 2-D rows go through untouched: a few small ops per call add up over 120 layers
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        path = "decode" if rows is None else self.prompt_path()
        prompt = self.prefill if path == "dense" else self._prompt if path == "prompt" else None
        if prompt is None:
            y = self._quantized(x2)
        else:
            y = rows.apply(x2, self.out_features, self._quantized, prompt)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)


class Int4Linear(_WeightOnly):
    """Weight-only int4 linear over groups of 32. In the dtype of ``cpu_ops.quant()``'s build (bf16
    on a CPU with AMX or AVX512-VNNI, float32 on one with AVX2 alone) it runs ``csrc/quant_amx.cpp``
    or ``quant_avx2.cpp`` (w = scale * q + offset with fp16 scales, as GGUF's; on AMX one pass
    over the weights serves up to 16 rows at about the cost of one, on VNNI or AVX2 each row adds a
    fraction of a decode step); elsewhere torch's packed CPU kernel,
    which reads scales and offsets in the activation dtype. prefill_dense keeps a pre-packed dense
    copy (de-quantized from the same codes and scales) for prompt rows."""

    def __init__(self, w: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype, prefill_dense: bool = False):
        super().__init__()
        ours = dtype == cpu_ops.quant_dtype() and w.q.device.type == "cpu"
        self.amx = cpu_ops.quant() if ours and w.q.shape[0] % 32 == 0 else None
        if self.amx is not None:
            # a GGUF's own fp16 scales and offsets: Q4_0/Q4_1's exactly; Q4_K's super-block values
            # as the file keeps them (2.5 bytes a group and column against 4)
            if w.q4k is not None:
                scale, offset = w.q4k.scale_offset()
                own = w.q4k
                packed, scale_offset = self.amx.pack_q4k(w.q.to(torch.uint8), own.d, own.dmin, own.sc, own.mn)
            else:
                scale = w.scale.half().float()
                offset = (w.zero.double() - 8 * w.scale.double()).half().float()
                # offsets that are all -8 * scale (Q4_0) go unstored: the kernels derive them, same bits
                sym = bool(torch.equal(offset, -8 * scale))
                packed, scale_offset = self.amx.pack(w.q.to(torch.uint8), scale, None if sym else offset)
            self.register_buffer("packed", packed)
            self.register_buffer("scale_offset", scale_offset)
            deq = functools.partial(_scaled_codes, w.q, scale, offset)
        else:
            codes = w.q.to(torch.int32).contiguous()  # torch's kernel packs int32 codes
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2))
            # [K / GROUP, N, 2]: the kernel reads scales and offsets in the activation dtype
            sz = torch.stack([w.scale.t(), w.zero.t()], -1).contiguous().to(dtype)
            self.register_buffer("scale_zero", sz)
            deq = Int4Weight(w.q, sz[..., 0].t().float(), sz[..., 1].t().float()).dequantize
        self._attach(w.q.shape, bias, dtype, deq if prefill_dense else None)

    def amx_weights(self) -> tuple[torch.Tensor, ...] | None:
        """(packed codes, scales, an empty tensor) when this linear is exactly ``amx.mm`` by them
        (the decoder stack's form), else None."""
        if self.amx is None or self.bias is not None:
            return None
        return self.packed, self.scale_offset, torch.empty(0, dtype=torch.int16)

    def _prompt_args(self) -> tuple[torch.Tensor, ...] | None:
        if self.amx is None or not hasattr(self.amx, "mm_prompt"):
            return None
        return self.packed, self.scale_offset

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx is not None:
            return self.amx.mm(x, self.packed, self.scale_offset)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, GROUP, self.scale_zero)


class Int8Linear(_WeightOnly):
    """Weight-only int8 linear with per-channel scales (``_weight_int8pack_mm``); prefill_dense as
    for :class:`Int4Linear`."""

    def __init__(self, w: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype, prefill_dense: bool = False):
        super().__init__()
        self.register_buffer("q", w.q.contiguous())
        self.register_buffer("scale", w.scale.to(dtype))
        deq = Int8Weight(w.q, self.scale.float())
        self._attach(w.q.shape, bias, dtype, deq.dequantize if prefill_dense else None)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scale)


class Q8Linear(_WeightOnly):
    """A linear as int8 codes with one fp16 scale per 32 inputs (GGUF's Q8_0; with int8_rows also
    the k-quant form, a scale per 16 inputs and an offset per 32, GGUF's Q6_K / Q5_K) on AMX tiles or VNNI,
    bf16 in and out (on AVX2, float32 with int8_rows only): half a bf16 weight's bytes read per
    call, at a cost that hardly grows up to 16 rows on AMX.
    Each row's result depends on that row alone, so prompt rows need no dense copy (prefill_dense
    keeps one for their speed, as :class:`Int4Linear`'s). int8_rows:
    the rows are quantized to int8 per group of 32 too (``amx.mm8``, as llama.cpp runs a Q8_0
    product; several times faster at a few rows, where expanding the codes to bf16 bounds the
    other path). Both paths give a row the same bits alone or in any batch."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, amx, bias: torch.Tensor | None = None,  # noqa: ANN001
                 int8_rows: bool = False, dtype: torch.dtype = torch.bfloat16, prefill_dense: bool = False,
                 zero: torch.Tensor | None = None):
        super().__init__()
        self.amx = amx
        w = Int8Weight(codes, scale.half().float(), None if zero is None else zero.half().float())  # the kernel's fp16
        if w.split and not int8_rows:
            raise ValueError("Q8Linear: per-16 scales and offsets (k-quants) need int8_rows")
        deq = w.dequantize
        if int8_rows:
            packed, scale, sums = amx.pack8(codes, scale, zero)
        else:
            (packed, scale), sums = amx.pack(codes, scale), torch.empty(0, dtype=torch.int16)
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("sums", sums)  # empty: bf16 rows
        self._attach(codes.shape, bias, dtype, deq if prefill_dense else None)

    def amx_weights(self) -> tuple[torch.Tensor, ...] | None:
        """As :meth:`Int4Linear.amx_weights`, with the code sums of an int8-rows weight (else empty)."""
        return (self.packed, self.scale, self.sums) if self.bias is None else None

    def _prompt_args(self) -> tuple[torch.Tensor, ...] | None:
        if not self.sums.numel() or not hasattr(self.amx, "mm_prompt"):  # bf16-rows weights: none
            return None
        return self.packed, self.scale, self.sums

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self.amx.mm(x, self.packed, self.scale, self.sums)


class Int8Head(Q8Linear):
    """The LM head as a :class:`Q8Linear`. Drafters that share the target's head read its rows
    (:meth:`rows`): from the dense ``weight`` it was quantized from (tied to the embedding) where
    the model keeps one, else de-quantized from the file's own blocks (``source``, a
    ``BlockRows``: the model then holds no dense copy of the head at all)."""

    def __init__(self, head: nn.Module | None, codes: torch.Tensor, scale: torch.Tensor, amx,  # noqa: ANN001
                 int8_rows: bool = True, source: nn.Module | None = None):
        if (head is None) == (source is None):
            raise ValueError("Int8Head: give the dense head or the file rows it comes from, one of them")
        dtype = head.weight.dtype if head is not None else source.dtype
        super().__init__(codes, scale, amx, int8_rows=int8_rows, dtype=dtype)
        self.weight = head.weight if head is not None else None
        self._source = (source,)  # in a tuple, not registered: as the embedding it is the model's

    def rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The head's dense rows ``ids`` (None: all of them, a dense copy of the head)."""
        if self.weight is not None:
            return self.weight if ids is None else self.weight[ids]
        src = self._source[0]
        return src.dense(0, src.num_embeddings) if ids is None else src.rows(ids)


def draft_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """The fastest inference linear for a drafter's dense weight on CPU in bf16: int4 in groups of
    32 (as a GGUF's Q4_1) with int8 rows on VNNI / AMX-INT8 where the shapes allow, else a
    pre-packed dense one. Drafts need no bit-exactness, and a drafter pass at batch 1 is mostly
    reading its weights: int4 halves the bytes of Q8_0 (the drafter pass ~25% faster on a Zen 4
    CPU) for about 0.5% of tau (docs/quantization.md)."""
    amx = cpu_ops.quant() if weight.dtype == cpu_ops.quant_dtype() else None
    n, k = weight.shape
    if amx is None or n % 32 or k % GROUP:
        return PackedLinear(weight, bias, exact=False)
    return Int4Linear(quantize_int4(weight.detach().float()), bias, weight.dtype)


def cpu_packable(weight: torch.Tensor) -> bool:
    """Whether an inference linear here runs ``weight`` cheaper than as it is: a CPU weight in
    bf16/fp16 (pre-packed, or int4/int8), or in the float32 the AVX2 kernels take."""
    return weight.device.type == "cpu" and (cpu_reduced_precision(weight) or weight.dtype == cpu_ops.quant_dtype())
