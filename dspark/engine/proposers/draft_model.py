"""A small autoregressive draft model of the target's family (``--draft-model PATH``), as
llama.cpp's ``-md`` and vLLM's draft-target speculation.

The draft model keeps its own K/V tensors over the target's page tables (a position's slot is
the same in both). Each step it first feeds the committed tokens it has not cached yet (the
prompt, the accepted drafts it never saw, the anchor) in one pass, whose last row gives the
first draft, then one token per pass for the rest of the chain. The K/V of drafts the target
rejects stay in slots past the committed context, which the next step overwrites, so rejection
needs no rollback of its own. With ``--tree`` the chain's siblings at each depth join it as a
tree (chain_walk.SiblingTree).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from dspark.config import SpecConfig
from dspark.engine.attention import make_backend
from dspark.engine.kv_cache import KVCache
from dspark.engine.proposal import Draft, Proposer, TargetView
from dspark.engine.proposers.chain_walk import ChainWalk, open_walk
from dspark.engine.sequence import Sequence
from dspark.models.loader import load_model, load_tokenizer

DEFAULT_DRAFTS = 4


def check_same_tokenizer(draft_tok, target_tok, draft_vocab: int, target_vocab: int) -> None:  # noqa: ANN001
    """Refuse a draft model whose token ids mean other text than the target's."""
    if draft_vocab != target_vocab:
        raise ValueError(f"draft model vocabulary ({draft_vocab} tokens) differs from the target's ({target_vocab})")
    if target_tok is not None and draft_tok.get_vocab() != target_tok.get_vocab():
        raise ValueError("draft model tokenizer differs from the target's: the same ids would mean other text")


class DraftModelProposer(Proposer):
    """k autoregressive steps of a small causal LM per drafting request; q is its (warped)
    sampling distribution, confidences its probabilities of the drafted tokens."""

    name = "draft-model"
    trees = True

    def __init__(self, cfg: SpecConfig, target: TargetView, path: str):
        self.cfg, self.target = cfg, target
        self.model, folder = load_model(path, target.device, target.dtype, target.quantization)
        mc = self.model.config
        check_same_tokenizer(load_tokenizer(folder), target.tokenizer, mc.vocab_size,
                             target.model.config.vocab_size)
        self.num_drafts = cfg.block_size or DEFAULT_DRAFTS
        self.kv = KVCache(mc.num_hidden_layers, target.kv_pages, target.pool.page_size, mc.num_key_value_heads,
                          mc.head_dim, target.dtype, target.device)
        self.attn = make_backend(target.attention_backend, target.device, exact=False)
        # seq_id -> (first position the last chain was fed at, the tokens fed there)
        self.fed: dict[int, tuple[int, list[int]]] = {}

    def _cached(self, seq: Sequence) -> int:
        """Positions of seq whose draft K/V hold its committed tokens."""
        start, toks = self.fed.get(seq.seq_id, (0, []))
        ids = seq.all_ids
        same = 0
        while same < len(toks) and start + same < len(ids) - 1 and ids[start + same] == toks[same]:
            same += 1
        return start + same

    def _run(self, seqs: list[Sequence], tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Feed tokens[i] at positions starts[i]..; logits of each request's last row."""
        batch, ids, pos = self.target.layout(list(zip(seqs, tokens)), "causal", starts=starts)
        self.attn.plan(batch)
        hidden, _ = self.model(ids, pos, self.attn, self.kv)
        last = torch.tensor(list(itertools.accumulate(len(t) for t in tokens)), device=hidden.device) - 1
        return self.model.logits(hidden[last])

    def draft(self, seqs: list[Sequence], budgets: list[int]) -> list[Draft]:
        walk, budgets = open_walk(self.cfg, seqs, budgets, self.target.model.config.vocab_size, None,
                                  self.target.device)
        # chains stop growing where their survival estimate falls below draft_p_min: a draft the
        # policy would not verify is not worth a pass of the draft model (trees walk their depth)
        floor = self.cfg.draft_p_min if isinstance(walk, ChainWalk) else 0.0
        depths = list(budgets)
        with torch.inference_mode():
            starts = [self._cached(s) for s in seqs]
            # committed tokens not cached yet, through the anchor (all_ids ends with it)
            tokens = [s.all_ids[at:] for s, at in zip(seqs, starts)]
            try:
                logits = self._run(seqs, tokens, starts)
                prev = walk.pick(logits)
                survival = walk.conf[-1].cpu() if floor and walk.conf else None
                for j in range(1, max(budgets)):
                    if survival is not None:
                        depths = [j if d > j and a < floor else d for d, a in zip(depths, survival.tolist())]
                    # a request only writes the slots its depth reserved: past it, its rows
                    # repeat their last logits and are cut from its draft below
                    rows = [r for r, d in enumerate(depths) if d > j]
                    if not rows:
                        break
                    new = self._run([seqs[r] for r in rows], [[int(prev[r])] for r in rows],
                                    [len(seqs[r].all_ids) - 1 + j for r in rows])
                    logits = logits.index_copy(0, torch.tensor(rows, device=logits.device), new)
                    prev = walk.pick(logits)
                    if survival is not None:
                        survival = survival * walk.conf[-1].cpu()
            except BaseException:
                walk.abandon()
                raise
        for s, row, d in zip(seqs, torch.stack(walk.chain, 1).tolist(), depths):
            # fed from the anchor's position on: the anchor, then the chain before its last token
            self.fed[s.seq_id] = (len(s.all_ids) - 1, [s.all_ids[-1]] + row[:d - 1])
        drafts = walk.finish(depths)
        return [dr if dr.tree is not None or len(dr.tokens) <= d else _shorten(dr, d) for dr, d in zip(drafts, depths)]

    def release(self, seq_id: int) -> None:
        self.fed.pop(seq_id, None)


def _shorten(draft: Draft, n: int) -> Draft:
    """A chain draft's first n tokens (with their confidences and distributions)."""
    return dataclasses.replace(draft, tokens=draft.tokens[:n], num_proposed=n,
                               confidence=None if draft.confidence is None else draft.confidence[:n],
                               q=None if draft.q is None else draft.q[:n])
