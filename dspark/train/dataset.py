"""The training data as the trainer sees it: the shards in memory, and the order it visits them.

TokenDataset reads every shard of a data folder (data.py writes them). BatchOrder visits them in
epochs, each a permutation seeded by (seed, epoch) whose runs of `length_groups` micro-batches
are sorted by length, so a micro-batch pads little. Micro-batch m is a pure function of m, so a
resumed run draws exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file


class TokenDataset:
    """All shards of a data folder in memory (int32), with padded batch assembly."""

    def __init__(self, data_dir: str | Path, max_len: int | None = None):
        self.seqs: list[np.ndarray] = []
        self.prompt_lens: list[int] = []
        files = sorted(Path(data_dir).glob("shard_*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no shard_*.safetensors in {data_dir}")
        for f in files:
            d = load_file(str(f))
            off = d["offsets"]
            for j in range(len(d["prompt_lens"])):
                seq = d["tokens"][off[j]:off[j + 1]]
                p = int(d["prompt_lens"][j])
                if max_len:
                    seq = seq[:max_len]
                if len(seq) - p >= 2:  # at least one anchor with a next token
                    self.seqs.append(seq)
                    self.prompt_lens.append(p)
        if not self.seqs:
            raise ValueError(f"no usable sequences in {data_dir}")

    def __len__(self) -> int:
        return len(self.seqs)

    def num_tokens(self) -> int:
        return int(sum(len(s) for s in self.seqs))

    def batch(self, idx: list[int], pad_id: int, device) -> dict:
        lens = [len(self.seqs[i]) for i in idx]
        T = max(lens)
        ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
        resp = torch.zeros(len(idx), T, dtype=torch.bool)
        for r, i in enumerate(idx):
            ids[r, :lens[r]] = torch.from_numpy(self.seqs[i].astype(np.int64))
            resp[r, self.prompt_lens[i]:lens[r]] = True
        return {"ids": ids.to(device), "resp": resp.to(device), "lengths": torch.tensor(lens, device=device),
                "lens": lens, "prompt_lens": [self.prompt_lens[i] for i in idx]}


class BatchOrder:
    """Micro-batch indices of an endless sequence of seeded, length-grouped epochs."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int, length_groups: int):
        self.lengths, self.batch_size, self.seed, self.length_groups = lengths, batch_size, seed, length_groups
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its order), built on first use

    def epoch_order(self, epoch: int) -> list[int]:
        """The epoch's permutation, each run of length_groups micro-batches (at most a quarter of
        the data) sorted by sequence length: random batches of 8 pad the shipped drafter's data by
        a third, grouped ones by a few percent."""
        if self._order[0] != epoch:
            n, bs = len(self.lengths), self.batch_size
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch)).tolist()
            # at least 4 groups an epoch, so a small data set still gets new batches every epoch
            group = max(bs, min(self.length_groups * bs, n // 4 // bs * bs))
            if group > bs:
                lengths = self.lengths
                order = [i for s in range(0, n, group) for i in sorted(order[s:s + group], key=lambda i: lengths[i])]
            self._order = (epoch, order)
        return self._order[1]

    def batch(self, micro: int) -> list[int]:
        """The sequence indices of micro-batch `micro` (it may straddle two epochs)."""
        n, bs = len(self.lengths), self.batch_size
        out: list[int] = []
        pos = micro * bs
        while len(out) < bs:
            epoch, off = divmod(pos, n)
            take = self.epoch_order(epoch)[off:off + bs - len(out)]
            out += take
            pos += len(take)
        return out
