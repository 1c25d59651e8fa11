"""Runs the target model over one ragged batch on the paged cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.attention import AttnBatch
from dspark.engine.cuda_graphs import GraphPool
from dspark.engine.kv_cache import KVCache, PagePool
from dspark.engine.sequence import Sequence
from dspark.engine.step_input import StepInput, run_step


@dataclass
class ForwardResult:
    """Hidden states for every input row, captured features, and logits for chosen rows. feats is
    the pass's own tensor (never a buffer a later pass writes), so it may be kept as it is."""

    hidden: torch.Tensor
    feats: torch.Tensor | None
    logits: torch.Tensor | None
    row_starts: list[int]


def copy_slots(kv: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """K/V of every layer from slots src to slots dst."""
    kv.k[:, dst] = kv.k[:, src]
    kv.v[:, dst] = kv.v[:, src]


class ModelRunner:
    """Owns the target model, its KV tensors and the attention backend."""

    def __init__(self, model, pool: PagePool, kv: KVCache, attn, device: torch.device, workers=None):  # noqa: ANN001
        self.model, self.pool, self.kv, self.attn, self.device = model, pool, kv, attn, device
        self.workers = workers  # dist.workers.Workers: tensor-parallel ranks mirroring every call
        self.graphs: dict[int, GraphPool] = {}  # tokens per request -> padded (captured) forwards
        self.graph_capture_layers: tuple[int, ...] = ()

    def batch_layout(self, items: list[tuple[Sequence, list[int]]], mask: str = "causal",
                     custom_masks: list | None = None,
                     starts: list[int] | None = None) -> tuple[AttnBatch, torch.Tensor, torch.Tensor]:
        """AttnBatch plus flat token ids and positions for sequences each adding tokens after
        their first starts[i] positions (default: their num_cached cached ones); pages must
        already be reserved."""
        q_lens = [len(toks) for _, toks in items]
        starts = starts if starts is not None else [s.num_cached for s, _ in items]
        kv_lens = [at + n for at, n in zip(starts, q_lens)]
        batch = AttnBatch(q_lens=q_lens, kv_lens=kv_lens,
                          page_tables=[self.pool.tables[s.seq_id].pages for s, _ in items],
                          page_size=self.pool.page_size, mask=mask, custom_masks=custom_masks or [])
        ids = torch.tensor([t for _, toks in items for t in toks], dtype=torch.long)
        pos = torch.cat([torch.arange(at, at + len(toks)) for at, (_, toks) in zip(starts, items)])
        return batch, ids.to(self.device), pos.to(self.device)

    @torch.inference_mode()
    def forward(self, items: list[tuple[Sequence, list[int]]], logit_rows: list[int],
                capture: tuple[int, ...] = (), mask: str = "causal",
                custom_masks: list | None = None, positions: torch.Tensor | None = None,
                prompt_rows: list[int] | None = None) -> ForwardResult:
        """prompt_rows[i]: how many leading tokens of item i are prompt tokens (quantized linears
        take their dense path for those)."""
        batch, ids, pos = self.batch_layout(items, mask, custom_masks)
        if positions is not None:
            pos = positions.to(self.device)
        out = self._graph_forward(batch, ids, capture, positions is not None)
        if out is not None:
            hidden, feats = out
            feats = feats if capture else None
            logits = self.logits(hidden[torch.tensor(logit_rows, device=self.device)]) if logit_rows else None
        else:
            step = StepInput(ids, pos, batch, tuple(capture), prompt_rows, logit_rows or None)
            if self.workers is not None:
                self.workers.send(*step.to_message())
            hidden, feats, logits = run_step(self.model, self.kv, self.attn, step)
        starts, acc = [], 0
        for n in batch.q_lens:
            starts.append(acc)
            acc += n
        return ForwardResult(hidden, feats, logits, starts)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits of some hidden rows (every rank takes part under tensor parallelism)."""
        if self.workers is not None:
            self.workers.send({"op": "logits"}, [hidden.cpu()])
        return self.model.logits(hidden)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move cached K/V between slots (a tree's accepted path into place), on every rank."""
        if self.workers is not None:
            self.workers.send({"op": "copy"}, [src.cpu(), dst.cpu()])
        copy_slots(self.kv, src, dst)

    def _graph_forward(self, batch: AttnBatch, ids, capture, custom_positions: bool):
        """(hidden, feats) from a graph pool when one fits this batch, else None. A pass that
        captures nothing still replays the graphs (their capture costs a copy, an eager pass a
        launch per kernel)."""
        if not self.graphs or custom_positions or tuple(capture) not in ((), self.graph_capture_layers):
            return None
        longest = max(batch.q_lens)
        q = next((n for n in sorted(self.graphs) if n >= longest), None)
        return None if q is None else self.graphs[q].run(batch, ids)
