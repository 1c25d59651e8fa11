"""The speculation seam: what a proposer gets, what it returns, and what verification reads.

A proposer (the DSpark block drafter, an EAGLE-3 head, a draft model, prompt lookup) sees the
decoding requests' committed state and a draft budget per request and returns a ``Draft`` for
each: a chain or a tree, its draft distributions q where sampling needs them, and how likely
each token is to survive. The verify-length controller (controller.py) cuts drafts into
``Proposal``s; verification (verify.py) reads only those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark.engine.sequence import Sequence
from dspark.engine.tree import DraftTree


@dataclass
class Draft:
    """What a proposer drafted for one request, before the controller decides how much to verify.

    tokens: the chain after the anchor (empty for a tree). confidence: [len(tokens)] chance that
    each token survives given the ones before it (None: unknown; the controller falls back on the
    running acceptance per position). q: [len(tokens), V] draft distributions in float32 (None:
    deterministic, one-hot). tree: a drafted tree with node scores (joint draft probabilities).
    stop: the first position a grammar forbids (None: none). num_proposed: tokens drafted, for
    the statistics (a block counts in full even where the policy verifies fewer)."""

    tokens: list[int]
    confidence: torch.Tensor | None = None
    q: torch.Tensor | None = None
    tree: DraftTree | None = None
    stop: int | None = None
    num_proposed: int | None = None
    looked_up: bool = False

    def __post_init__(self) -> None:
        if self.num_proposed is None:
            self.num_proposed = len(self.tree) if self.tree is not None else len(self.tokens)

    def cut(self, n: int) -> Proposal:
        """The first n tokens (fewer where a grammar stops them) as a Proposal."""
        if self.tree is not None:
            tree = self.tree if n and n == len(self.tree) else (self.tree.top(n) if n else None)
            return Proposal([], tree, None, self.num_proposed, self.looked_up)
        n = n if self.stop is None else min(n, self.stop)
        q = self.q[:n] if self.q is not None and n else None
        return Proposal(self.tokens[:n], None, q, self.num_proposed, self.looked_up)


@dataclass
class Proposal:
    """The tokens one request verifies this step after its anchor: a chain (tokens, with q rows
    for sampled drafts; None: one-hot) or a tree (tree; its children are tried as one-hot
    proposals). num_proposed and looked_up feed the request's speculation statistics."""

    tokens: list[int]
    tree: DraftTree | None = None
    q: torch.Tensor | None = None
    num_proposed: int = 0
    looked_up: bool = False


@dataclass
class TargetView:
    """What a proposer may use of the target: its model (embedding, LM head, config), the page
    pool whose tables the proposer's own caches share, and how to lay out a batch on it."""

    model: torch.nn.Module
    pool: object  # kv_cache.PagePool
    kv_pages: int  # pages of every K/V tensor over the pool (its own plus CUDA-graph scratch)
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    layout: Callable  # ModelRunner.batch_layout: (items, mask, starts) -> (AttnBatch, ids, positions)
    tokenizer: object = None  # the target's (a draft model must share it)
    quantization: str = "auto"  # --quantization, for proposers that load a model of their own


class Proposer:
    """Base proposer: drafts nothing. Subclasses implement ``draft`` and, where they keep per-request
    state or caches, ``commit`` / ``release``."""

    name = "none"
    num_drafts = 0  # most tokens one draft holds (a block); 0: no drafting
    capture_layers: tuple[int, ...] = ()  # target layers whose outputs commit() needs
    deterministic = False  # drafts are one-hot (prompt lookup): verified whole, no policy
    trees = False  # whether draft() returns trees when SpecConfig.tree asks for them
    graphs = None  # CUDA-graph pool of the drafter's forward (block drafters)
    block_forward = None  # that forward, for cuda_graphs.install_graphs (None: nothing to capture)
    forward_tokens = 0  # tokens per request of block_forward

    def draft(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        """One Draft per request (budgets[i] > 0: the most tokens worth proposing)."""
        raise NotImplementedError

    def commit(self, ctx_rows, feats: torch.Tensor | None, flush: bool, prompts_now: bool = False) -> None:
        """After each target pass: (seq, first new position, batch rows kept there) per request
        and the captured target features of the pass; flush: the next step may draft;
        prompts_now: prompt positions enter the cache now, flush or not."""

    def release(self, seq_id: int) -> None:
        """seq_id finished or was preempted: drop what is kept for it."""

    def catch_up_seconds(self) -> float:
        """Seconds the next pass spends first on context that paused steps deferred (0: none)."""
        return 0.0

    def context_headroom(self) -> int:
        """Cache slots past a request's context one draft pass may write."""
        return 0
