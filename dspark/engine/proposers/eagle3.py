"""EAGLE-3 drafting (``--drafter`` a folder in the EAGLE-3 layout): autoregressive steps of a
one-layer head over the target's fused low/mid/high features: chains, or sibling trees (the
greedy chain plus the next likeliest tokens at each depth, chain_walk.SiblingTree).

Committed positions enter the head's paged K/V at commit, from the target's features and the
token after each position (one layer: no attention needed for them), deferred while drafting
pauses as for DSpark's context. A step then starts from the last committed position's features
and the anchor, and each further step feeds the head's own output and the token it drafted.
"""

from __future__ import annotations

import torch

from dspark.config import SpecConfig
from dspark.engine.attention import make_backend
from dspark.engine.drafter_context import DrafterContext
from dspark.engine.kv_cache import KVCache
from dspark.engine.proposal import Draft, Proposer, TargetView
from dspark.engine.proposers.chain_walk import open_walk
from dspark.engine.sequence import Sequence
from dspark.models.drafters.checkpoint import read_drafter_folder
from dspark.models.drafters.eagle3 import load_eagle3

DEFAULT_DRAFTS = 5


class Eagle3Proposer(Proposer):
    """Chains from an EAGLE-3 head; q is its warped distribution mapped to the target vocabulary,
    confidences its probabilities of the drafted tokens."""

    name = "eagle3"
    trees = True

    def __init__(self, cfg: SpecConfig, target: TargetView, path: str):
        self.cfg, self.target = cfg, target
        raw, sd = read_drafter_folder(path)
        self.head = load_eagle3(raw, sd, target.model, target.dtype, target.device, path).requires_grad_(False)
        c = self.head.config.layer
        self.capture_layers = self.head.config.capture_layers
        self.num_drafts = cfg.block_size or DEFAULT_DRAFTS
        self.kv = KVCache(1, target.kv_pages, target.pool.page_size, c.num_key_value_heads, c.head_dim,
                          target.dtype, target.device)
        self.attn = make_backend(target.attention_backend, target.device, exact=False)
        self.context = DrafterContext(self.head, self.kv, target.pool, target.device, next_ids=True)
        self.to_target = self.head.draft_to_target
        # seq_id -> (position, target features there) of its last committed position
        self.last: dict[int, tuple[int, torch.Tensor]] = {}

    def commit(self, ctx_rows, feats: torch.Tensor | None, flush: bool, prompts_now: bool = False) -> None:
        with torch.inference_mode():
            self.context.add(ctx_rows, feats, flush=flush, prompts_now=prompts_now)
            live = [(seq, start + len(kept) - 1, kept[-1]) for seq, start, kept in ctx_rows
                    if kept and not seq.is_finished]
            if live:
                rows = feats[torch.tensor([r for _, _, r in live], device=feats.device)]
                for (seq, pos, _), f in zip(live, rows):
                    self.last[seq.seq_id] = (pos, f)

    def release(self, seq_id: int) -> None:
        self.last.pop(seq_id, None)
        self.context.release(seq_id)

    def catch_up_seconds(self) -> float:
        return self.context.catch_up_seconds()

    def draft(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        dev = self.target.device
        walk, budgets = open_walk(self.cfg, seqs, budgets, self.target.model.config.vocab_size, self.to_target, dev)
        with torch.inference_mode():
            self.context.flush()  # a pause that ended early leaves its context writes queued
            starts = []
            for s in seqs:
                pos, _ = self.last.get(s.seq_id, (None, None))
                if pos != s.num_cached - 1:
                    raise RuntimeError(f"EAGLE-3 head has no features for request {s.request_id}'s last position")
                starts.append(pos)
            hidden = self.head.fc(torch.stack([self.last[s.seq_id][1] for s in seqs]))
            ids = torch.tensor([s.output_ids[-1] for s in seqs], device=dev)
            logits = None
            try:
                for j in range(max(budgets)):
                    # a request only writes the slots its budget reserved: past it, its rows
                    # repeat their last logits and the controller cuts those drafts
                    rows = [r for r, b in enumerate(budgets) if b > j]
                    at = torch.tensor(rows, device=dev)
                    batch, _, pos = self.target.layout([(seqs[r], [0]) for r in rows], "causal",
                                                       starts=[starts[r] + j for r in rows])
                    self.attn.plan(batch)
                    out = self.head.step(ids[at], hidden[at], pos, self.attn, self.kv)
                    new = self.head.logits(out)
                    if walk.samples_in_target_vocab:
                        new = walk.to_target_logits(new)
                    logits = new if logits is None else logits.index_copy(0, at, new)
                    hidden = hidden.index_copy(0, at, out)
                    ids = walk.pick(logits)
            except BaseException:
                walk.abandon()
                raise
        return walk.finish(budgets)
