"""A GGUF matrix kept as the file's own blocks, mapped from the file, its rows de-quantized when
looked up: the token embedding without a dense copy, and the rows of a quantized LM head that a
drafter sharing it reads.

Why: a dense bf16 embedding takes 2 bytes a parameter, where the file holds 0.5-1 (a 2B-shaped
model's 49,152 x 2048 table: 188 MiB in bf16, 79 MiB as Q6_K; an 8B's 128K vocabulary: 1 GiB in
bf16), yet a step reads one row per token. Mapped, only the pages of rows ever looked up become
resident. Rows go through the same de-quantization the dense load uses (gguf-py's, one row at a
time is the same arithmetic as a slice of rows), then the same cast, so a looked-up row has the
bits the dense table would have held.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from dspark.models.gguf_tensors import GGUFTensors, TensorEntry


class BlockRows(nn.Module):
    """Rows of a GGUF matrix [num_embeddings, embedding_dim], mapped from the file and
    de-quantized into ``dtype`` on lookup. Called with token ids it is the token embedding
    (as ``nn.Embedding``); :meth:`dense` gives a range of rows (to quantize a head from them)."""

    CACHE_BYTES = 16 << 20  # de-quantized rows kept for the small lookups of decode steps
    SMALL = 64  # lookups of at most this many ids go through that cache (prompt chunks do not)

    def __init__(self, index: GGUFTensors, entry: TensorEntry, dtype: torch.dtype):
        super().__init__()
        if len(entry.shape) != 2:
            raise ValueError(f"{entry.name}: block rows need a matrix, got shape {entry.shape}")
        from gguf import GGMLQuantizationType

        n, k = entry.shape
        self.num_embeddings, self.embedding_dim, self.dtype = n, k, dtype
        self.kind, self.row_bytes = GGMLQuantizationType[entry.kind], entry.nbytes // n
        self._index, self._entry = index, entry
        # read-only: a write into the map would be a write into the user's model file
        self._raw = np.memmap(index.path, dtype=np.uint8, mode="r", offset=entry.offset, shape=(n, self.row_bytes))
        # de-quantized rows of the tokens a decode step looks up, by id (oldest dropped first): a
        # step looks up a token or a block's few, and de-quantizing one costs a dozen small ops
        self._recent: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.recent_rows = max(1, self.CACHE_BYTES // (k * torch.finfo(dtype).bits // 8))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_embeddings, self.embedding_dim))

    def _values(self, raw: np.ndarray) -> torch.Tensor:
        from gguf.quants import dequantize

        if not len(raw):
            return torch.empty(0, self.embedding_dim, dtype=self.dtype)
        if self.kind.name == "Q8_0":  # gguf-py's product, in torch: a decode step's row in microseconds
            b = torch.from_numpy(raw).view(len(raw), -1, 34)
            d = b[..., :2].contiguous().view(torch.float16).float()
            return (b[..., 2:].contiguous().view(torch.int8).float() * d).view(len(raw), -1).to(self.dtype)
        values = np.asarray(dequantize(raw, self.kind), dtype=np.float32)
        return torch.from_numpy(values.reshape(len(raw), self.embedding_dim)).to(self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), embedding_dim] for 1-D ids."""
        flat = ids.reshape(-1).cpu()
        if 0 < flat.numel() <= self.SMALL:
            return self._recent_rows(flat.tolist())
        self._check(*(flat.aminmax() if flat.numel() else (0, 0)), flat)
        return self._values(self._raw[flat.numpy()])

    def _check(self, lo: int, hi: int, ids: torch.Tensor | list[int]) -> None:
        if lo < 0 or hi >= self.num_embeddings:
            # numpy would take a negative id from the end; nn.Embedding refuses it, and so do we
            shown = ids.tolist() if isinstance(ids, torch.Tensor) else ids
            raise IndexError(f"token id out of range [0, {self.num_embeddings}): {shown[:8]}")

    def _recent_rows(self, ids: list[int]) -> torch.Tensor:
        """A decode step's few rows through the cache of recent ones (oldest dropped first)."""
        self._check(min(ids), max(ids), ids)
        recent = self._recent
        missing = list(dict.fromkeys(t for t in ids if t not in recent))
        # the same de-quantization, so a cached row has the bits of a fresh one; each row its own
        # storage, not a view keeping the whole batch alive
        for t, row in zip(missing, self._values(self._raw[missing]) if missing else ()):
            recent[t] = row.clone()
        out = torch.stack([recent[t] for t in ids])
        while len(recent) > self.recent_rows:  # after the stack: this lookup may need them all
            recent.popitem(last=False)
        return out

    def dense(self, start: int, stop: int) -> torch.Tensor:
        """Rows start .. stop - 1, de-quantized; read from the file, not through the map, so a
        pass over every row (quantizing a head from them) leaves none of its pages resident."""
        return self._values(self._index.raw(self._entry, (start, stop)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind.name} blocks mapped, rows as {self.dtype}"
