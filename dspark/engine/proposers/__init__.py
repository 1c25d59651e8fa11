"""Proposers for each kind of drafter, and the factory that picks one for a SpecConfig."""

from __future__ import annotations

import json
from pathlib import Path

from dspark.config import SpecConfig
from dspark.engine.proposal import Draft, Proposer, TargetView
from dspark.engine.sequence import Sequence, SpecStats
from dspark.engine.spec import SpecRunner
from dspark.models.drafters.ngram import NgramDrafter

SHIPPED_DRAFTER = Path(__file__).resolve().parents[3] / "drafters" / "smollm2-135m-dspark"


class LookupProposer(Proposer):
    """Prompt lookup (``--drafter ngram``): drafts from the request's own tokens, q one-hot."""

    name = "ngram"
    deterministic = True

    def __init__(self, cfg: SpecConfig):
        self.num_drafts = cfg.block_size or 8
        self.drafter = NgramDrafter(cfg.ngram_max, cfg.ngram_min, self.num_drafts)

    def draft(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        out = [Draft(self.drafter.propose(s.all_ids, b, key=s.seq_id)) for s, b in zip(seqs, budgets)]
        self.drafter.forget_all_but({s.seq_id for s in seqs})
        return out

    def release(self, seq_id: int) -> None:
        self.drafter.forget(seq_id)


def default_drafter() -> str:
    """The trained drafter that ships with the project when it fits the default model, else ngram."""
    return str(SHIPPED_DRAFTER) if (SHIPPED_DRAFTER / "config.json").exists() else "ngram"


def drafter_kind(path: str) -> str:
    """"eagle3" for a folder in the EAGLE-3 layout, "block" for DSpark / DFlash ones."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return "block"  # load_drafter names what is missing
    archs = " ".join(cfg.get("architectures") or []).lower()
    return "eagle3" if "eagle3" in archs or cfg.get("eagle_config") is not None else "block"


def make_proposer(cfg: SpecConfig, target: TargetView, default_model: bool) -> Proposer:
    """The proposer a SpecConfig asks for (default_model: the target is the shipped default one)."""
    if cfg.draft_model is not None:
        from dspark.engine.proposers.draft_model import DraftModelProposer

        return DraftModelProposer(cfg, target, cfg.draft_model)
    name = cfg.drafter
    if name is None:
        name = default_drafter() if default_model else "ngram"
    if name == "none":
        return Proposer()
    if name == "ngram":
        return LookupProposer(cfg)
    if drafter_kind(name) == "eagle3":
        from dspark.engine.proposers.eagle3 import Eagle3Proposer

        return Eagle3Proposer(cfg, target, name)
    from dspark.engine.proposers.block import BlockProposer

    return BlockProposer(cfg, target, name)


def make_spec_runner(cfg: SpecConfig, target: TargetView, stats: SpecStats, max_model_len: int,
                     default_model: bool) -> SpecRunner:
    return SpecRunner(cfg, make_proposer(cfg, target, default_model), stats, max_model_len)
