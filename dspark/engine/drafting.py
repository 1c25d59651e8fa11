"""Spec runners for each kind of drafter, and the factory that picks one."""

from __future__ import annotations

from pathlib import Path

from dspark.config import SpecConfig
from dspark.engine.sequence import Sequence
from dspark.engine.spec import SpecRunner
from dspark.models.drafters.ngram import NgramDrafter

SHIPPED_DRAFTER = Path(__file__).resolve().parents[2] / "drafters" / "smollm2-135m-dspark"


class NgramSpecRunner(SpecRunner):
    """Prompt lookup: drafts from the request's own tokens, q one-hot."""

    name = "ngram"

    def __init__(self, cfg: SpecConfig, engine):
        super().__init__(cfg, engine)
        self.block_size = cfg.block_size or 8
        self.drafter = NgramDrafter(cfg.ngram_max, cfg.ngram_min, self.block_size)

    def propose(self, seqs: list[Sequence], other_tokens: int = 0) -> dict[int, list[int]]:
        out = {}
        self._proposed.clear()
        for seq in seqs:
            drafts = self.drafter.propose(seq.all_ids, self.draft_budget(seq), key=seq.seq_id)
            self._proposed[seq.seq_id] = len(drafts)
            out[seq.seq_id] = drafts
        self.drafter.forget_all_but({s.seq_id for s in seqs})
        return out

    def release(self, seq_id: int) -> None:
        self.drafter.forget(seq_id)


def default_drafter() -> str:
    """The trained drafter that ships with the project when it fits the default model, else ngram."""
    return str(SHIPPED_DRAFTER) if (SHIPPED_DRAFTER / "config.json").exists() else "ngram"


def make_spec_runner(cfg: SpecConfig, engine) -> SpecRunner:
    name = cfg.drafter
    if name is None:
        name = default_drafter() if engine.config.model is None else "ngram"
    if name == "none":
        return SpecRunner(cfg, engine)
    if name == "ngram":
        return NgramSpecRunner(cfg, engine)
    from dspark.engine.neural_spec import NeuralSpecRunner

    return NeuralSpecRunner(cfg, engine, name)
