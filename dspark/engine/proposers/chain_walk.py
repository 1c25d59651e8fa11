"""Picking draft tokens one position at a time: chains for every proposer that drafts them (a block
drafter's Markov walk, an EAGLE-3 head's or a draft model's autoregressive steps), and the
sibling trees of the autoregressive proposers."""

from __future__ import annotations

import torch

from dspark.engine.proposal import Draft
from dspark.engine.sampling import position_noise, race_sample, sample, warp_logits
from dspark.engine.sequence import Sequence
from dspark.engine.structured import DraftConstraint
from dspark.engine.tree import DraftTree


class ChainWalk:
    """Draft tokens of a batch of requests, position by position, from each position's logits.

    Greedy batches take the argmax (over a reduced draft vocabulary when ``to_target`` maps it to
    target ids, skipping a scatter to the target's); sampled batches draw from each request's
    warped distribution (with its own generator's uniforms, or a seeded request's positions'
    noise) and keep those distributions as q (lossless acceptance needs them). Requests under a
    grammar draft only what it admits. Each token's draft probability is kept as its confidence
    unless ``draft_confidence`` is False (a proposer with a confidence head has its own). Call
    ``pick`` once per position, then ``drafts``."""

    def __init__(self, seqs: list[Sequence], steps: int, vocab_size: int, to_target: torch.Tensor | None,
                 device: torch.device, draft_confidence: bool = True, draws: list[int] | None = None):
        self.seqs, self.steps, self.vocab_size, self.to_target = seqs, steps, vocab_size, to_target
        self.draft_confidence = draft_confidence
        self.greedy = all(s.params.greedy for s in seqs)
        if not self.greedy:
            self.warp = [torch.tensor([getattr(s.params, f) for s in seqs], device=device)
                         for f in ("temperature", "top_k", "top_p", "min_p")]
            # an unseeded request draws only as many uniforms as it may propose (draws[r]); a
            # seeded one drafts position j with the noise the target samples j with (verify.py),
            # so where draft and target distributions agree, so do their tokens
            u = torch.full((len(seqs), steps), 0.5)
            for r, s in enumerate(seqs):
                n = steps if draws is None else min(steps, draws[r])
                if s.generator is not None and n:
                    u[r, :n] = torch.rand(n, generator=s.generator)
            self.u = u.to(device)
            self.seeded = [r for r, s in enumerate(seqs) if s.seed is not None]
            self.unseeded = [r for r, s in enumerate(seqs) if s.seed is None]
            if self.seeded:  # [steps, seeded rows, noise width]: position j's noise, as verify.py's
                at = [(seqs[r].seed, len(seqs[r].output_ids) + k) for k in range(steps) for r in self.seeded]
                self.noise = position_noise([s for s, _ in at], [j for _, j in at], vocab_size,
                                            device).view(steps, len(self.seeded), -1)
        grammars = [s.grammar for s in seqs]
        self.constraint = DraftConstraint(grammars, vocab_size, to_target if self.greedy else None) \
            if any(g is not None for g in grammars) else None
        self.tokens: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.conf: list[torch.Tensor] = []

    @property
    def samples_in_target_vocab(self) -> bool:
        """Whether pick() wants logits over the target vocabulary (sampling) rather than the draft's."""
        return not self.greedy

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [R, Vd] -> target-vocabulary ones, -inf outside the draft vocabulary."""
        if self.to_target is None:
            return logits
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return out.index_copy(-1, self.to_target, logits)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The next position's tokens (target ids, [R]) from its logits: over the draft vocabulary
        when greedy, over the target's when sampling (see to_target_logits)."""
        k = len(self.tokens)
        logits = logits.float()
        if self.constraint is not None:
            logits = self.constraint.mask(logits, k)
        if self.greedy:
            pick = logits.argmax(-1)
            if self.draft_confidence:
                self.conf.append(torch.softmax(logits, -1).gather(-1, pick[:, None]).squeeze(-1))
            tok = self.to_target[pick] if self.to_target is not None else pick
        else:
            q = warp_logits(logits, *self.warp)
            tok = self._sample(q, k)
            if self.draft_confidence:
                self.conf.append(q.gather(-1, tok[:, None]).squeeze(-1))
            self.probs.append(q)
        self.tokens.append(tok)
        if self.constraint is not None:
            self.constraint.advance(tok, k)
        return tok

    def _sample(self, q: torch.Tensor, k: int) -> torch.Tensor:
        """Position k's tokens from q [R, V]: seeded rows race, the others take their uniforms (each
        sampler only over its own rows: an inverse CDF costs a pass over the vocabulary)."""
        if not self.seeded:
            return sample(q, self.u[:, k])
        if len(self.seeded) == len(self.seqs):
            return race_sample(q, self.noise[k])
        tok = torch.empty(len(self.seqs), dtype=torch.long, device=q.device)
        tok[self.seeded] = race_sample(q[self.seeded], self.noise[k])
        tok[self.unseeded] = sample(q[self.unseeded], self.u[self.unseeded, k])
        return tok

    def take(self, tokens: torch.Tensor) -> None:
        """Every position at once ([R, steps] target ids), picked greedily by a fused walk; only for
        greedy batches without grammars, which keep no draft probabilities."""
        assert self.greedy and self.constraint is None and not self.draft_confidence
        self.tokens = list(tokens.unbind(1))

    def drafts(self, confidence: torch.Tensor | None = None, num_proposed: int | None = None) -> list[Draft]:
        """One Draft per request from the positions picked so far; confidence [R, steps] replaces
        the draft probabilities as survival estimates. Rolls the grammars back."""
        stops = self.constraint.finish() if self.constraint is not None else [None] * len(self.seqs)
        rows = torch.stack(self.tokens, 1).tolist()
        if confidence is None and self.conf:
            confidence = torch.stack(self.conf, 1).float().cpu()
        q = torch.stack(self.probs, 1) if self.probs else None  # [R, steps, V]
        return [Draft(rows[r], None if confidence is None else confidence[r],
                      None if q is None or s.params.greedy else q[r], stop=stops[r], num_proposed=num_proposed)
                for r, s in enumerate(self.seqs)]

    def abandon(self) -> None:
        """Roll the grammars back after a failure mid-walk."""
        if self.constraint is not None:
            self.constraint.finish()

    @property
    def chain(self) -> list[torch.Tensor]:
        """The tokens picked so far, one [R] tensor per position."""
        return self.tokens

    def finish(self, budgets: list[int]) -> list[Draft]:
        """The drafts of an autoregressive walk (each counted as max(budgets) proposed)."""
        return self.drafts(num_proposed=max(budgets))


def open_walk(cfg, seqs: list[Sequence], budgets: list[int], vocab_size: int,  # noqa: ANN001 - a SpecConfig
              to_target: torch.Tensor | None, device: torch.device) -> tuple[ChainWalk | SiblingTree, list[int]]:
    """The walker an autoregressive proposer picks its drafts with (sibling trees under --tree,
    never deeper than the node budget; else chains) and the depth each request walks to."""
    if cfg.tree:
        budgets = [min(b, cfg.tree_budget) for b in budgets]
        return SiblingTree(seqs, vocab_size, to_target, cfg.tree_topk, cfg.tree_budget), budgets
    return ChainWalk(seqs, max(budgets), vocab_size, to_target, device, draws=budgets), budgets


class SiblingTree:
    """Draft trees for autoregressive proposers: the greedy chain, and at every depth the next
    ``topk - 1`` likeliest tokens as siblings of the chain's token (children of the same chain
    node). One proposer step per depth, as for a chain; the siblings cost no extra pass, and where
    the chain's token is rejected a sibling may still be accepted. Nodes are scored by joint draft
    probability and pruned to ``budget``; under a grammar, siblings come from the same masked
    logits as the chain token, so every node is admissible. Children are tried as one-hot
    proposals (tree acceptance), so sampled requests need no q."""

    def __init__(self, seqs: list[Sequence], vocab_size: int, to_target: torch.Tensor | None, topk: int,
                 budget: int):
        self.seqs, self.to_target, self.topk, self.budget = seqs, to_target, topk, budget
        grammars = [s.grammar for s in seqs]
        self.constraint = DraftConstraint(grammars, vocab_size, to_target) \
            if any(g is not None for g in grammars) else None
        self.top_tok: list[torch.Tensor] = []  # per depth [R, k] target ids, the chain's first
        self.top_p: list[torch.Tensor] = []  # per depth [R, k] draft probabilities

    samples_in_target_vocab = False

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The chain's next tokens (target ids) from logits over the draft vocabulary."""
        k = len(self.top_tok)
        logits = logits.float()
        if self.constraint is not None:
            logits = self.constraint.mask(logits, k)
        p, idx = torch.softmax(logits, -1).topk(min(self.topk, logits.shape[-1]), -1)
        tok = self.to_target[idx] if self.to_target is not None else idx
        self.top_tok.append(tok)
        self.top_p.append(p)
        if self.constraint is not None:
            self.constraint.advance(tok[:, 0], k)
        return tok[:, 0]

    def drafts(self, depths: list[int]) -> list[Draft]:
        """One tree Draft per request, at most depths[r] deep. Rolls the grammars back."""
        stops = self.constraint.finish() if self.constraint is not None else [None] * len(self.seqs)
        toks = torch.stack(self.top_tok, 1).tolist()  # [R, D, k]
        probs = torch.stack(self.top_p, 1).float().cpu().tolist()
        out = []
        for r in range(len(self.seqs)):
            depth = min(depths[r], len(toks[r]) if stops[r] is None else stops[r])
            tokens, parents, levels, scores = [], [], [], []
            chain, joint = 0, 1.0  # the chain's node at the depth above (0: the anchor) and its score
            for d in range(depth):
                first = len(tokens) + 1
                for j, (t, p) in enumerate(zip(toks[r][d], probs[r][d])):
                    if p <= 0:  # masked by the grammar, or beyond a tiny vocabulary
                        continue
                    tokens.append(t)
                    parents.append(chain)
                    levels.append(d + 1)
                    scores.append(joint * p)
                    if j == 0:
                        first = len(tokens)
                if first > len(tokens):  # nothing admissible at this depth
                    break
                chain, joint = first, scores[first - 1]
            tree = DraftTree(tokens, parents, levels, scores)
            out.append(Draft([], tree=tree.top(min(self.budget, len(tree))), num_proposed=self.budget))
        return out

    def abandon(self) -> None:
        if self.constraint is not None:
            self.constraint.finish()

    @property
    def chain(self) -> list[torch.Tensor]:
        """The chain's tokens so far (the likeliest at each depth), one [R] tensor per depth."""
        return [t[:, 0] for t in self.top_tok]

    def finish(self, budgets: list[int]) -> list[Draft]:
        return self.drafts(budgets)
