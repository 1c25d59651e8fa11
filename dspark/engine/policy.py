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
            Prompt tokens in the same pass add to a draft token's cost, never to an
            accepted token's worth (a decode-only step's share of these requests).
            Trees go through the same admission: their nodes are candidates, in descending
            joint draft probability (an order in which a parent comes before its children).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch


@dataclass
class CostModel:
    """Seconds of a decode step as a function of tokens in its target pass (piecewise linear).

    `seconds` starts as a start-up profile of bare target passes and `observe` moves it towards
    the steps the engine really runs (attention over longer contexts than the profile's,
    acceptance and cache bookkeeping, a machine busier or quieter than at start-up): the two
    entries around n are scaled towards the observed / predicted ratio by their interpolation
    weights, so plain steps teach the cost at n = R and verification steps the slope above it.
    Each entry starts with PRIOR observations' weight and learns at no less than RATE; one step
    pulls towards at most CLAMP x (or 1 / CLAMP) of the prediction.

    Prices come from the table's non-decreasing envelope from above (each entry capped by the
    cheapest at or after it), kept apart from what was learned: a pass with more tokens never
    costs less, and profile noise on a shared machine only ever adds time. The envelope errs
    towards cheap: a token count priced too cheaply gets verified, observed and corrected, while
    one priced too dearly would never be tried again."""

    tokens: list[int]
    seconds: list[float]
    seen: list[float] = field(default_factory=list)  # observations folded into each entry (weighted)
    frozen: bool = False  # observe() learns nothing: a cost model given by hand stays as given
    PRIOR, RATE, CLAMP = 3.0, 0.1, 3.0

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds):
            raise ValueError("a cost profile needs one time per token count, and at least one")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])):
            raise ValueError(f"cost profile token counts must ascend: {self.tokens}")
        if any(not s > 0 for s in self.seconds):
            raise ValueError(f"cost profile times must be positive: {self.seconds}")
        self.seen = list(self.seen) or [self.PRIOR] * len(self.tokens)
        if len(self.seen) != len(self.tokens):
            raise ValueError("a cost profile needs one observation count per token count")
        self.seconds = list(self.seconds)
        self._envelope()

    def _envelope(self) -> None:
        capped, low = [], float("inf")
        for s in reversed(self.seconds):
            low = min(low, s)
            capped.append(low)
        self.priced = capped[::-1]

    def _weights(self, n: int) -> list[tuple[int, float]]:
        """(table index, weight) pairs whose weighted sum of entries is the cost of n tokens."""
        xs = self.tokens
        if n <= xs[0]:
            return [(0, 1.0)]
        if n >= xs[-1]:
            return [(len(xs) - 1, n / xs[-1])]
        i = bisect.bisect_left(xs, n)
        w = (n - xs[i - 1]) / (xs[i] - xs[i - 1])
        return [(i - 1, 1.0 - w), (i, w)]

    def __call__(self, n: int) -> float:
        return sum(self.priced[i] * w for i, w in self._weights(n))

    def observe(self, n: int, seconds: float) -> None:
        """Fold one real step of n target tokens that took `seconds` (drafter pass excluded)."""
        if self.frozen or n < 1 or not seconds > 0:
            return
        ws = self._weights(n)
        pred = sum(self.seconds[i] * w for i, w in ws)
        ratio = min(self.CLAMP, max(1.0 / self.CLAMP, seconds / pred))
        for i, w in ws:
            # a running mean over the first steps near this entry (after the profile's PRIOR),
            # then an EMA; scaled, not shifted, so an entry the data pins down only in a sum with
            # its neighbour keeps the profile's proportions and stays positive
            w = min(1.0, w)  # past the last entry the weight is n / tokens[-1]: learn at full rate
            rate = w * max(self.RATE, 1.0 / (1.0 + self.seen[i]))
            self.seconds[i] *= 1.0 + rate * (ratio - 1.0)
            self.seen[i] += w
        self._envelope()


def cap_total(lengths: list[int], max_total: int | None) -> list[int]:
    """lengths with at most max_total in all (None: as they are), the longest cut first: each cut
    to a common level, the first of those longer than it keeping one more where the total allows."""
    if max_total is None or sum(lengths) <= max(0, max_total):
        return lengths
    total, level = max(0, max_total), 0
    while sum(min(n, level + 1) for n in lengths) <= total:  # stops below the longest (sum > total)
        level += 1
    extra = total - sum(min(n, level) for n in lengths)
    out = []
    for n in lengths:
        keep = n > level and extra > 0
        extra -= keep
        out.append(level + keep if n > level else n)
    return out


class Policy:
    """Base policy: verify every budgeted draft token. max_total (every policy): at most that
    many draft tokens in all, what a step's decode-stall bound leaves beside its prompt chunk
    (BatchPlanner.draft_allowance; None: no limit)."""

    name = "fixed"

    def choose(self, budgets: list[int], conf: torch.Tensor | None, other_tokens: int = 0,
               draft_seconds: float = 0.0, max_total: int | None = None) -> list[int]:
        """Draft tokens to verify per request; other_tokens (prefill) ride in the same pass."""
        return cap_total(list(budgets), max_total)

    def choose_nodes(self, survival: list[list[float]], other_tokens: int = 0,
                     draft_seconds: float = 0.0, max_total: int | None = None) -> list[int]:
        """How many nodes of each request's tree to verify. survival[r] holds tree r's node
        survival estimates in descending order, parents before children; the answer keeps a
        prefix of it. Fixed and threshold verify the whole tree."""
        return cap_total([len(row) for row in survival], max_total)


class ThresholdPolicy(Policy):
    """Cut each block at the first confidence below the threshold (at least one token)."""

    name = "threshold"

    def __init__(self, threshold: float):
        self.threshold = threshold

    def choose(self, budgets, conf, other_tokens=0, draft_seconds=0.0, max_total=None):
        if conf is None:
            return cap_total(list(budgets), max_total)
        out = []
        for b, c in zip(budgets, conf.tolist()):
            k = next((j for j, cj in enumerate(c[:b]) if cj < self.threshold), b)
            out.append(min(b, max(1, k)))
        return cap_total(out, max_total)


class LoadAwarePolicy(Policy):
    """Greedy admission by survival while tau(B) * SPS(B) improves (non-anticipating stop)."""

    name = "load-aware"

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.last_gain: float | None = None  # best throughput over plain decoding's, last call

    def choose(self, budgets, conf, other_tokens=0, draft_seconds=0.0, max_total=None):
        self.last_gain = None
        if conf is None or not budgets:
            return cap_total(list(budgets), max_total)
        survival = conf.float().cumprod(-1).tolist()
        return self._admit([row[:b] for row, b in zip(survival, budgets)], other_tokens, draft_seconds, max_total)

    def choose_nodes(self, survival, other_tokens=0, draft_seconds=0.0, max_total=None):
        self.last_gain = None
        return self._admit(survival, other_tokens, draft_seconds, max_total) if survival else []

    def _admit(self, survival: list[list[float]], other_tokens: int, draft_seconds: float,
               max_total: int | None = None) -> list[int]:
        """Prefix lengths per request: candidates (r, j) in descending survival[r][j] while
        tau(B) / (SPS(B) time + drafter time) improves, at most max_total of them.

        Prompt tokens in the pass (other_tokens) run whether or not anything is drafted, so they
        add to what a draft token costs (the table's slope where the pass runs) but not to what
        an accepted one is worth: a committed token saves its share of a later decode-only step
        of these R requests, cost(R) / R. Priced on the whole pass's time, every draft token
        and the drafter pass itself looked nearly free beside a prompt chunk, and under a burst
        of prompts the drafter ran through every prompt-carrying step at 32 requests."""
        R = len(survival)
        cands = sorted(((a, r, j) for r, row in enumerate(survival) for j, a in enumerate(row)),
                       key=lambda t: (-t[0], t[2]))
        lengths = [0] * R
        alone = self.cost(R)  # a decode-only pass of these requests
        tokens = R + other_tokens  # every request verifies its anchor; prefill rides along
        base = alone - self.cost(tokens)  # the pass's time on a decode-only basis
        tau = float(R)
        plain = tau / alone  # no drafter pass at all
        best = tau / (alone + draft_seconds)
        left = len(cands) if max_total is None else max_total
        for a, r, j in cands:
            if left <= 0:
                break
            if j != lengths[r]:  # a prefix must be admitted in order
                continue
            theta = (tau + a) / (base + self.cost(tokens + 1) + draft_seconds)
            if theta <= best:
                break
            lengths[r], tau, tokens, best = j + 1, tau + a, tokens + 1, theta
            left -= 1
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
