"""One target pass as plain data (as vLLM's scheduler output): token ids, positions, the attention
layout (query/KV lengths, page tables, masks), the layers to capture, which rows are prompt tokens
and which rows need logits. Tensor-parallel workers receive it as a JSON header plus tensors and
run the same forward without any Sequence object; rank 0 runs it through the same function."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.attention import AttnBatch
from dspark.models.packed import RowSplit


@dataclass
class StepInput:
    """Everything a rank needs for one forward over the paged cache."""

    ids: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N]
    batch: AttnBatch
    capture: tuple[int, ...] = ()
    prompt_rows: list[int] | None = None  # per sequence: leading prompt tokens (CPU linears' dense path)
    logit_rows: list[int] | None = None  # rows whose logits the pass returns

    def to_message(self) -> tuple[dict, list[torch.Tensor]]:
        """(JSON-able header, CPU tensors): ids, positions, then one mask per tree."""
        b = self.batch
        trees = [i for i, m in enumerate(b.custom_masks) if m is not None]
        header = {"op": "forward", "q_lens": b.q_lens, "kv_lens": b.kv_lens, "page_tables": b.page_tables,
                  "page_size": b.page_size, "mask": b.mask, "trees": trees, "num_masks": len(b.custom_masks),
                  "capture": list(self.capture), "prompt_rows": self.prompt_rows, "logit_rows": self.logit_rows}
        masks = [b.custom_masks[i].cpu() for i in trees]
        return header, [self.ids.cpu(), self.positions.cpu(), *masks]

    @classmethod
    def from_message(cls, header: dict, tensors: list[torch.Tensor], device: torch.device) -> StepInput:
        masks: list = [None] * header["num_masks"]
        for i, m in zip(header["trees"], tensors[2:]):
            masks[i] = m.to(device)
        batch = AttnBatch(q_lens=header["q_lens"], kv_lens=header["kv_lens"], page_tables=header["page_tables"],
                          page_size=header["page_size"], mask=header["mask"], custom_masks=masks)
        return cls(tensors[0].to(device), tensors[1].to(device), batch, tuple(header["capture"]),
                   header["prompt_rows"], header["logit_rows"])


@torch.inference_mode()
def run_step(model, kv, attn, step: StepInput) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(final hidden [N, H], captured features or None, logits of step.logit_rows or None)."""
    dev = step.ids.device
    attn.plan(step.batch)
    # only CPU layers (pre-packed, int4/int8) read the split: no index tensors elsewhere
    rows = RowSplit.of(step.batch.q_lens, step.prompt_rows, dev) if step.prompt_rows and dev.type == "cpu" else None
    hidden, feats = model(step.ids, step.positions, attn, kv, step.capture, rows)
    logits = model.logits(hidden[torch.tensor(step.logit_rows, device=dev)]) if step.logit_rows else None
    return hidden, feats, logits
