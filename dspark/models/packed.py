"""Dense linears pre-packed once into oneDNN's blocked layout (CPU, bf16/fp16), and which rows of a
forward are prompt tokens (``RowSplit``), which the pre-packed and quantized linears call apart.

``aten::mm`` re-lays a bf16 weight for oneDNN on every call; a pre-packed linear skips that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dspark.models.fused import forget_stack
from dspark.models.llama import cpu_reduced_precision


@dataclass
class RowSplit:
    """Which rows of one forward are prompt (prefill) tokens. Quantized linears send those through
    a dense copy of their weights (a GEMM: prompts are long) and every other row through the
    weight-only kernel, whose cost grows with each row; a decoded or verified token so always
    takes the same kernel, whatever shares its pass."""

    prefill: torch.Tensor | None  # row indices of prompt tokens (None: none)
    rest: torch.Tensor | None  # the other rows (None: none)

    @classmethod
    def of(cls, counts: list[int], prompt_rows: list[int], device: torch.device) -> RowSplit | None:
        """From per-sequence token counts and how many of each sequence's leading tokens are prompt
        tokens (a request prefilled again after preemption also feeds generated tokens: those
        keep the kernel they were decoded with); None when no row is a prompt token."""
        if not any(prompt_rows):
            return None
        flags = torch.tensor([j < p for n, p in zip(counts, prompt_rows) for j in range(n)], dtype=torch.bool)
        idx = torch.arange(len(flags))
        rest = idx[~flags]
        return cls(idx[flags].to(device), rest.to(device) if len(rest) else None)

    def apply(self, x: torch.Tensor, out_features: int, decoded: Callable[[torch.Tensor], torch.Tensor],
              prompt: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """[N, out] from x [N, in]: prompt rows through ``prompt``, the others through ``decoded``,
        each in a call of its own."""
        if self.rest is None:
            return prompt(x)
        y = x.new_empty(x.shape[0], out_features)
        y[self.rest] = decoded(x[self.rest])
        y[self.prefill] = prompt(x[self.prefill])
        return y


def _amx_tiles() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:  # older torch: pad, the safe side
        return False


class PackedLinear(nn.Module):
    """A dense bf16/fp16 linear on CPU with its weight re-laid once into oneDNN's blocked
    format; each output row depends only on its input row (checked by the tests for the
    layer shapes), so one-row calls need no two-row detour. That holds within oneDNN's choice of
    kernel, which follows the row count: on a CPU without AMX (AVX512-BF16 alone, as AMD Zen 4) a
    1,536-wide input sums a row in another order from 5 rows on. So there ``exact`` calls (the
    target's layers and head) pad the rows to whole blocks of ROW_BLOCK, where every block count
    sums a row alike, at about twice a one-row call's cost; AMX CPUs keep a row's order up to ~128
    rows unpadded, and drafts need no such care (exact=False). Where oneDNN has no kernel for the
    dtype (fp16 on a CPU without AVX512-FP16 or AVX-NE-CONVERT) the weight stays as it is and
    torch's own linear runs."""

    ROW_BLOCK = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, exact: bool = True):
        super().__init__()
        # AMX tiles hold a row's bf16 order; fp16 runs on AVX512-FP16 there, whose order follows M
        amx_rows = _amx_tiles() and weight.dtype == torch.bfloat16
        self.row_block = self.ROW_BLOCK if exact and not amx_rows else 1
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        try:
            packed, self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1), True
        except RuntimeError:  # "fp16 path needs the cpu support ..."
            packed, self.onednn = weight.detach().contiguous(), False
        self.register_buffer("packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        pad = -m % self.row_block
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        if self.onednn:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            y = nn.functional.linear(x, self.packed, self.bias)
        return y[:m] if pad else y

    def forward(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        # decoded rows apart from a long prompt chunk: oneDNN's row order can change with M
        y = self._call(x2) if rows is None else rows.apply(x2, self.out_features, self._call, self._call)
        return y.view(*x.shape[:-1], self.out_features)


class PackedHead(nn.Module):
    """The LM head as a pre-packed linear that still exposes ``weight`` (tied to the embedding,
    and read by drafters that share the target's head)."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.weight = head.weight
        self.linear = PackedLinear(head.weight, head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _cpu_reduced(w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and cpu_reduced_precision(w)


def pack_linears(module: nn.Module, only: tuple[str, ...] | None = None,
                 make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module] = PackedLinear,
                 takes: Callable[[torch.Tensor], bool] = _cpu_reduced) -> int:
    """Swap every linear under ``module`` whose weight nobody reads directly for ``make(weight,
    bias)``, pre-packed by default (inference only: the copy does not follow later weight
    updates); for a drafter on CPU in bf16/fp16, where its small passes otherwise pay oneDNN's
    weight reorder on every call. only: just these direct children; takes: which weights ``make``
    is for (CPU bf16/fp16 ones by default). Returns the count."""
    forget_stack(module)
    swapped = 0
    for name, child in list(module.named_children()):
        if only is not None and name not in only:
            continue
        if isinstance(child, nn.Linear) and takes(child.weight):
            setattr(module, name, make(child.weight, child.bias))
            swapped += 1
        else:
            swapped += pack_linears(child, make=make, takes=takes)
    return swapped
