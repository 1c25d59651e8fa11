"""Prompt-lookup assist for a neural drafter (as Arctic Inference pairs suffix decoding with its
speculators): where a request's last tokens already occurred earlier in it, their continuation is
proposed instead of the drafter's block. Small models loop and copy from their prompts; there a
looked-up chain is accepted far further than a drafted one, and the drafter pass is skipped for
the requests that took one. Proposals are deterministic, so their q is one-hot and verification
stays exact for greedy and sampled requests alike."""

from __future__ import annotations

import torch

from dspark.engine.sequence import Sequence
from dspark.models.drafters.ngram import NgramDrafter


class NgramAssist:
    """Looks up chains for requests with a suffix match of at least `min_match` tokens (up to
    `max_match`), and learns how far such chains survive, per position, for the policies.

    A chain starts a block long; each one accepted whole doubles the next (up to `max_len`), and
    any rejection brings it back: copying runs long once it starts (a quoted passage, a loop), and
    a verification pass costs little more for a few more tokens."""

    def __init__(self, min_match: int, max_match: int, block: int, max_len: int):
        self.lookup = NgramDrafter(max_n=max_match, min_n=min_match)
        self.block, self.max_len = block, max(block, max_len)
        self.looked: dict[int, list[int]] = {}  # seq_id -> its looked-up chain, this step
        self.verified: dict[int, int] = {}  # seq_id -> looked-up tokens verified this step
        self.gone: set[int] = set()  # requests released (finished) this step
        self.spans: dict[int, int] = {}  # seq_id -> length of its next chain, where not `block`
        self.reached = [0] * self.max_len  # steps whose chain was verified up to this position
        self.accepted = [0] * self.max_len  # ... and accepted there

    def span(self, seq_id: int) -> int:
        """Most tokens seq_id's next looked-up chain may hold."""
        return self.spans.get(seq_id, self.block)

    def look_up(self, seqs: list[Sequence], budgets: list[int]) -> dict[int, list[int]]:
        """seq_id -> a looked-up chain of at most its budget, for the requests that have one
        (after clear()). Requests under a grammar keep the drafter, whose drafts it steers."""
        for s, b in zip(seqs, budgets):
            if s.grammar is None:
                chain = self.lookup.propose(s.all_ids, b, key=s.seq_id)
                if chain:
                    self.looked[s.seq_id] = chain
        live = {s.seq_id for s in seqs}
        self.lookup.forget_all_but(live)
        if len(self.spans) > 2 * len(live) + 16:
            self.spans = {k: v for k, v in self.spans.items() if k in live}
        return self.looked

    def forget(self, seq_id: int) -> None:
        """Drop seq_id's index and grown span: it finished, or it was preempted (it starts again
        at a block, as after a rejection, so its recomputation reserves no more than a fresh one)."""
        self.lookup.forget(seq_id)
        self.spans.pop(seq_id, None)
        self.gone.add(seq_id)  # so this step's observe() does not grow its span again

    def clear(self) -> None:
        """Forget the last step's chains (every step starts here, drafting or not)."""
        self.looked, self.verified, self.gone = {}, {}, set()

    def _rate(self, i: int, unreached: float) -> float:
        """Position i's survival rate (Laplace-smoothed), or `unreached` where no chain got there."""
        r = self.reached[i] if i < len(self.reached) else 0
        return (self.accepted[i] + 1) / (r + 2) if r else unreached

    def first_rate(self) -> float:
        """prior(1)'s one value, as a float (no tensor): the chance a chain's first token survives."""
        return self._rate(0, 0.5)

    def prior(self, width: int) -> torch.Tensor:
        """[width] estimated chance that a looked-up token survives given the ones before it. A
        position no chain has reached yet takes the one before's (chains grow only after whole
        acceptances, so 0.5 there would keep a cautious policy from ever trying them)."""
        rates: list[float] = []
        for i in range(width):
            rates.append(self._rate(i, rates[-1] if rates else 0.5))
        return torch.tensor(rates)

    def send(self, seq_id: int, chain: list[int], n: int) -> list[int]:
        """The first n tokens of seq_id's chain, recorded as going to verification this step."""
        self.verified[seq_id] = n
        return chain[:n]

    def observe(self, seq_id: int, accepted: int) -> None:
        """How many of seq_id's looked-up tokens the target accepted this step (a request that
        sent none changes nothing)."""
        n = self.verified.get(seq_id, 0)
        for i in range(min(accepted + 1, n, len(self.reached))):
            self.reached[i] += 1
            self.accepted[i] += i < accepted
        if seq_id in self.gone:
            return
        if n and accepted >= n:
            self.spans[seq_id] = min(self.max_len, max(self.block, 2 * n))
        elif n:
            self.spans.pop(seq_id, None)
