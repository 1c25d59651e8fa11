"""Read a GGUF's quantized layer weights as codes and scales (no de-quantization).

When ``--quantization`` keeps the file's own 4-/8-bit weights, the decoder layers' projections
are read here from the file (through the converted folder's index, ``gguf_tensors.py``), one
fused linear at a time, and fused the way the model fuses them (q/k/v, gate/up); their dense
weights are never made.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from dspark.models.gguf_tensors import GGUFTensors, TensorEntry, gguf_hf_name
from dspark.models.quant import GROUP, Int4Weight, Int8Weight, Q4KScales

_FUSED = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
          "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
          "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
          "down_proj": ("mlp.down_proj", 0)}
_PARTS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}
KEPT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0")
# the kernel each type's blocks run on: int4 (Q4), int8 with a scale per 32 (Q8_0), or int8 in the
# k-quant form, a scale per 16 and an offset per 32 (Q8K); a fused linear whose parts differ takes Q8K
_LAYOUT = {"Q4_0": "Q4", "Q4_1": "Q4", "Q4_K": "Q4", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "Q5_K": "Q8K", "Q6_K": "Q8K"}
log = logging.getLogger(__name__)


def _block_scale(blocks: np.ndarray) -> np.ndarray:
    """The fp16 scale that starts every Q4_0/Q4_1/Q8_0 block ([N, G, bytes]) as float32 [N, G]."""
    return blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 blocks [N, G, 34] -> int8 codes [N, G, 32] and float32 scales [N, G]."""
    return blocks[..., 2:].copy().view(np.int8), _block_scale(blocks)


def _q4_k(raw: np.ndarray, n: int, k: int) -> Int4Weight:
    """Q4_K super-blocks (256 inputs: fp16 d and dmin, eight 6-bit scales and mins, 4-bit codes)
    as int4 groups of 32: each of a super-block's eight sub-blocks is one affine group,
    w = d * sc * q - dmin * m, so its scale is d * sc and its offset 8 d sc - dmin m."""
    from gguf.quants import Q4_K

    b = np.ascontiguousarray(raw).reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())
    # 4 runs of 32 bytes: the low nibbles are sub-block 2j, the high ones sub-block 2j + 1
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = torch.from_numpy(np.ascontiguousarray(qs & 0x0F).reshape(n, k))  # uint8: a quarter of int32's bytes at load
    scale = torch.from_numpy((d * sc).reshape(n, k // GROUP))
    mins = torch.from_numpy((dmin * m).reshape(n, k // GROUP))
    own = Q4KScales(torch.from_numpy(d.reshape(n, k // 256)), torch.from_numpy(dmin.reshape(n, k // 256)),
                    torch.from_numpy(sc.astype(np.uint8).reshape(n, k // GROUP)),
                    torch.from_numpy(m.astype(np.uint8).reshape(n, k // GROUP)))
    return Int4Weight(q, scale, 8 * scale - mins, own)


def _q6_k(raw: np.ndarray, n: int, k: int) -> Int8Weight:
    """Q6_K super-blocks (256 inputs: 4+2-bit codes, sixteen int8 scales, fp16 d) as int8 codes
    q - 32 with a scale d * sc per 16 inputs: w = d * sc * (q - 32)."""
    b = np.ascontiguousarray(raw).reshape(-1, 210)
    ql = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (ql.reshape(-1, 2, 4, 32) | (qh << 4)).astype(np.int8) - np.int8(32)
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
    return Int8Weight(torch.from_numpy(q.reshape(n, k)), torch.from_numpy((d * sc).reshape(n, k // 16)))


def _q5_k(raw: np.ndarray, n: int, k: int) -> Int8Weight:
    """Q5_K super-blocks (as Q4_K's, plus a fifth bit per code) as int8 codes q in [0, 31] with a
    scale d * sc and an offset -dmin * m per sub-block of 32."""
    from gguf.quants import Q4_K

    b = np.ascontiguousarray(raw).reshape(-1, 176)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())
    ql = (b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    qh = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 0x01
    q = (ql.reshape(-1, 8, 32) | (qh << 4)).astype(np.int8)
    scale = torch.from_numpy((d * sc).reshape(n, k // GROUP))
    return Int8Weight(torch.from_numpy(q.reshape(n, k)), scale.repeat_interleave(2, 1),
                      torch.from_numpy((-dmin * m).reshape(n, k // GROUP)))


def gguf_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> Int4Weight | Int8Weight:
    """A GGUF Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_K / Q6_K / Q8_0 tensor (raw bytes, [N, bytes per row])
    as codes and scales, exactly: Q4 blocks as w = (q - 8) * d + zero, Q8_0 and Q5_0 blocks as int8
    codes with one scale per block of 32 inputs, Q6_K and Q5_K in the int8 k-quant form."""
    n, k = shape
    if kind == "Q4_K":
        return _q4_k(raw, n, k)
    if kind == "Q6_K":
        return _q6_k(raw, n, k)
    if kind == "Q5_K":
        return _q5_k(raw, n, k)
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, -1)
    if kind == "Q8_0":
        q, d = _q8_0(blocks)
        return Int8Weight(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d))
    if kind == "Q5_0":  # w = d * (q - 16), q of 5 bits: int8 codes q - 16 with the block's scale, exactly
        low = blocks[..., 6:22]
        high = blocks[..., 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)  # [N, G, 32]
        q = (np.concatenate([low & 0x0F, low >> 4], axis=-1) | ((high & 1).astype(np.uint8) << 4))
        return Int8Weight(torch.from_numpy((q.astype(np.int8) - 16).reshape(n, k)),
                          torch.from_numpy(_block_scale(blocks)))
    if kind not in ("Q4_0", "Q4_1"):
        raise ValueError(f"no int4/int8 layout for GGUF type {kind}")
    d = _block_scale(blocks)
    off = 4 if kind == "Q4_1" else 2
    nib = blocks[..., off:off + 16]
    q = torch.from_numpy(np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(n, k))
    d_t = torch.from_numpy(d)
    if kind == "Q4_1":  # w = d * q + m  ->  (q - 8) * d + (m + 8 d)
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        return Int4Weight(q, d_t, m + 8 * d_t)
    return Int4Weight(q, d_t, torch.zeros_like(d_t))  # w = d * (q - 8)


def _k_form(w: Int4Weight | Int8Weight) -> Int8Weight:
    """Any kept part in the int8 k-quant form (a Q4 part as codes q - 8, its scale and offset)."""
    if isinstance(w, Int4Weight):
        return Int8Weight(w.q.to(torch.int8) - 8, w.scale.repeat_interleave(2, 1), w.zero)
    return w.as_split()


def _cat(ws: list[Int4Weight | Int8Weight]) -> Int4Weight | Int8Weight:
    if isinstance(ws[0], Int4Weight):
        own = Q4KScales.cat([w.q4k for w in ws]) if all(w.q4k is not None for w in ws) else None
        return Int4Weight(torch.cat([w.q for w in ws]), torch.cat([w.scale for w in ws]),
                          torch.cat([w.zero for w in ws]), own)
    zero = None if ws[0].zero is None else torch.cat([w.zero for w in ws])
    return Int8Weight(torch.cat([w.q for w in ws]), torch.cat([w.scale for w in ws]), zero)


class KeptParts(Mapping):
    """The fused layer linears whose GGUF parts are all of kept types, with their layout ("Q4" for
    Q4_0/Q4_1/Q4_K, "Q8_0" for Q8_0/Q5_0, "Q8K" for Q6_K/Q5_K or a mix): ``layers.3.mlp.gate_up_proj``
    -> (layout, codes and scales in the model's row
    order). Which linears qualify is known from the index alone; a linear's blocks are read from
    the file when it is looked up, so a load holds one linear's codes at a time."""

    def __init__(self, index: GGUFTensors):
        self.index = index
        found: dict[str, dict[int, TensorEntry]] = {}
        for hf, e in index.by_hf.items():
            if not hf.endswith(".weight") or e.kind not in KEPT_TYPES or ".layers." not in hf:
                continue
            layer, proj = hf.split(".")[2], hf.split(".")[-2]
            if proj in _FUSED:
                fused, slot = _FUSED[proj]
                found.setdefault(f"layers.{layer}.{fused}", {})[slot] = e
        self.slots: dict[str, list[TensorEntry]] = {}
        self.layouts: dict[str, str] = {}
        for name, slots in found.items():
            # parts of one layout fuse as they are; mixed ones (a Q4_K_M file's Q4_K q/k with a
            # Q6_K v) all take the int8 k-quant form, the Q4 parts at a byte a code
            kinds = {_LAYOUT[e.kind] for e in slots.values()}
            if len(slots) == _PARTS[name.split(".", 2)[2]]:
                self.slots[name] = [slots[i] for i in sorted(slots)]
                self.layouts[name] = kinds.pop() if len(kinds) == 1 else "Q8K"

    def __getitem__(self, name: str) -> tuple[str, Int4Weight | Int8Weight]:
        parts = [gguf_blocks(self.index.raw(e), e.kind, e.shape) for e in self.slots[name]]
        layout = self.layouts[name]
        return layout, _cat([_k_form(p) for p in parts] if layout == "Q8K" else parts)

    def __iter__(self) -> Iterator[str]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def rows(self, name: str) -> int:
        """Output rows of the fused linear ``name``."""
        return sum(e.shape[0] for e in self.slots[name])

    def hf_weights(self, name: str) -> list[str]:
        """The HF names of the dense weights ``name`` is fused from."""
        return [str(gguf_hf_name(e.name)) for e in self.slots[name]]


def gguf_head_blocks(index: GGUFTensors) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The LM head's own Q8_0 blocks (``output.weight``, else the tied ``token_embd.weight``) as
    int8 codes [vocab, hidden] and float32 scales [vocab, hidden / 32]; None for another type."""
    e = index.entries.get("output.weight", index.entries.get("token_embd.weight"))
    if e is None or e.kind != "Q8_0":
        return None
    n, k = e.shape
    codes, scale = _q8_0(index.raw(e).reshape(n, k // GROUP, -1))
    return torch.from_numpy(codes.reshape(n, k)), torch.from_numpy(scale)


HeadBlocks = Callable[[], "tuple[torch.Tensor, torch.Tensor] | None"]


def kept_blocks(folder: str | Path) -> tuple[KeptParts, HeadBlocks] | None:
    """(the kept layer linears, a reader of the head's Q8_0 blocks) of a converted GGUF's folder,
    or None for a folder of safetensors."""
    index = GGUFTensors.load(folder)
    if index is None:
        return None
    return KeptParts(index), lambda: gguf_head_blocks(index)
