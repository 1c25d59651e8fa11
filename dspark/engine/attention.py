"""Attention backends over the paged KV cache.

The interface mirrors FlashInfer's paged wrappers: `plan` once per forward
from the batch layout (page tables, query and KV lengths, mask), then
`forward` once per layer. The "torch" backend is the CPU reference: it gathers
each sequence's keys into a padded batch and runs one masked SDPA per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttnBatch:
    """Layout of one ragged forward: sequence i adds q_lens[i] tokens after its
    kv_lens[i] - q_lens[i] cached ones. mask: "causal" (chains, prefill),
    "full" (every new token sees every other: the drafter block) or "custom"
    (custom_masks[i] is a [q, q] bool tensor among the new tokens; all cached
    tokens stay visible)."""

    q_lens: list[int]
    kv_lens: list[int]
    page_tables: list[list[int]]
    page_size: int
    mask: str = "causal"
    custom_masks: list[torch.Tensor | None] = field(default_factory=list)

    def slot_mapping(self) -> list[int]:
        out: list[int] = []
        ps = self.page_size
        for q, kv, pages in zip(self.q_lens, self.kv_lens, self.page_tables):
            out.extend(pages[p // ps] * ps + p % ps for p in range(kv - q, kv))
        return out


class TorchAttention:
    """Reference backend: gather paged K/V into a padded batch, one SDPA per layer."""

    name = "torch"

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)

    def plan(self, batch: AttnBatch) -> None:
        dev = self.device
        S = len(batch.q_lens)
        qmax, lmax = max(batch.q_lens), max(batch.kv_lens)
        ps = batch.page_size
        self.num_tokens = sum(batch.q_lens)
        self.slot_mapping = torch.tensor(batch.slot_mapping(), dtype=torch.long, device=dev)
        pos = torch.arange(lmax)
        gather = torch.zeros(S, lmax, dtype=torch.long)
        q_index = torch.full((S, qmax), self.num_tokens, dtype=torch.long)  # pad -> zero row
        out_rows = []
        mask = torch.zeros(S, qmax, lmax, dtype=torch.bool)
        start = 0
        for i, (q, kv, pages) in enumerate(zip(batch.q_lens, batch.kv_lens, batch.page_tables)):
            page_ids = torch.tensor(pages, dtype=torch.long)
            n = min(kv, lmax)
            gather[i, :n] = page_ids[pos[:n] // ps] * ps + pos[:n] % ps
            q_index[i, :q] = torch.arange(start, start + q)
            out_rows.append(torch.arange(q) + i * qmax)
            ctx = kv - q
            if batch.mask == "causal":
                qpos = ctx + torch.arange(q)
                mask[i, :q, :kv] = pos[None, :kv] <= qpos[:, None]
            elif batch.mask == "full":
                mask[i, :q, :kv] = True
            else:
                mask[i, :q, :ctx] = True
                mask[i, :q, ctx:kv] = batch.custom_masks[i].to(torch.bool)
            if q < qmax:  # padded query rows see one key so softmax stays finite
                mask[i, q:, 0] = True
            start += q
        self.gather = gather.to(dev)
        self.q_index = q_index.to(dev)
        self.out_rows = torch.cat(out_rows).to(dev)
        self.mask = mask[:, None].to(dev)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [N, H, D]; k, v: [N, Hkv, D] for the new tokens; caches: [slots, Hkv, D]."""
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        N, H, D = q.shape
        qp = torch.cat([q, q.new_zeros(1, H, D)])[self.q_index]  # [S, Qmax, H, D]
        kp = k_cache[self.gather]  # [S, Lmax, Hkv, D]
        vp = v_cache[self.gather]
        o = F.scaled_dot_product_attention(
            qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
            attn_mask=self.mask, scale=scale, enable_gqa=H != k.shape[1])
        return o.transpose(1, 2).reshape(-1, H, D)[self.out_rows]


def make_backend(name: str, device: str | torch.device):
    """Pick an attention backend: "torch", "flashinfer" or "auto"."""
    dev = torch.device(device)
    if name == "auto":
        name = "torch"
        if dev.type == "cuda":
            try:
                import flashinfer  # noqa: F401

                name = "flashinfer"
            except ImportError:
                pass
    if name == "torch":
        return TorchAttention(dev)
    if name == "flashinfer":
        from dspark.engine.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(dev)
    raise ValueError(f"unknown attention backend {name!r}: choose torch, flashinfer or auto")
