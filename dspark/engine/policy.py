"""Verification-length policies: how many of each request's draft tokens the target checks.

fixed       every draft token the budget allows.
threshold   DSpark's reference rule: cut at the first token whose confidence is below t.
load-aware  DSpark's confidence-scheduled verification (paper Algorithm 1): admit
            (request, position) candidates in descending survival a_rj = prod_{i<=j} c_ri
            while the expected throughput tau(B) * SPS(B) improves, stopping at the first
            non-improvement. SPS(B), target steps per second with B tokens in the pass, is
            profiled once per machine; the drafter pass's own measured time is added to
            every candidate's step time, so a slow drafter buys fewer tokens. Lengths depend
            only on draft-time information, so the output distribution stays the target's.
            `last_gain` says how the best choice compares with not drafting at all, which
            the spec runner uses to stop drafting while speculation cannot pay.
            Trees go through the same admission: their nodes are candidates, in descending
            joint draft probability (an order in which a parent comes before its children).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


@dataclass
class CostModel:
    """Seconds per target pass as a function of tokens in the pass (piecewise linear)."""

    tokens: list[int]
    seconds: list[float]

    def __call__(self, n: int) -> float:
        xs, ys = self.tokens, self.seconds
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            return ys[-1] * n / xs[-1]
        i = bisect.bisect_left(xs, n)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


class Policy:
    """Base policy: verify every budgeted draft token."""

    name = "fixed"

    def choose(self, budgets: list[int], conf: torch.Tensor | None, other_tokens: int = 0,
               draft_seconds: float = 0.0) -> list[int]:
        """Draft tokens to verify per request; other_tokens (prefill) ride in the same pass."""
        return list(budgets)

    def choose_nodes(self, survival: list[list[float]], other_tokens: int = 0,
                     draft_seconds: float = 0.0) -> list[int]:
        """How many nodes of each request's tree to verify. survival[r] holds tree r's node
        survival estimates in descending order, parents before children; the answer keeps a
        prefix of it. Fixed and threshold verify the whole tree."""
        return [len(row) for row in survival]


class ThresholdPolicy(Policy):
    """Cut each block at the first confidence below the threshold (at least one token)."""

    name = "threshold"

    def __init__(self, threshold: float):
        self.threshold = threshold

    def choose(self, budgets, conf, other_tokens=0, draft_seconds=0.0):
        if conf is None:
            return list(budgets)
        out = []
        for b, c in zip(budgets, conf.tolist()):
            k = next((j for j, cj in enumerate(c[:b]) if cj < self.threshold), b)
            out.append(min(b, max(1, k)))
        return out


class LoadAwarePolicy(Policy):
    """Greedy admission by survival while tau(B) * SPS(B) improves (non-anticipating stop)."""

    name = "load-aware"

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.last_gain: float | None = None  # best throughput over plain decoding's, last call

    def choose(self, budgets, conf, other_tokens=0, draft_seconds=0.0):
        self.last_gain = None
        if conf is None or not budgets:
            return list(budgets)
        survival = conf.float().cumprod(-1).tolist()
        return self._admit([row[:b] for row, b in zip(survival, budgets)], other_tokens, draft_seconds)

    def choose_nodes(self, survival, other_tokens=0, draft_seconds=0.0):
        self.last_gain = None
        return self._admit(survival, other_tokens, draft_seconds) if survival else []

    def _admit(self, survival: list[list[float]], other_tokens: int, draft_seconds: float) -> list[int]:
        """Prefix lengths per request: candidates (r, j) in descending survival[r][j] while
        tau(B) / (SPS(B) time + drafter time) improves."""
        R = len(survival)
        cands = sorted(((a, r, j) for r, row in enumerate(survival) for j, a in enumerate(row)),
                       key=lambda t: (-t[0], t[2]))
        lengths = [0] * R
        tokens = R + other_tokens  # every request verifies its anchor; prefill rides along
        tau = float(R)
        plain = tau / self.cost(tokens)  # no drafter pass at all
        best = tau / (self.cost(tokens) + draft_seconds)
        for a, r, j in cands:
            if j != lengths[r]:  # a prefix must be admitted in order
                continue
            theta = (tau + a) / (self.cost(tokens + 1) + draft_seconds)
            if theta <= best:
                break
            lengths[r], tau, tokens, best = j + 1, tau + a, tokens + 1, theta
        self.last_gain = best / plain
        return lengths


def make_policy(name: str, threshold: float, cost: CostModel | None) -> Policy:
    if name == "fixed":
        return Policy()
    if name == "threshold":
        return ThresholdPolicy(threshold)
    if name == "load-aware":
        if cost is None:
            raise ValueError("the load-aware policy needs a cost profile")
        return LoadAwarePolicy(cost)
    raise ValueError(f"unknown spec policy {name!r}: choose fixed, threshold or load-aware")
