"""DSpark / DFlash block drafting: one drafter pass per step over [anchor, MASK...] for every
drafting request, a walk of the Markov head over the block (chains) or a top-k expansion (trees),
and the drafter's incremental context cache."""

from __future__ import annotations

import torch

from dspark.config import SpecConfig
from dspark.engine.attention import make_backend
from dspark.engine.drafter_context import DrafterContext
from dspark.engine.kv_cache import KVCache
from dspark.engine.proposal import Draft, Proposer, TargetView
from dspark.engine.proposers.chain_walk import ChainWalk
from dspark.engine.sequence import Sequence
from dspark.engine.structured import TreeConstraint
from dspark.engine.tree import build_trees
from dspark.models.drafters.checkpoint import load_drafter
from dspark.models.packed import pack_linears
from dspark.models.quant import cpu_packable, draft_linear


class BlockProposer(Proposer):
    """Drives a BlockDrafter over the shared page pool with its own K/V tensors."""

    trees = True

    def __init__(self, cfg: SpecConfig, target: TargetView, path: str):
        self.cfg, self.target = cfg, target
        # frozen: the engine never trains it, and frozen heads keep float32 copies (MarkovHead)
        self.drafter = load_drafter(path, target.model, target.dtype, target.device).requires_grad_(False)
        # the backbone's projections; the heads' weights are read directly
        self.drafter.pack_context_kv(draft_linear)
        self.drafter.use_kernel_norms()
        pack_linears(self.drafter.layers, make=draft_linear, takes=cpu_packable)
        pack_linears(self.drafter, only=("fc",), make=draft_linear, takes=cpu_packable)
        dc = self.drafter.config
        self.name = dc.kind
        if cfg.block_size is not None and cfg.block_size > dc.num_drafts:
            raise ValueError(f"block size {cfg.block_size} exceeds the {dc.num_drafts} tokens this drafter emits")
        self.num_drafts = cfg.block_size or dc.num_drafts
        self.forward_tokens = dc.block_size  # the block pass writes this many cache slots
        self.capture_layers = tuple(dc.target_layer_ids)
        self.kv = KVCache(dc.num_hidden_layers, target.kv_pages, target.pool.page_size, dc.num_key_value_heads,
                          dc.head_dim, target.dtype, target.device)
        # drafts need no bit-equality with anything, so the drafter attends in the faster dtypes
        self.attn = make_backend(target.attention_backend, target.device, exact=False)
        self.context = DrafterContext(self.drafter, self.kv, target.pool, target.device)
        self.block_forward = self._block_forward

    def context_headroom(self) -> int:
        return self.drafter.config.block_size

    def draft(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        with torch.inference_mode():
            self.context.flush()  # a pause that ended early leaves its context writes queued
            h = self._block_pass(seqs, self._block_length(budgets))
            if self.cfg.tree:
                return self._draft_trees(seqs, budgets, h)
            return self._draft_chains(seqs, h)

    def _block_length(self, budgets: list[int]) -> int:
        """Positions the block pass runs: where it runs eagerly, only as many as the longest budget
        needs (a tree: no deeper than its node budget), since every position costs a row of each
        drafter layer, of the draft head and of the walk; under CUDA graphs the whole block (the
        size they were captured at). The block attends within itself, so fewer mask positions
        change its hidden states, and so the drafts, a little: never what verification accepts."""
        dc = self.drafter.config
        if self.graphs is not None:
            return dc.block_size
        return max(1, min(dc.block_size, self._deepest(budgets) + dc.block_size - dc.num_drafts))

    def _deepest(self, budgets: list[int]) -> int:
        """The deepest draft slot this step can use: the longest budget, and a tree of N nodes is
        at most N deep."""
        return min(max(budgets), self.cfg.tree_budget) if self.cfg.tree else max(budgets)

    def _block_pass(self, active: list[Sequence], B: int) -> torch.Tensor:
        """The drafter's forward over [anchor, MASK x (B-1)] per request -> [R, drafts, H] draft slots."""
        dc = self.drafter.config
        R = len(active)
        items = [(s, [s.output_ids[-1]] + [dc.mask_token_id] * (B - 1)) for s in active]
        batch, ids, pos = self.target.layout(items, mask="full")
        out = self.graphs.run(batch, ids) if self.graphs is not None else None
        if out is None:
            self.attn.plan(batch)
            out = self._block_forward(ids, pos, self.attn)
        return self.drafter.draft_hidden(out[0].view(R, B, -1))

    def _block_forward(self, ids: torch.Tensor, pos: torch.Tensor, attn) -> tuple[torch.Tensor]:
        """The drafter's block forward -> (final hidden,): run eagerly, or captured by a GraphPool."""
        return (self.drafter.block_hidden(ids, pos, attn, self.kv),)

    def _draft_chains(self, active: list[Sequence], h: torch.Tensor) -> list[Draft]:
        """Walk the Markov head over the draft slots h [R, drafts, H]: each slot's logits given
        the token drafted before it; confidences from the confidence head."""
        dev, steps = self.target.device, h.shape[1]
        walk = ChainWalk(active, steps, self.target.model.config.vocab_size, self.drafter.draft_to_target,
                         dev, draft_confidence=False)
        # greedy walks the (reduced) draft vocabulary; sampled drafts need q over the target's
        base = self.drafter.head(h) if walk.samples_in_target_vocab else self.drafter.draft_logits(h)
        prev = torch.tensor([s.output_ids[-1] for s in active], device=dev)
        mh, fused = self.drafter.markov_head, None
        if mh is not None and walk.greedy and walk.constraint is None:
            fused = mh.greedy_walk(base, prev, self.drafter.draft_to_target)
        if fused is not None:
            walk.take(fused)
            prevs = torch.cat([prev[:, None], fused[:, :-1]], 1)
        else:
            prevs = []
            try:
                for k in range(steps):
                    prevs.append(prev)
                    prev = walk.pick(self.drafter.step_logits(base[:, k], prev))
            except BaseException:
                walk.abandon()  # the matchers go back to their requests' committed state
                raise
            prevs = torch.stack(prevs, 1)
        conf = self.drafter.confidence(h, prevs)
        return walk.drafts(torch.sigmoid(conf).float().cpu() if conf is not None else None, steps)

    def _draft_trees(self, active: list[Sequence], budgets: list[int], h: torch.Tensor) -> list[Draft]:
        """Each request's draft tree, at most its draft budget deep, under its grammar if any:
        top-k children per node through the Markov head, pruned to the node budget. Children are
        tried as one-hot proposals, so no q is kept."""
        base = self.drafter.draft_logits(h)
        anchors = torch.tensor([s.output_ids[-1] for s in active], device=base.device)
        grammars = [s.grammar for s in active]
        to_target = self.drafter.draft_to_target
        constraint = TreeConstraint(grammars, self.target.model.config.vocab_size, to_target) \
            if any(g is not None for g in grammars) else None
        mh = self.drafter.markov_head
        trees = build_trees(base[:, :self._deepest(budgets)], anchors, mh.bias if mh is not None else None,
                            [self.cfg.tree_budget] * len(active), budgets, self.cfg.tree_topk,
                            vocab=to_target, constraint=constraint)
        return [Draft([], tree=t, num_proposed=self.cfg.tree_budget) for t in trees]

    def commit(self, ctx_rows, feats: torch.Tensor | None, flush: bool, prompts_now: bool = False) -> None:
        with torch.inference_mode():
            self.context.add(ctx_rows, feats, flush=flush, prompts_now=prompts_now)

    def release(self, seq_id: int) -> None:
        self.context.release(seq_id)

    def catch_up_seconds(self) -> float:
        return self.context.catch_up_seconds()
