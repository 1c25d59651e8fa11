"""Applying ``--quantization`` to a target: which kernel each decoder-layer linear becomes.

A GGUF's layers that stay in the file's own blocks are planned before the weights load
(:func:`plan_file_blocks`), so the loader never makes their dense weights: each such linear is
built straight from its blocks, read from the file one linear at a time. The LM head on CPU
becomes an int8 one where the layers are quantized (``Int8Head``) or a pre-packed dense one.

Prompt rows take the int4 linears' bf16 tile GEMM on AMX (``Int4Linear._prompt``), elsewhere the
decode kernels, unless ``prefill_dense`` keeps a pre-packed dense copy of every quantized linear
for them (at 2 bytes a weight more resident memory: docs/quantization.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from dspark.config import check_quantization
from dspark.models import cpu_ops
from dspark.models.fused import forget_stack
from dspark.models.llama import Linear
from dspark.models.packed import PackedHead, PackedLinear
from dspark.models.quant import (
    GROUP,
    Int4Linear,
    Int4Weight,
    Int8Head,
    Int8Linear,
    Int8Weight,
    Q8Linear,
    cpu_packable,
    quantize_int4,
    quantize_int8,
    quantize_q8_0,
)

if TYPE_CHECKING:
    from dspark.models.block_rows import BlockRows
    from dspark.models.gguf_blocks import KeptParts

log = logging.getLogger(__name__)

_LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass
class FileBlocks:
    """A GGUF's kept layer linears (fused name -> (layout, blocks), read on lookup), the ones of
    them built without a dense weight, and a reader of its head's Q8_0 blocks. Where the head
    becomes an :class:`Int8Head`, the embedding and the head's rows stay in the file's blocks
    too (``embed``, ``head_rows``: ``BlockRows``, the same one for a tied head), never dense."""

    parts: KeptParts
    direct: frozenset[str]
    head: Callable[[], tuple[torch.Tensor, torch.Tensor] | None]
    embed: BlockRows | None = None
    head_rows: BlockRows | None = None

    @property
    def absent(self) -> frozenset[str]:
        """Modules of the model whose weights the loader leaves unmade (``load_hf_state_dict``)."""
        return self.direct | ({"embed_tokens", "lm_head"} if self.embed is not None else set())


def _resolve(mode: str, file_kind: str | None, device: torch.device, dtype: torch.dtype) -> str:
    if device.type != "cpu" or mode == "none":
        return "none"
    if mode != "auto":
        return mode
    # in float32 only the AVX2 kernels: torch's weight-only CPU kernels are several times slower than dense
    ours = dtype == torch.float32 and cpu_ops.quant_dtype() == torch.float32
    if not ours and dtype not in (torch.bfloat16, torch.float16):
        return "none"
    return {"Q4": "int4", "Q8_0": "int8", "Q8K": "int8"}.get(file_kind or "", "none")


def _ours(dtype: torch.dtype, device: torch.device):  # noqa: ANN202 - the compiled kernels or None
    return cpu_ops.quant() if device.type == "cpu" and dtype == cpu_ops.quant_dtype() else None


def _from_blocks(mode: str, layout: str, rows: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a linear the file holds as ``layout`` blocks is built from them alone (no dense weight)."""
    kind = _resolve(mode, layout, device, dtype)
    if kind == "int4":
        return layout == "Q4"
    if kind != "int8" or layout not in ("Q8_0", "Q8K"):
        return False
    if _ours(dtype, device) is not None and rows % 32 == 0:
        return True  # Q8Linear
    return not (dtype == torch.float32 and mode == "auto")  # else dense: torch's int8 is slower there


def plan_file_blocks(mode: str, folder: str, device: torch.device, dtype: torch.dtype
                     ) -> tuple[FileBlocks | None, frozenset[str]]:
    """(the file's blocks, the HF weight names the loader must not make dense) for a target in
    ``folder``: nothing for a folder of safetensors or where ``mode`` keeps no file blocks."""
    from dspark.models.gguf_blocks import kept_blocks

    check_quantization(mode)
    if all(_resolve(mode, kind, device, dtype) == "none" for kind in ("Q4", "Q8_0", "Q8K")):
        return None, frozenset()
    kept = kept_blocks(folder)
    if kept is None:
        return None, frozenset()
    parts, head = kept
    direct = frozenset(n for n in parts if _from_blocks(mode, parts.layouts[n], parts.rows(n), device, dtype))
    skip = frozenset(w for n in direct for w in parts.hf_weights(n))
    embed, head_rows = _file_rows(parts.index, direct, device, dtype)
    if embed is not None:
        skip |= {"model.embed_tokens.weight", "lm_head.weight"}
    return FileBlocks(parts, direct, head, embed, head_rows), skip


def _file_rows(index, direct: frozenset[str], device: torch.device, dtype: torch.dtype  # noqa: ANN001
               ) -> tuple[BlockRows | None, BlockRows | None]:
    """(embedding, head rows) kept in the file's blocks where quantize_model will make the head an
    Int8Head (layers quantized, our kernels in this dtype, shapes in groups of 32), else Nones."""
    from dspark.models.block_rows import BlockRows

    emb = index.by_hf.get("model.embed_tokens.weight")
    out = index.by_hf.get("lm_head.weight", emb)
    if not direct or emb is None or _ours(dtype, device) is None:
        return None, None
    if len(emb.shape) != 2 or out.shape != emb.shape or not _int8_head_shape(emb.shape):
        return None, None
    embed = BlockRows(index, emb, dtype)
    return embed, embed if out is emb else BlockRows(index, out, dtype)


def quantize_model(model: nn.Module, mode: str, blocks: FileBlocks | None = None, prefill_dense: bool = False
                   ) -> dict:
    """Swap the decoder layers' linears of ``model`` (its other weights on their device and dtype;
    the linears in ``blocks.direct`` still without weights) for the kernels ``mode`` asks for, and
    the LM head on CPU for an int8 one (when the layers are quantized and our kernels take the
    dtype) or a pre-packed dense one. Returns a summary: kernel -> count and bytes."""
    check_quantization(mode)
    if blocks is not None and blocks.embed is not None:
        model.embed_tokens = blocks.embed
        # first: its codes and their packed copy meet while little else is resident
        model.lm_head = _int8_head(cpu_ops.quant(), blocks.head, source=blocks.head_rows)
        log.info("LM head: Int8Head; embedding and head rows mapped from the file's blocks")
    w0 = model.norm.weight
    dev, dtype = w0.device, w0.dtype
    if mode in ("int4", "int8") and dev.type != "cpu":
        log.warning("--quantization %s has no %s kernel yet: the layers stay dense %s", mode, dev.type, dtype)
    summary: dict[str, list[int]] = {}
    torch_kernels = False  # a layer on torch's weight-only kernels (several times slower than dense in fp32)
    for i, layer in enumerate(model.layers):
        for path in _LAYER_LINEARS:
            parent_name, attr = path.split(".")
            parent = getattr(layer, parent_name)
            full = f"layers.{i}.{path}"
            layout = blocks.parts.layouts.get(full) if blocks else None
            kind = _resolve(mode, layout, dev, dtype)
            parts = blocks.parts[full] if blocks and full in blocks.direct else None
            new = _build(getattr(parent, attr), kind, parts, dev, dtype, mode, prefill_dense)
            setattr(parent, attr, new)
            torch_kernels |= isinstance(new, Int8Linear) or (isinstance(new, Int4Linear) and new.amx is None)
            stats = summary.setdefault(type(new).__name__, [0, 0])
            stats[0] += 1
            stats[1] += sum(b.numel() * b.element_size() for b in new.buffers())
            stats[1] += sum(p.numel() * p.element_size() for p in new.parameters())
        if blocks is not None:
            return_freed_heap()  # each layer's file blocks and codes, freed: else the load peaks on them
    forget_stack(model.layers)
    if torch_kernels and dtype == torch.float32:
        log.warning("--quantization %s in float32 runs torch's slow weight-only path; bf16 is the fast one", mode)
    if (blocks is None or blocks.head_rows is None) and cpu_packable(model.lm_head.weight):
        quantized = bool({"Int4Linear", "Int8Linear", "Q8Linear"} & set(summary))
        model.lm_head = _cpu_head(model.lm_head, quantized, blocks.head if blocks else None)
        log.info("LM head: %s", type(model.lm_head).__name__)
    return {k: {"count": c, "bytes": b} for k, (c, b) in summary.items()}


def _cpu_head(head: nn.Module, quantized: bool, head_blocks) -> nn.Module:  # noqa: ANN001
    w = head.weight
    amx = _ours(w.dtype, w.device) if quantized and getattr(head, "bias", None) is None else None
    if amx is None or not _int8_head_shape(w.shape):
        return PackedHead(head) if w.dtype in (torch.bfloat16, torch.float16) else head
    return _int8_head(amx, head_blocks, head=head)


def _int8_head_shape(shape: tuple[int, ...]) -> bool:
    """Whether a head of this [vocab, hidden] shape fits the int8 kernels' tiles and groups."""
    return shape[0] % 32 == 0 and shape[1] % GROUP == 0


def _int8_head(amx, head_blocks, head: nn.Module | None = None, source: BlockRows | None = None  # noqa: ANN001
               ) -> Int8Head:
    """The head as int8: the file's own Q8_0 blocks where it has them, else quantized to Q8_0 from
    the dense head or from the file's rows (``source``)."""
    own = head_blocks() if head_blocks is not None else None
    codes, scale = own if own is not None else quantize_q8_0(head.weight.detach() if source is None else source)
    return Int8Head(head, codes, scale, amx, source=source)


def _build(lin: Linear, kind: str, parts: tuple[str, Int4Weight | Int8Weight] | None, device: torch.device,
           dtype: torch.dtype, mode: str, prefill_dense: bool) -> nn.Module:
    """lin as the kernel ``kind``, from the file's blocks ``parts`` where given (lin has no weight
    then), else from lin's dense weight."""
    packable = device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
    if kind == "int4" and lin.in_features % GROUP:
        log.warning("a %d-wide input does not split into int4 groups of %d: that layer stays dense",
                    lin.in_features, GROUP)
        kind = "none"
    if kind == "none":
        return PackedLinear(lin.weight, lin.bias) if packable else lin
    dense_copy = prefill_dense and packable  # prompt rows in one GEMM, at 2 bytes a weight
    if parts is not None:
        w = parts[1]  # the file's own codes, fused along the output dimension
        if kind == "int8":  # Q8_0 / k-quant blocks: ours take them as they are, torch's one scale per row
            amx = _ours(dtype, device)
            if amx is not None and w.q.shape[0] % 32 == 0:
                return Q8Linear(w.q, w.scale, amx, lin.bias, int8_rows=True, dtype=dtype, prefill_dense=dense_copy,
                                zero=w.zero)
            w = quantize_int8(w.dequantize())
    else:
        if kind == "int8" and mode == "auto":
            return lin  # a Q8_0 layer _from_blocks left dense (float32 without our kernels)
        w = (quantize_int4 if kind == "int4" else quantize_int8)(lin.weight.detach().float())
    return (Int4Linear if kind == "int4" else Int8Linear)(w, lin.bias, dtype, dense_copy)


def log_summary(mode: str, summary: dict) -> None:
    """One line naming the kernels the layers got, then the freed float copies handed back."""
    log.info("decoder-layer linears (--quantization %s): %s", mode, summary)
    return_freed_heap()


def return_freed_heap() -> None:
    """Loading and quantizing free a few hundred MB of float32 copies that glibc keeps mapped
    (and an engine's start-up, its tokenizer and drafter, tens more); hand them back to the OS so
    the server's resident set shows what it holds."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        pass


def has_prompt_path(model: nn.Module) -> bool:
    """Whether some decoder linear of ``model`` takes prompt rows through a kernel of its own (the
    AMX prompt GEMM, a dense copy), whose bits differ from the decode kernels'."""
    return any(getattr(m, "prompt_path", None) is not None and m.prompt_path() != "decode" for m in model.modules())


def rows_alone(model: nn.Module) -> bool:
    """Whether every decoder linear of ``model`` gives a row the same bits whatever other rows share
    its call (our int4 and int8 kernels, prompt rows included, with no dense copy, whose GEMM may
    sum a row in another order as the row count changes): then a prompt's K/V do not depend on
    how it is chunked, given an attention that is row-exact too."""
    for layer in model.layers:
        for path in _LAYER_LINEARS:
            lin = layer.get_submodule(path)
            if not isinstance(lin, (Int4Linear, Q8Linear)) or lin.amx is None or lin.prefill is not None:
                return False
    return True
