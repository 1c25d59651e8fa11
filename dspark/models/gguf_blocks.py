"""Read a GGUF's quantized layer weights as codes and scales (no de-quantization).

The loader converts a GGUF into a dense HF folder once; when ``--quantization`` keeps the
file's own 4-/8-bit weights, the decoder layers' projections are read here again from the
memory-mapped file and fused the way the model fuses them (q/k/v, gate/up).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from dspark.atomic import atomic_path
from dspark.models.loader import gguf_heads, gguf_hf_name, unpermute_rotary_rows
from dspark.models.quant import GROUP, Int4Weight, Int8Weight

_FUSED = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
          "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
          "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
          "down_proj": ("mlp.down_proj", 0)}
_PARTS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}
KEPT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
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
    q = torch.from_numpy((qs & 0x0F).astype(np.int32).reshape(n, k))
    scale = torch.from_numpy((d * sc).reshape(n, k // GROUP))
    mins = torch.from_numpy((dmin * m).reshape(n, k // GROUP))
    return Int4Weight(q, scale, 8 * scale - mins)


def gguf_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> Int4Weight | Int8Weight:
    """A GGUF Q4_0 / Q4_1 / Q4_K / Q8_0 tensor (raw bytes, [N, bytes per row]) as codes and
    scales, exactly: Q4 blocks as w = (q - 8) * d + zero, Q8_0 blocks as codes with one scale per
    block of 32 inputs."""
    n, k = shape
    if kind == "Q4_K":
        return _q4_k(raw, n, k)
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, -1)
    if kind == "Q8_0":
        q, d = _q8_0(blocks)
        return Int8Weight(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d))
    if kind not in ("Q4_0", "Q4_1"):
        raise ValueError(f"no int4/int8 layout for GGUF type {kind}")
    d = _block_scale(blocks)
    off = 4 if kind == "Q4_1" else 2
    nib = blocks[..., off:off + 16]
    q = torch.from_numpy(np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.int32).reshape(n, k))
    d_t = torch.from_numpy(d)
    if kind == "Q4_1":  # w = d * q + m  ->  (q - 8) * d + (m + 8 d)
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        return Int4Weight(q, d_t, m + 8 * d_t)
    return Int4Weight(q, d_t, torch.zeros_like(d_t))  # w = d * (q - 8)


def _cat(ws: list[Int4Weight | Int8Weight]) -> Int4Weight | Int8Weight:
    if isinstance(ws[0], Int4Weight):
        return Int4Weight(torch.cat([w.q for w in ws]), torch.cat([w.scale for w in ws]),
                          torch.cat([w.zero for w in ws]))
    return Int8Weight(torch.cat([w.q for w in ws]), torch.cat([w.scale for w in ws]))


def gguf_linear_parts(reader) -> dict[str, tuple[str, Int4Weight | Int8Weight]]:  # noqa: ANN001
    """Fused layer linears whose GGUF parts (a ``gguf.GGUFReader``'s) all share one kept layout ("Q4"
    for Q4_0/Q4_1/Q4_K, or "Q8_0"): ``layers.3.mlp.gate_up_proj`` -> (layout, codes and scales in the
    model's row order)."""
    arch, n_head, n_kv = gguf_heads(reader)
    found: dict[str, dict[int, tuple[str, Int4Weight | Int8Weight]]] = {}
    for t in reader.tensors:
        hf = gguf_hf_name(t.name)
        kind = t.tensor_type.name
        if hf is None or not hf.endswith(".weight") or kind not in KEPT_TYPES or ".layers." not in hf:
            continue
        layer, proj = hf.split(".")[2], hf.split(".")[-2]
        if proj not in _FUSED:
            continue
        fused, slot = _FUSED[proj]
        shape = tuple(int(x) for x in reversed(t.shape))
        raw = unpermute_rotary_rows(np.asarray(t.data).reshape(shape[0], -1), arch, t.name, n_head, n_kv)
        found.setdefault(f"layers.{layer}.{fused}", {})[slot] = (kind, gguf_blocks(raw, kind, shape))
    out = {}
    for name, slots in found.items():
        # Q4_0, Q4_1 and Q4_K share one layout (codes, scale, offset): a layer may mix them; a
        # part of another type (a Q4_K_M file's Q6_K attn_v) leaves the fused linear dense
        kinds = {"Q4" if k.startswith("Q4") else k for k, _ in slots.values()}
        if len(slots) == _PARTS[name.split(".", 2)[2]] and len(kinds) == 1:
            out[name] = (kinds.pop(), _cat([slots[i][1] for i in sorted(slots)]))
    return out


def gguf_head_blocks(reader) -> tuple[torch.Tensor, torch.Tensor] | None:  # noqa: ANN001
    """The LM head's own Q8_0 blocks in a ``gguf.GGUFReader`` (``output.weight``, else the tied
    ``token_embd.weight``) as int8 codes [vocab, hidden] and float32 scales [vocab, hidden / 32];
    None for another type."""
    tensors = {t.name: t for t in reader.tensors}
    t = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if t is None or t.tensor_type.name != "Q8_0":
        return None
    n, k = (int(x) for x in reversed(t.shape))
    codes, scale = _q8_0(np.ascontiguousarray(np.asarray(t.data)).reshape(n, k // GROUP, -1))
    return torch.from_numpy(codes.reshape(n, k)), torch.from_numpy(scale)


# The kept blocks of a converted GGUF, saved beside its dense copy: parsing a GGUF header walks its
# whole vocabulary and merges in Python (seconds on every start), reading this back takes a blink.
# Safetensors inside, but not named *.safetensors: the folder's dense weights are all of those.
KEPT_FILE = "gguf_blocks.st"
_KEPT_VERSION = "3"  # bump when what gguf_linear_parts or gguf_head_blocks return changes

LinearParts = dict[str, tuple[str, Int4Weight | Int8Weight]]
HeadBlocks = tuple[torch.Tensor, torch.Tensor] | None


def kept_blocks(gguf_path: str, folder: str | Path) -> tuple[LinearParts, HeadBlocks]:
    """(gguf_linear_parts, gguf_head_blocks) of the GGUF at gguf_path, from ``folder/KEPT_FILE``
    (its converted copy's folder) when that was written for this file, else read from the GGUF
    and written there for the next start (skipped where the folder is read-only)."""
    from gguf import GGUFReader

    path = Path(folder) / KEPT_FILE
    kept = _load_kept(path)
    if kept is not None:
        return kept
    reader = GGUFReader(gguf_path)
    parts, head = gguf_linear_parts(reader), gguf_head_blocks(reader)
    try:
        _save_kept(path, parts, head)
    except OSError as e:
        log.info("kept GGUF blocks not cached in %s: %s", path, e)
    return parts, head


def _save_kept(path: Path, parts: LinearParts, head: HeadBlocks) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, (layout, w) in parts.items():
        # int4 codes are 0..15: a byte each on disk, int32 again once read
        tensors[f"{name}.q"] = w.q.to(torch.uint8) if layout == "Q4" else w.q
        tensors[f"{name}.scale"] = w.scale
        if layout == "Q4":
            tensors[f"{name}.zero"] = w.zero
    if head is not None:
        tensors["lm_head.codes"], tensors["lm_head.scale"] = head
    meta = {"version": _KEPT_VERSION, "layouts": json.dumps({n: layout for n, (layout, _) in parts.items()})}
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        tmp.chmod(0o644)  # as the converted folder's other files: the cache may be shared


def _load_kept(path: Path) -> tuple[LinearParts, HeadBlocks] | None:
    from safetensors import safe_open

    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("version") != _KEPT_VERSION:
            return None
        parts: LinearParts = {}
        for name, layout in json.loads(meta["layouts"]).items():
            q, scale = f.get_tensor(f"{name}.q"), f.get_tensor(f"{name}.scale")
            parts[name] = (layout, Int4Weight(q.to(torch.int32), scale, f.get_tensor(f"{name}.zero"))
                           if layout == "Q4" else Int8Weight(q, scale))
        head = (f.get_tensor("lm_head.codes"), f.get_tensor("lm_head.scale")) if "lm_head.codes" in f.keys() else None
    return parts, head
