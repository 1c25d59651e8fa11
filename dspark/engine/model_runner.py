"""Runs the target model over one ragged batch on the paged cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.attention import AttnBatch
from dspark.engine.kv_cache import KVCache, PagePool
from dspark.engine.sequence import Sequence


@dataclass
class ForwardResult:
    """Hidden states for every input row, captured features, and logits for chosen rows."""

    hidden: torch.Tensor
    feats: torch.Tensor | None
    logits: torch.Tensor | None
    row_starts: list[int]


class ModelRunner:
    """Owns the target model, its KV tensors and the attention backend."""

    def __init__(self, model, pool: PagePool, kv: KVCache, attn, device: torch.device):
        self.model, self.pool, self.kv, self.attn, self.device = model, pool, kv, attn, device

    def batch_layout(self, items: list[tuple[Sequence, list[int]]], mask: str = "causal",
                     custom_masks: list | None = None) -> tuple[AttnBatch, torch.Tensor, torch.Tensor]:
        """AttnBatch plus flat token ids and positions for sequences each adding tokens
        after their num_cached cached ones (pages must already be reserved)."""
        q_lens = [len(toks) for _, toks in items]
        kv_lens = [s.num_cached + n for (s, _), n in zip(items, q_lens)]
        batch = AttnBatch(q_lens=q_lens, kv_lens=kv_lens,
                          page_tables=[self.pool.tables[s.seq_id].pages for s, _ in items],
                          page_size=self.pool.page_size, mask=mask, custom_masks=custom_masks or [])
        ids = torch.tensor([t for _, toks in items for t in toks], dtype=torch.long)
        pos = torch.cat([torch.arange(s.num_cached, s.num_cached + len(toks)) for s, toks in items])
        return batch, ids.to(self.device), pos.to(self.device)

    @torch.inference_mode()
    def forward(self, items: list[tuple[Sequence, list[int]]], logit_rows: list[int],
                capture: tuple[int, ...] = (), mask: str = "causal",
                custom_masks: list | None = None, positions: torch.Tensor | None = None) -> ForwardResult:
        batch, ids, pos = self.batch_layout(items, mask, custom_masks)
        if positions is not None:
            pos = positions.to(self.device)
        self.attn.plan(batch)
        hidden, feats = self.model(ids, pos, self.attn, self.kv, capture)
        logits = None
        if logit_rows:
            logits = self.model.logits(hidden[torch.tensor(logit_rows, device=self.device)])
        starts, acc = [], 0
        for n in batch.q_lens:
            starts.append(acc)
            acc += n
        return ForwardResult(hidden, feats, logits, starts)
