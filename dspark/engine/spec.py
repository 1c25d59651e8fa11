"""Speculation glue between the engine and a drafter: proposals, verification lengths,
draft distributions, and the drafter's context cache."""

from __future__ import annotations

import torch

from dspark.config import SpecConfig
from dspark.engine.sequence import Sequence


class SpecRunner:
    """No drafter: every request verifies just its anchor (plain decoding). Subclasses add drafting."""

    capture_layers: tuple[int, ...] = ()
    name = "none"

    def __init__(self, cfg: SpecConfig, engine):
        self.cfg, self.engine = cfg, engine
        self._proposed: dict[int, int] = {}

    @staticmethod
    def create(cfg: SpecConfig, engine) -> SpecRunner:
        from dspark.engine.drafting import make_spec_runner

        return make_spec_runner(cfg, engine)

    def draft_budget(self, seq: Sequence, cap: int | None = None) -> int:
        """Most draft tokens worth verifying for seq (cap: instead of the block size, unless the
        request set its own): never past max_tokens or the context."""
        if not seq.spec_enabled or seq.plain_step:
            return 0
        block = seq.block_size or cap or self.block_size
        left = seq.params.max_tokens - len(seq.output_ids) - 1
        room = self.engine.max_model_len - seq.num_cached - 2
        return max(0, min(block, left, room))

    def block_size_error(self, block_size: int | None) -> str | None:
        """Why a request's own block size cannot run here (None: it can, or it has no effect)."""
        if block_size is None or self.name == "none":
            return None
        top = 32 if self.name == "ngram" else self.block_size
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= top:
            return f"block_size must be an integer in [1, {top}] for drafter {self.name}, got {block_size!r}"
        return None

    def context_headroom(self) -> int:
        """Cache slots past max_model_len a step may reserve for one request. A chain never
        passes the context (draft_budget stops at it); a drafter block or a tree may."""
        return 0

    block_size = 0

    @property
    def longest_chain(self) -> int:
        """Most proposed tokens a request's chain may hold (CUDA graphs pad chains to it)."""
        return self.block_size

    graphs = None  # the drafter's GraphPool, when the engine uses CUDA graphs

    def calibrate(self) -> None:
        """Called once the engine is built (after CUDA graphs): measure what the policy needs."""

    block_forward = None  # the drafter model's block forward, for CUDA graphs (None: no drafter model)

    def max_tokens_for(self, seq: Sequence) -> int:
        """Cache slots beyond num_cached a step may write for seq."""
        return 1 + self.draft_budget(seq)

    def propose(self, seqs: list[Sequence], other_tokens: int = 0) -> dict[int, list[int]]:
        """Draft tokens (or a DraftTree) per seq_id; other_tokens: prefill tokens in the same pass."""
        return {}

    def num_proposed(self, seq: Sequence) -> int:
        return self._proposed.get(seq.seq_id, 0)

    def looked_up(self, seq: Sequence) -> bool:
        """Whether seq verified a looked-up chain (the n-gram assist) this step, not drafts."""
        return False

    def draft_probs(self, rows, K: int, V: int, proposals) -> torch.Tensor | None:
        """[R, K, V] draft distributions of the verified tokens, or None when one-hot."""
        return None

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A decode-only step's target tokens and its wall seconds outside the drafter pass (the
        pass, acceptance and commit), for policies that price verification."""

    def commit(self, ctx_rows, result) -> None:
        """Called after each forward with (seq, first new position, batch rows kept there in order)."""

    def release(self, seq_id: int) -> None:
        """seq_id finished or was preempted: drop what the runner keeps across its steps (this
        step's proposal counts stay until the next propose, for the step's statistics)."""

    def context_pending(self) -> bool:
        """Whether committed positions still wait to enter the drafter's context cache."""
        return False
