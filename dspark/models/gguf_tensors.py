"""A GGUF's tensors, read one at a time straight from the file.

A GGUF is converted once into a small folder (config, tokenizer) holding an index of the file's
tensors: names, types, shapes and byte offsets. Loading then reads each tensor with one
``pread`` and drops the bytes once it has become what the model keeps: a dense weight
(de-quantized in the model's dtype) or the file's own blocks (``gguf_blocks``). Only a quantized
target's token embedding is memory-mapped (``block_rows``: a step reads a row per token, so only
rows ever looked up become resident); nothing else is, so the resident set never holds the file on
top of the model, and no dense float copy of the weights is ever written to disk (the index
replaces the gigabytes of float32 a 2B model would take there).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

INDEX_FILE = "gguf_tensors.json"
_INDEX_VERSION = 1
_CHUNK_BYTES = 16 << 20  # stored bytes de-quantized at a time
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_hf_name(name: str) -> str | None:
    """The HF name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``),
    or None for a name dspark does not know."""
    base, _, suffix = name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}" if base in _TOP_NAMES else None


def _rotary_permuted(arch: str, name: str) -> bool:
    return arch == "llama" and name.rpartition(".")[0].split(".")[-1] in ("attn_q", "attn_k")


def unpermute_rotary_rows(w, arch: str, name: str, n_head: int, n_kv: int):  # noqa: ANN001, ANN201 - array-like
    """Undo llama.cpp's interleaving of q/k rows for rotary (llama only); rows move whole, so
    this applies to weights, to quantized codes and to per-row block scales alike."""
    if not _rotary_permuted(arch, name):
        return w
    kind = name.rpartition(".")[0].split(".")[-1]
    h = n_head if kind == "attn_q" else n_kv
    return w.reshape(h, w.shape[0] // h // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in the file: GGUF name and type name, shape in torch order (rows first),
    absolute byte offset and length."""

    name: str
    kind: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class GGUFTensors:
    """The index of one GGUF's tensors and reads of them, one tensor at a time."""

    def __init__(self, path: str, arch: str, n_head: int, n_kv: int, entries: list[TensorEntry]):
        self.path, self.arch, self.n_head, self.n_kv = path, arch, n_head, n_kv
        self.entries = {e.name: e for e in entries}
        self.by_hf = {hf: e for e in entries if (hf := gguf_hf_name(e.name)) is not None}

    @classmethod
    def from_reader(cls, reader, path: str, arch: str, n_head: int, n_kv: int) -> GGUFTensors:  # noqa: ANN001
        entries = [TensorEntry(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                               int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
        return cls(path, arch, n_head, n_kv, entries)

    def save(self, folder: Path) -> None:
        body = {"version": _INDEX_VERSION, "file": self.path, "arch": self.arch, "n_head": self.n_head,
                "n_kv": self.n_kv, "tensors": [[e.name, e.kind, list(e.shape), e.offset, e.nbytes]
                                               for e in self.entries.values()]}
        (folder / INDEX_FILE).write_text(json.dumps(body) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> GGUFTensors | None:
        """The index in a converted folder, or None for a folder of safetensors."""
        path = Path(folder) / INDEX_FILE
        if not path.is_file():
            return None
        body = json.loads(path.read_text())
        if body.get("version") != _INDEX_VERSION:
            raise ValueError(f"{path} is from another dspark version: delete its folder to convert again")
        if not Path(body["file"]).is_file():
            raise FileNotFoundError(f"{folder} reads its weights from {body['file']}, which is gone")
        entries = [TensorEntry(n, k, tuple(s), o, b) for n, k, s, o, b in body["tensors"]]
        return cls(body["file"], body["arch"], body["n_head"], body["n_kv"], entries)

    def raw(self, entry: TensorEntry, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor's bytes as stored ([rows, bytes per row] for a matrix), rows in HF order;
        rows=(start, stop): only those rows of a matrix whose rows are stored in HF order."""
        offset, nbytes, row = entry.offset, entry.nbytes, 0
        if rows is not None:
            row = entry.nbytes // entry.shape[0]
            if _rotary_permuted(self.arch, entry.name):
                raise ValueError(f"{entry.name}: its rows are stored permuted; read it whole")
            start, stop = rows[0], min(rows[1], entry.shape[0])
            offset, nbytes = entry.offset + start * row, max(0, stop - start) * row
        buf = bytearray(nbytes)
        view = memoryview(buf)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < nbytes:
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(f"{self.path} ends inside tensor {entry.name} (was it changed?)")
                done += n
        finally:
            os.close(fd)
        a = np.frombuffer(buf, dtype=np.uint8)
        if rows is not None:
            return a.reshape(-1, row)
        a = a.reshape(entry.shape[0], -1) if len(entry.shape) > 1 else a
        return unpermute_rotary_rows(a, self.arch, entry.name, self.n_head, self.n_kv)

    def dense(self, entry: TensorEntry, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor de-quantized in torch order, in ``dtype`` (an own, writable tensor). Large
        tensors go a slice of rows at a time: de-quantizing an embedding whole makes several
        float32 temporaries of it, gigabytes at a 2B model's vocabulary."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        kind = GGMLQuantizationType[entry.kind]
        raw = self.raw(entry)
        if raw.ndim == 1:
            return torch.from_numpy(np.array(dequantize(raw, kind), dtype=np.float32)).reshape(entry.shape).to(dtype)
        out = torch.empty(entry.shape, dtype=dtype)
        rows = max(1, _CHUNK_BYTES // max(1, raw.shape[1]))
        for r in range(0, raw.shape[0], rows):
            part = np.asarray(dequantize(raw[r:r + rows], kind), dtype=np.float32)
            out[r:r + rows] = torch.from_numpy(part.reshape(-1, *entry.shape[1:]))
        return out

    def state_dict(self, dtype: torch.dtype, device: str = "cpu", skip: frozenset[str] = frozenset()
                   ) -> dict[str, torch.Tensor]:
        """Every tensor with an HF name but those in ``skip``, de-quantized and cast one at a time."""
        return {hf: self.dense(e, dtype).to(device) for hf, e in self.by_hf.items() if hf not in skip}
