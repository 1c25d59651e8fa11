"""Target features of the training sequences, computed once and kept in RAM or on disk.

For each token: the residual stream at the drafter's target layers and the target's final
normed hidden state (bf16), and the log-normalizer of the target's full-vocabulary softmax
(fp32): (m + 1) * hidden * 2 + 4 bytes. The frozen target's forward is the dominant cost of a
training step on CPU, so a run that sees every sequence several times computes each once.

On disk (`folder`) the arrays are memory-mapped files plus `index.json` and `done.npy`
(which sequences are filled). They survive restarts, so a resumed run or the next session
skips the target entirely for sequences already seen. Sequences are identified by a CRC of
their token ids: when the data grows (new shards are appended), the filled prefix stays
valid; a sequence whose tokens changed is recomputed. A different target (its `key`:
weights fingerprint and dtype), other layers or another hidden size start the cache over.
The folder is locked while a cache has it open; filled sequences become durable at
`flush()` (the trainer flushes at every checkpoint).
"""

from __future__ import annotations

import fcntl
import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch

from dspark.atomic import atomic_path
from dspark.train.features import target_features

_PARTS = ("feats", "final", "lse")


# Bumped when the target's forward changes what it computes: version 1 features came from a
# target whose RoPE frequencies were rounded to bf16 along with its weights.
FEATURES_VERSION = 2


def target_key(model) -> str:
    """A fingerprint of a target's weights, dtype and forward: features cached from another model
    (or the same one in another dtype, or an older forward) must not be reused. Every parameter
    contributes up to 64 evenly spaced values, so a change in any layer shows."""
    w = model.lm_head.weight
    probe = []
    for p in model.parameters():
        flat = p.detach().flatten()
        probe.append(flat[::max(1, flat.numel() // 64)][:64].float().cpu())
    crc = zlib.crc32(torch.cat(probe).numpy().tobytes())
    return f"v{FEATURES_VERSION}:{w.dtype}:{tuple(w.shape)}:{crc:08x}"


def cache_bytes(num_tokens: int, num_layers: int, hidden: int) -> int:
    """Bytes the cache takes for num_tokens tokens."""
    return num_tokens * ((num_layers + 1) * hidden * 2 + 4)


class FeatureCache:
    """Per-sequence target features, lazily filled; RAM (zero pages until written) or files."""

    def __init__(self, seqs: list[np.ndarray], layer_ids: list[int], hidden: int, folder: str | Path | None = None,
                 key: str = ""):
        self.layer_ids, self.hidden, self.key = list(layer_ids), hidden, key
        lens = np.asarray([len(s) for s in seqs], dtype=np.int64)
        self.off = np.concatenate([[0], np.cumsum(lens)])
        self.crc = np.asarray([zlib.crc32(np.ascontiguousarray(s).tobytes()) for s in seqs], dtype=np.int64)
        n = int(self.off[-1])
        widths = {"feats": len(layer_ids) * hidden, "final": hidden, "lse": 1}
        dtypes = {"feats": np.int16, "final": np.int16, "lse": np.float32}  # int16 holds bf16 bits
        self.folder = Path(folder) if folder else None
        self.done = np.zeros(len(seqs), dtype=bool)
        if self.folder is None:
            self.arrays = {k: np.zeros((n, widths[k]), dtypes[k]) for k in _PARTS}
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.folder / "lock", "w")  # noqa: SIM115 (held for the cache's lifetime)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"feature cache {self.folder} is in use by another process") from None
        if (self.folder / "done.npy").exists():
            old = np.load(self.folder / "done.npy")
            keep = min(self._reusable_prefix(), len(old))
            self.done[:keep] = old[:keep]
        # forget invalidated sequences before any file changes size or the index changes
        self._save_done()
        sizes = {k: n * widths[k] * np.dtype(dtypes[k]).itemsize for k in _PARTS}
        grow = sum(max(0, sz - self._size(k)) for k, sz in sizes.items())
        free = shutil.disk_usage(self.folder).free
        if grow > free:  # sparse files would fail later, mid-run, as a SIGBUS
            raise OSError(f"feature cache needs {grow / 1e9:.2f} GB more in {self.folder}, "
                          f"only {free / 1e9:.2f} GB free")
        self.arrays = {}
        for k in _PARTS:
            path = self.folder / f"{k}.bin"
            with open(path, "ab") as f:  # grow (or create) the file; the filled prefix is untouched
                if f.tell() != sizes[k]:
                    f.truncate(sizes[k])
            self.arrays[k] = np.memmap(path, dtype=dtypes[k], mode="r+", shape=(n, widths[k]))
        self._write_index()

    def _size(self, part: str) -> int:
        path = self.folder / f"{part}.bin"
        return path.stat().st_size if path.exists() else 0

    def _reusable_prefix(self) -> int:
        """How many leading sequences of an existing cache folder still hold valid features."""
        try:
            idx = json.loads((self.folder / "index.json").read_text())
        except (OSError, ValueError):
            return 0
        if (idx.get("layer_ids"), idx.get("hidden"), idx.get("key")) != (self.layer_ids, self.hidden, self.key):
            return 0
        old_off, old_crc = np.asarray(idx["offsets"]), np.asarray(idx["crc"])
        m = min(len(old_crc), len(self.crc))
        same = (old_crc[:m] == self.crc[:m]) & (old_off[1:m + 1] == self.off[1:m + 1])
        return int(m if same.all() else np.argmin(same))

    def _write_index(self) -> None:
        idx = {"layer_ids": self.layer_ids, "hidden": self.hidden, "key": self.key, "offsets": self.off.tolist(),
               "crc": self.crc.tolist()}
        with atomic_path(self.folder / "index.json") as tmp:
            tmp.write_text(json.dumps(idx))

    @property
    def nbytes(self) -> int:
        """Bytes the whole cache takes once every sequence is filled."""
        return cache_bytes(int(self.off[-1]), len(self.layer_ids), self.hidden)

    def has(self, i: int) -> bool:
        """Whether sequence i's features are cached."""
        return bool(self.done[i])

    def put(self, i: int, feats: torch.Tensor, final: torch.Tensor, lse: torch.Tensor) -> None:
        """Store sequence i's [L, m*H] features, [L, H] final hidden and [L] log-normalizers."""
        lo, hi = self.off[i], self.off[i + 1]
        for k, x in zip(_PARTS, (feats, final, lse)):
            x = x.detach().to("cpu", torch.bfloat16 if k != "lse" else torch.float32).reshape(hi - lo, -1)
            self.arrays[k][lo:hi] = (x.view(torch.int16) if k != "lse" else x).numpy()
        self.done[i] = True

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(feats bf16 [L, m*H], final bf16 [L, H], lse fp32 [L]) of sequence i (copies)."""
        lo, hi = self.off[i], self.off[i + 1]
        feats, final, lse = (torch.from_numpy(np.array(self.arrays[k][lo:hi])) for k in _PARTS)
        return feats.view(torch.bfloat16), final.view(torch.bfloat16), lse[:, 0]

    def flush(self) -> None:
        """Make the filled sequences durable (call before checkpoints); a no-op in RAM."""
        if self.folder is None:
            return
        for a in self.arrays.values():
            a.flush()
        self._save_done()

    def close(self) -> None:
        """Flush and release the folder's lock (also happens when the cache is garbage-collected)."""
        self.flush()
        if self.folder is not None:
            self._lock.close()

    def _save_done(self) -> None:
        with atomic_path(self.folder / "done.npy", suffix=".npy") as tmp:
            np.save(tmp, self.done)


@torch.no_grad()
def cached_features(cache: FeatureCache, target, layers, idx: list[int], b: dict,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(feats, final hidden, log-normalizers) of a padded batch (dataset.TokenDataset.batch of
    the sequences `idx`), running the target only on the sequences the cache does not hold yet."""
    todo = [r for r, i in enumerate(idx) if not cache.has(i)]
    if todo:
        n = max(b["lens"][r] for r in todo)
        feats, final = target_features(target, b["ids"][todo, :n], layers)
        lse = torch.cat([torch.logsumexp(target.lm_head(x).float(), -1) for x in final.split(4)])
        for j, r in enumerate(todo):
            L = b["lens"][r]
            cache.put(idx[r], feats[j, :L], final[j, :L], lse[j, :L])
    T = b["ids"].shape[1]
    cached = [cache.get(i) for i in idx]
    out = []
    for part, dt in zip(range(3), (torch.bfloat16, torch.bfloat16, torch.float32)):
        x = torch.zeros(len(idx), T, *cached[0][part].shape[1:], dtype=dt)
        for r, c in enumerate(cached):
            x[r, :len(c[part])] = c[part]
        out.append(x.to(device, torch.float32))
    return tuple(out)
