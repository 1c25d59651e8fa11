"""Draft trees: building them from one drafter pass, their attention masks, and lossless
acceptance of the longest path.

Nodes are numbered in breadth-first order with the anchor as node 0, so a node's
index is never smaller than its depth; that is what lets the accepted path's K/V be
compacted into place with one gather.

Sampling stays exact with deterministic children: each child is tried as a one-hot
proposal, accepted with the residual target probability of its token; a rejected
token's mass is removed and the rest renormalized before the next sibling (recursive
rejection sampling with point-mass drafts). With no child accepted the token comes from
the residual; at a leaf the bonus comes from the target's distribution there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dspark.engine.sampling import sample


@dataclass
class DraftTree:
    """One request's tree, excluding the anchor: tokens, parents (0 = anchor), depths (1 = child of
    anchor) and, for drafted trees, each node's joint draft probability (its path's)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def mask(self) -> torch.Tensor:
        """[n+1, n+1] bool: row i sees column j when j is i itself or one of its ancestors."""
        n = len(self.tokens) + 1
        m = torch.eye(n, dtype=torch.bool)
        m[:, 0] = True
        for i, par in enumerate(self.parents, start=1):
            m[i] |= m[par]
        return m

    def ranked(self) -> list[int]:
        """Node indices (0-based) by descending score, shallower first on ties: every prefix of
        this order is a subtree, since a child is never likelier than its parent."""
        if self.scores is None:
            raise ValueError("this tree has no node scores to rank by")
        return sorted(range(len(self)), key=lambda i: (-self.scores[i], self.depths[i]))

    def top(self, n: int) -> DraftTree:
        """The subtree of the n best-scored nodes, renumbered breadth-first."""
        keep = sorted(self.ranked()[:n], key=lambda i: (self.depths[i], -self.scores[i]))
        index = {old + 1: new + 1 for new, old in enumerate(keep)}
        parents = [self.parents[i] for i in keep]  # KeyError if a parent was not kept: not a subtree
        return DraftTree(tokens=[self.tokens[i] for i in keep], parents=[index[p] if p else 0 for p in parents],
                         depths=[self.depths[i] for i in keep], scores=[self.scores[i] for i in keep])


def build_trees(base: torch.Tensor, anchors: torch.Tensor, markov, budget: list[int], max_depth: list[int],
                topk: int, width: int | None = None, vocab: torch.Tensor | None = None,
                constraint=None) -> list[DraftTree]:  # noqa: ANN001 - a structured.TreeConstraint
    """Best nodes by joint draft probability, layer by layer through the Markov head.

    base: [R, D, V] draft logits per depth; markov(prev target tokens) -> [.., V] bias or None.
    vocab: the target token id of each of base's V columns (a reduced draft vocabulary; None:
    the columns are target ids). Walking the draft vocabulary gives the same trees as walking
    the target's with -inf outside it, at a fraction of the softmax and top-k work.
    Keeps `width` nodes per layer, then the budget[r] nodes with the highest joint
    probability overall (ancestor-closed, since a child is never likelier than its parent),
    no deeper than max_depth[r]. constraint (structured outputs) masks each node's children to
    what its request's grammar admits after the node's path; nodes it leaves at probability 0
    are dropped.
    """
    R, D, V = base.shape
    width = width or max(budget)
    dev = base.device
    layer_tok = anchors[:, None]  # [R, W]
    layer_lp = torch.zeros(R, 1, device=dev)
    layer_id = torch.full((R, 1), -1, device=dev, dtype=torch.long)  # node ids of the current layer
    all_tok, all_par, all_lp, all_depth = [], [], [], []
    count = 0
    paths: list[list[list[int]]] = [[[]] for _ in range(R)]  # each node's drafts from the anchor
    for d in range(D):
        logits = base[:, d][:, None, :].expand(R, layer_tok.shape[1], V)
        if markov is not None:
            logits = logits + markov(layer_tok).float()
        dead = None
        if constraint is not None:
            logits, dead = constraint.mask_layer(logits, paths, torch.isfinite(layer_lp).tolist())
        lp = torch.log_softmax(logits, -1)
        if dead is not None:
            lp = lp.masked_fill(dead[..., None], float("-inf"))
        top_lp, top_tok = lp.topk(min(topk, V), -1)  # [R, W, k]
        if vocab is not None:
            top_tok = vocab[top_tok]
        joint = (layer_lp[..., None] + top_lp).flatten(1)
        keep = joint.topk(min(width, joint.shape[1]), -1)
        parent_slot = keep.indices // top_tok.shape[-1]
        tok = top_tok.flatten(1).gather(1, keep.indices)
        all_tok.append(tok)
        all_par.append(layer_id.gather(1, parent_slot))
        all_lp.append(keep.values)
        all_depth.append(d + 1)
        ids = torch.arange(count, count + tok.shape[1], device=dev)[None].expand(R, -1)
        count += tok.shape[1]
        if constraint is not None:
            slots, toks_now = parent_slot.tolist(), tok.tolist()
            paths = [[paths[r][p] + [t] for p, t in zip(slots[r], toks_now[r])] for r in range(R)]
        layer_tok, layer_lp, layer_id = tok, keep.values, ids
    toks = torch.cat(all_tok, 1).tolist()
    pars = torch.cat(all_par, 1).tolist()
    lps = torch.cat(all_lp, 1).tolist()
    depths = [d for d, t in zip(all_depth, all_tok) for _ in range(t.shape[1])]
    trees = []
    for r in range(R):
        # breadth-first, parents first; a child of a dropped node is dropped too (its joint is -inf)
        ok = [i for i in range(count) if depths[i] <= max_depth[r] and lps[r][i] > float("-inf")]
        index = {old: new + 1 for new, old in enumerate(ok)}
        full = DraftTree(tokens=[toks[r][i] for i in ok],
                         parents=[index[pars[r][i]] if pars[r][i] >= 0 else 0 for i in ok],
                         depths=[depths[i] for i in ok], scores=[math.exp(lps[r][i]) for i in ok])
        trees.append(full.top(budget[r]))
    return trees


def accept_trees(p: torch.Tensor, trees: list[DraftTree], u: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """Walk every tree from the anchor, vectorized over requests.

    p: [R, N+1, V] target probabilities at each node (row 0 = anchor); u: [R, D*K + 1] uniforms.
    Returns the accepted node path per request (excluding the anchor) and the next token [R].
    """
    R, N1, V = p.shape
    dev = p.device
    K = max((max((sum(1 for q in t.parents if q == i) for i in range(len(t) + 1)), default=0) for t in trees),
            default=0)
    D = max((max(t.depths, default=0) for t in trees), default=0)
    children = torch.full((R, N1, max(K, 1)), -1, dtype=torch.long)
    tokens = torch.zeros(R, N1, dtype=torch.long)
    for r, t in enumerate(trees):
        fill = [0] * (len(t) + 1)
        for i, (tok, par) in enumerate(zip(t.tokens, t.parents), start=1):
            children[r, par, fill[par]] = i
            fill[par] += 1
            tokens[r, i] = tok
    children, tokens = children.to(dev), tokens.to(dev)
    rows = torch.arange(R, device=dev)
    cur = torch.zeros(R, dtype=torch.long, device=dev)
    alive = torch.ones(R, dtype=torch.bool, device=dev)
    probs = p[:, 0].clone()
    paths: list[list[int]] = [[] for _ in range(R)]
    for d in range(D):
        moved = torch.zeros(R, dtype=torch.bool, device=dev)
        for j in range(K):
            c = children[rows, cur, j]
            valid = alive & ~moved & (c >= 0)
            if not bool(valid.any()):
                break
            tok = tokens[rows, c.clamp(min=0)]
            pt = probs.gather(1, tok[:, None]).squeeze(1)
            acc = valid & (u[:, d * K + j] < pt)
            rej = valid & ~acc
            if bool(rej.any()):
                resid = probs.scatter(1, tok[:, None], 0.0)
                total = resid.sum(-1, keepdim=True)
                resid = torch.where(total > 0, resid / total.clamp(min=1e-30), probs)
                probs = torch.where(rej[:, None], resid, probs)
            cur = torch.where(acc, c, cur)
            moved |= acc
        if not bool(moved.any()):
            break
        probs = torch.where(moved[:, None], p[rows, cur], probs)
        alive &= moved
        for r in moved.nonzero().flatten().tolist():
            paths[r].append(int(cur[r]))
    return paths, sample(probs, u[:, -1])
