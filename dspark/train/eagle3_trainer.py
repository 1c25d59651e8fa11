"""Training an EAGLE-3 head (`train-drafter --kind eagle3`): the DSpark trainer's data, batch
order, target features (at the head's capture layers), feature cache, schedule, checkpoints and
resume, with the training-time-test loss of eagle3.py and an export in the published EAGLE-3
layout (save_eagle3), which `--drafter <out>/final` loads as an EAGLE-3 head."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark.models.drafters.eagle3 import Eagle3Head, save_eagle3
from dspark.train.eagle3 import STEP_DECAY, TTT_STEPS, eagle3_loss
from dspark.train.trainer import RESUME_SETTINGS, TrainConfig, Trainer


@dataclass
class Eagle3TrainConfig(TrainConfig):
    """TrainConfig plus the TTT loss's settings (anchors_per_seq, gamma and loss_weights are DSpark's
    and unused: every response position is supervised)."""

    ttt_steps: int = TTT_STEPS  # K: the head's own outputs feed K - 1 further steps
    step_decay: float = STEP_DECAY  # step s weighs step_decay ** s
    kl_weight: float = 1.0  # KL to the target's distribution, beside the CE on the data's tokens


class Eagle3Trainer(Trainer):
    """Trains an Eagle3Head (from drafter_init.new_eagle3_head) on self-distilled data."""

    resume_settings = RESUME_SETTINGS + ("ttt_steps", "step_decay", "kl_weight")

    def check_drafter(self) -> None:
        if not isinstance(self.drafter, Eagle3Head):
            raise ValueError(f"Eagle3Trainer trains EAGLE-3 heads, not {type(self.drafter).__name__}")
        if self.drafter.embed_tokens is not None:  # a head with its own copy of the target's embedding
            self.drafter.embed_tokens.requires_grad_(False)

    def capture_layers(self) -> list[int]:
        return list(self.drafter.config.capture_layers)

    def drafter_config(self) -> dict:
        return json.loads(json.dumps(self.export_config()))

    def export_config(self) -> dict:
        c = self.drafter.config
        return {**c.raw, "draft_vocab_size": c.draft_vocab_size,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids)}}

    def save_weights(self, path: Path, dtype: torch.dtype) -> None:
        save_eagle3(self.drafter, path, dtype)

    def micro_loss(self, micro: int) -> tuple[torch.Tensor, dict]:
        c = self.cfg
        idx = self.order.batch(micro)
        b = self.data.batch(idx, self.pad_id, self.dev)
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.amp):
            feats, final, _ = self.features(idx, b)
            return eagle3_loss(self.drafter, self.target.lm_head, feats, final, b["ids"], b["lengths"], b["resp"],
                               b["prompt_lens"], steps=c.ttt_steps, decay=c.step_decay, kl_weight=c.kl_weight)
