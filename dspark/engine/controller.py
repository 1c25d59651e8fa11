"""The verify-length controller: how much of each request's draft the target checks, and when
drafting pauses because it cannot pay.

It wraps a verification-length policy (policy.py) and adds what a policy alone cannot know: the
measured time of the proposer's own pass, and a back-off. While the load-aware policy finds, on
a running average, that even its best choice loses to plain decoding once the drafter pass is
paid for, drafting pauses for a number of steps that doubles on each failed retry (up to
MAX_BACKOFF), then the proposer is tried again. The policy, fed the running acceptance rates
instead of confidences and the drafter's measured time, also gives an expected gain without a
pass: where it is below 1 when a pause runs out, the pause doubles without a probe pass (until
MAX_BACKOFF, then a real probe); where it is 1 or more and fewer requests draft than when
drafting last lost, the pause ends at once. So the back-off can be long under steady load without
keeping a load that fell from speculating. Once every request a pause began with has left, new
text may get trial passes (text that paused drafting is no verdict on other text); where such
trials over several requests pause again, the next new text at that load starts none, for a
back-off of its own. No pause ends, by any of these routes, where the decoding requests have too
few tokens left to repay writing the drafter context it deferred (paused's resume_pays).

The policy's gain is a belief: the drafts' confidences priced by a cost model that a shared
machine's drift can leave behind. So the controller also measures, per number of decoding
requests, the tokens per second that steps with a drafter pass and steps without one really
commit (drafter pass included), taking an occasional plain step to keep the second current, and
pauses drafting wherever the measured ratio says it loses, whatever the belief.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

from dspark.engine.policy import Policy, cap_total
from dspark.engine.proposal import Draft, Proposal
from dspark.engine.sequence import SpecStats


class VerifyLengthController:
    """Cuts drafts into proposals with a policy, prices the proposer's pass, and pauses drafting
    while it loses. ``policy`` may be set after construction (load-aware needs the target's cost
    profile, measured once the engine is complete)."""

    MIN_BACKOFF, MAX_BACKOFF, GAIN_EMA = 4, 256, 0.25
    # a drafting gain measured at a load beyond this many standard errors of its rates outweighs
    # the policy's belief there: the belief prices one pass's confidences, and a pass whose drafts
    # the policy cuts reads as a loss, so at batch 1 a few hard tokens paused a drafter that the
    # steps themselves measured paying (0: the belief always caps the measurement)
    CONFIDENT_WIN = 1.0
    # steps of each kind at a load before their measured rates judge drafting there; the rates'
    # EMA weight; drafting steps between two plain steps taken to measure the plain rate again
    MEASURED_MIN, RATE_EMA, PLAIN_EVERY = 6, 0.1, 64
    # where verifying looked-up chains on paused steps measured a loss, one paused step in this
    # many still verifies them, so that the measurement follows the traffic
    LOOKUP_RETRY = 32
    # a pass faster than the running time moves it more than a slower one: a shared machine's noise
    # and the first passes' set-up only ever add time (as the target's CostModel, it errs cheap)
    DRAFT_TIME_EMA, DRAFT_TIME_EMA_DOWN = 0.2, 0.5
    # drafter passes whose longest verified chain bounds how deep the next pass drafts
    WIDTH_WINDOW = 32
    # the per-position acceptance of text the drafter does well on (hopeful_gain), and the
    # request-passes that try new text before the running gain may pause drafting again (a pass
    # over R requests is R of them: trial_passes_at)
    HOPEFUL_ACCEPTANCE, NEW_TEXT_PASSES = 0.7, 4
    # where new text's trial passes over several requests ended in a pause, the next new-text
    # events at that load (or more requests) start no trial: 1, 2, 4, ... of them, up to this
    MAX_TEXT_SKIPS = 16

    def __init__(self, policy: Policy | None, stats: SpecStats, tree: bool = False, free_drafts: bool = False):
        self.policy, self.stats, self.tree = policy, stats, tree
        # free_drafts (prompt lookup alone: no pass to pay, and acceptance only ever measured where
        # tried): a position no verification has reached yet is priced at the one before's rate
        # (the first at 0.9) instead of 0.5, and while the policy admits no token, one token of
        # each chain is verified after the back-off, so acceptance learned on other traffic
        # cannot switch drafting off for good
        self.free_drafts = free_drafts
        self.idle_steps = 0  # free drafts: steps since the policy last admitted a token
        self.draft_seconds: dict[int, float] = {}  # EMA of a proposer pass's wall time, by batch size
        self.num_draft_passes = 0
        self.skip_steps, self.backoff, self.gain = 0, self.MIN_BACKOFF, 1.0
        self.lost_at = 0  # drafting requests in the pass that last paused drafting
        self.trial_passes = 0  # passes left that try new text (paused): no pause before they run
        self.resumed = False  # a pause just ended: the next pass is a probe
        self.held = 0  # steps a pause that ran out was held for its catch-up (paused's resume_pays)
        self.text_probe: int | None = None  # requests of the new-text trial being judged
        # requests (two or more) -> [new-text events still to skip, their back-off]: where a trial
        # on new text paused drafting again (skip_text)
        self.text_losses: dict[int, list[int]] = {}
        self.declined_text = False  # the last paused() passed over new text (skip_text)
        # (requests, width, acceptance or None) -> expected gain, until the next pass
        self.expected: dict[tuple[int, int, float | None], float] = {}
        # (decoding requests, kind) -> [EMA of committed tokens per second, steps, EMA of its
        # square]; kind: True (a drafter pass), False (plain: nothing verified past the anchor),
        # "lookup" (a paused step that verified looked-up chains)
        self.rates: dict[tuple[int, bool | str], list[float]] = {}
        self.since_plain: dict[tuple[int, bool | str], int] = {}  # (requests, kind) -> its steps since a plain one
        self.lookup_skips: dict[int, int] = {}  # where lookups lose: paused steps since they were tried
        self.widths: collections.deque[int] = collections.deque(maxlen=self.WIDTH_WINDOW)

    def paused(self, R: int = 1, width: int = 1, decodes: int | None = None, new_text: bool = False,
               prompts_waiting: bool = False, resume_pays: Callable[[float], bool] | None = None) -> bool:
        """Whether this step, with R requests that could draft up to width tokens (of `decodes`
        decoding requests), drafts nothing (counts the paused step, unless prompts_waiting: prompts
        wait to be prefilled beside the decodes, and the pause holds). new_text: every request
        that was decoding when this pause began has left. resume_pays(gain): whether drafting at
        that expected gain repays what ending the pause costs first (the paused steps' drafter
        context, written before the first pass): a pause that would end early (new text, fewer
        requests than lost) stays on where it does not, and one that runs out where drafting
        would pay holds MIN_BACKOFF steps more, up to MAX_BACKOFF in all (None: it always does).
        A pause that runs out where drafting loses is a probe to keep the rates current and
        never asks."""
        D = decodes or R
        self.declined_text = False
        if self.skip_steps == 0:
            # a plain step to measure against, only under a policy that prices steps (fixed and
            # threshold verify what they are told)
            return hasattr(self.policy, "last_gain") and self._plain_due(D, True)
        if prompts_waiting:
            # no pause ends (nor counts down) while prompts wait: a drafting step reserves and
            # prices every decode's chain, so the planner slices the prompts thinner (more steps
            # that stall the decodes, later first tokens) for drafts that the policy, pricing
            # them beside the prompt rows, mostly cuts (a burst's ramp ended the pause that the
            # last burst's requests had left, and its prompts went in thin slices)
            return True
        pays = resume_pays or (lambda gain: True)
        hopeful = self.hopeful_gain(R, width) if new_text else 0.0
        if hopeful >= 1.0 and not pays(hopeful):
            self.declined_text = True  # too little left to write the context for: as a skip
        elif hopeful >= 1.0:
            # what paused drafting was measured on text that has left: the drafting rate at D and
            # the running acceptance only move while drafting runs, so a few hard tokens at a
            # request's start kept a fresh server at one request from drafting for hundreds of
            # steps. Trial passes, judged by their own confidences (one request's belief spreads
            # too widely to decide); the measured rate restarts at one step's weight (as in
            # _remeasure_unsure_loss). Unless trials lost at this load lately (skip_text): then
            # a paused step like the others
            self.declined_text = self.skip_text(R)
            if not self.declined_text:
                self.skip_steps, self.gain, self.resumed, self.held = 0, 1.0, True, 0
                self.trial_passes = self.trial_passes_at(R)
                self.text_probe = R
                self._restart_drafting_rate(D)
                return False
        gain = self._judged(self.expected_gain(R, width), D)
        if R < self.lost_at and gain >= 1.0 and pays(gain):
            # that average was another load's: try again now, keeping the back-off (under serving
            # churn the load dips below lost_at every few steps, and each dip resetting it made
            # the drafter probe, context catch-up included, every few dozen steps)
            self.skip_steps, self.gain, self.resumed, self.held = 0, 1.0, True, 0
            return False
        self.skip_steps -= 1
        if self.skip_steps == 0 and self.backoff < self.MAX_BACKOFF and gain < 1.0:
            # even the running acceptance rates say drafting loses at this load: pause again, twice
            # as long, without paying for a probe pass (a real probe at least every MAX_BACKOFF
            # steps keeps those rates current)
            self.skip_steps = self.backoff
            self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)
        elif self.skip_steps == 0 and gain >= 1.0 and self.held < self.MAX_BACKOFF and not pays(gain):
            # not a loss: the back-off stays; held at most MAX_BACKOFF steps, then a probe as
            # after any pause (the running rates move only while drafting runs)
            self.skip_steps = self.MIN_BACKOFF
            self.held += self.MIN_BACKOFF
        self.resumed = self.skip_steps == 0
        if self.resumed:
            self.held = 0
        return True

    @property
    def starting(self) -> bool:
        """Only the first drafter pass has run: one-time start-up costs (kernel set-up, first-touch
        pages) make it and its step several times slower than the rest, so neither is measured."""
        return self.num_draft_passes <= 1

    def _plain_due(self, D: int, kind: bool | str) -> bool:
        """A plain step to measure (again) what steps without `kind`'s extra work commit at D
        requests, once that kind has MEASURED_MIN steps there."""
        steps, plain = self.rates.get((D, kind)), self.rates.get((D, False))
        if steps is None or steps[1] < self.MEASURED_MIN:
            return False
        return plain is None or plain[1] < self.MEASURED_MIN or self.since_plain.get((D, kind), 0) >= self.PLAIN_EVERY

    def observe_outcome(self, D: int, kind: bool | str, committed: int, seconds: float) -> None:
        """A decode-only step of D requests committed `committed` tokens in `seconds`; kind: True
        (its drafter pass included), False (plain) or "lookup" (see ``rates``)."""
        if D < 1 or not seconds > 0 or (kind is True and self.starting):
            return  # (the step of the very first drafter pass: its start-up costs are no rate)
        rate = committed / seconds
        old = self.rates.setdefault((D, kind), [rate, 0, rate * rate])
        w = max(self.RATE_EMA, 1.0 / (old[1] + 1))
        old[0] += w * (rate - old[0])
        old[2] += w * (rate * rate - old[2])  # the square's average: how far single steps spread
        old[1] += 1
        if kind is False:
            self.since_plain[D, True] = self.since_plain[D, "lookup"] = 0
        else:
            self.since_plain[D, kind] = self.since_plain.get((D, kind), 0) + 1

    def observe_lookups(self, D: int, committed: int, seconds: float) -> None:
        """A paused decode-only step of D requests verified looked-up chains (no drafter pass)."""
        self.observe_outcome(D, "lookup", committed, seconds)

    def measured_gain(self, D: int, kind: bool | str = True) -> float | None:
        """Measured tokens per second of drafting steps (kind "lookup": of paused steps that
        verified looked-up chains) over plain ones at D decoding requests (None until both kinds
        have MEASURED_MIN steps)."""
        steps, plain = self.rates.get((D, kind)), self.rates.get((D, False))
        if steps is None or plain is None or min(steps[1], plain[1]) < self.MEASURED_MIN:
            return None
        return steps[0] / plain[0]

    def measured_gain_bound(self, D: int, kind: bool | str = True, errors: float = 1.0) -> float | None:
        """measured_gain plus `errors` standard errors: single steps spread widely (a drafting step
        commits 1 to 9 tokens) and the rates are running averages of a few dozen steps, so a
        ratio a little under 1 is as likely noise as a loss (and a long pause on noise costs a
        drafter that pays its whole gain); the loss that overrides the policy's belief is the one
        the one-error bound still shows."""
        gain = self.measured_gain(D, kind)
        if gain is None:
            return None
        spread = 0.0
        for mean, n, square in (self.rates[D, kind], self.rates[D, False]):
            steps = min(n, (2 - self.RATE_EMA) / self.RATE_EMA)  # an EMA's effective sample count
            spread += max(0.0, square - mean * mean) / (mean * mean * steps)
        return gain * (1.0 + errors * spread ** 0.5)

    def _measured_or_lower_loss(self, D: int, kind: bool | str) -> float | None:
        """The gain measured at D (measured_gain_bound), else a loss measured at the nearest fewer
        requests: drafting (and verifying looked-up chains) pays less as requests add rows to the
        pass, and under serving churn many loads never gather MEASURED_MIN steps of each kind."""
        measured = self.measured_gain_bound(D, kind)
        if measured is not None:
            return measured
        for d in sorted((d for d, k in self.rates if k == kind and d < D), reverse=True):
            below = self.measured_gain_bound(d, kind)
            if below is not None:
                return below if below < 1.0 else None
        return None

    def lookups_pay(self, D: int) -> bool:
        """Whether a paused step of D decoding requests may verify looked-up chains (the policy
        prices each chain; this is what such steps measured): not when a plain step is due to
        measure against, nor where they measured a loss (or one at fewer requests), except one
        step in LOOKUP_RETRY."""
        if self._plain_due(D, "lookup"):
            return False
        gain = self._measured_or_lower_loss(D, "lookup")
        if gain is None or gain >= 1.0:
            return True
        self.lookup_skips[D] = (self.lookup_skips.get(D, 0) + 1) % self.LOOKUP_RETRY
        return self.lookup_skips[D] == 0

    def _judged(self, belief: float, D: int) -> float:
        """The policy's expected gain, or the measured one at D requests where that is lower (a
        load not yet measured: a loss measured at fewer requests, _measured_or_lower_loss); where
        drafting steps at D measured a win beyond CONFIDENT_WIN standard errors, that win."""
        measured = self._measured_or_lower_loss(D, True)
        if measured is None:
            return belief
        if self.CONFIDENT_WIN:
            low = self.measured_gain_bound(D, True, errors=-self.CONFIDENT_WIN)
            if low is not None and low >= 1.0:
                return max(low, min(belief, measured))
        return min(belief, measured)

    def expected_gain(self, R: int, width: int, acceptance: float | None = None) -> float:
        """The policy's best throughput over plain decoding's for R requests whose drafts survive
        at the running per-position acceptance rates, or at `acceptance` at every position (0 for
        policies that do not price steps)."""
        key = (R, width, acceptance)
        if key not in self.expected:
            if acceptance is None:
                prior = self.acceptance_prior(width).expand(R, width)
            else:
                prior = torch.full((R, width), acceptance)
            self.policy.choose([width] * R, prior, 0, self.estimated_draft_seconds(R))
            self.expected[key] = getattr(self.policy, "last_gain", None) or 0.0
        return self.expected[key]

    def trial_passes_at(self, R: int) -> int:
        """Drafter passes over R requests that new text runs before its running gain may pause
        drafting: NEW_TEXT_PASSES request-passes' worth. A pass's belief averages its requests'
        confidences, so one pass over four or more says as much as four over one; under load,
        where the drafter pass and the rows are what lose, each extra trial pass drafted at a
        loss after every wave of requests had left a pause behind."""
        return self.NEW_TEXT_PASSES // max(1, R)

    def skip_text(self, R: int) -> bool:
        """Whether new text at R requests starts no trial (counting the event as passed over): a
        trial over two or more requests that ended in a pause, at R or fewer requests, skips the
        next new-text events, twice as many after each such trial in a row. Under load the
        hopeful acceptance prices a pass that the catch-up of the paused context and the drafter
        pass make a loss on most text, and every wave of requests leaving a pause behind tried it
        again; one request's text is a single sample, so a trial there always runs."""
        below = [r for r in self.text_losses if r <= R]
        if R < 2 or not below:
            return False
        record = self.text_losses[max(below)]
        if record[0] == 0:
            return False
        record[0] -= 1
        return True

    def _judge_text(self, paused: bool) -> None:
        """A new-text trial's outcome, once its trial passes ran: paused again (a loss there
        and at more requests, skip_text) or drafting on (which clears the losses at its load
        and fewer requests)."""
        R, self.text_probe = self.text_probe, None
        if R is None or R < 2:
            return
        if paused:
            record = self.text_losses.setdefault(R, [0, 0])
            record[1] = min(max(1, 2 * record[1]), self.MAX_TEXT_SKIPS)
            record[0] = record[1]
        else:
            for r in [r for r in self.text_losses if r <= R]:
                del self.text_losses[r]

    def hopeful_gain(self, R: int, width: int) -> float:
        """expected_gain for drafts that survive each position at HOPEFUL_ACCEPTANCE: below 1,
        drafting loses at this load on any text (the drafter pass and the extra rows cost more
        than well-drafted text gives back), so no new text is worth a probe."""
        return self.expected_gain(R, width, self.HOPEFUL_ACCEPTANCE)

    def draft_width(self, budget: int) -> int:
        """Tokens a drafter pass drafts for a request that may verify `budget`: one more than the
        longest chain the policy verified in the last WIDTH_WINDOW passes (a chain that reaches
        that lifts it by one for the next pass), the whole budget before any pass. Drafting deeper
        than the policy verifies only adds work: each drafted position is a row of the drafter's
        layers, head and walk, which the confidences of a pass-priced policy rarely let through."""
        return min(budget, max(self.widths) + 1) if self.widths else budget

    def record_width(self, longest: int) -> None:
        """The longest chain a drafter pass's requests verify (see draft_width)."""
        self.widths.append(longest)

    def estimated_draft_seconds(self, R: int) -> float:
        """Measured proposer pass time at batch R, from the nearest batch size seen (0 before any)."""
        if not self.draft_seconds or R == 0:
            return 0.0
        near = min(self.draft_seconds, key=lambda n: abs(n - R))
        return self.draft_seconds[near] * max(1.0, R / near)

    def record_pass(self, R: int, seconds: float, decodes: int | None = None) -> None:
        """A proposer pass over R requests (of `decodes` decoding requests) took `seconds`; pause
        drafting while it loses, by the policy's belief or by what drafting steps measured."""
        self.num_draft_passes += 1
        self.expected.clear()
        if self.starting:
            # averaged in, the first pass's start-up costs would price the drafter out for many
            # passes, and a paused drafter measures too rarely to recover
            return
        priced = bool(self.draft_seconds)  # the first priced choice took the drafter to be free
        old = self.draft_seconds.get(R, seconds)
        rate = self.DRAFT_TIME_EMA_DOWN if seconds < old else self.DRAFT_TIME_EMA
        self.draft_seconds[R] = old + rate * (seconds - old)
        gain = getattr(self.policy, "last_gain", None)
        if gain is None or not priced:
            return
        if self.resumed:
            self.resumed = False
            self._remeasure_unsure_loss(decodes or R, gain)
        self.gain += self.GAIN_EMA * (self._judged(gain, decodes or R) - self.gain)
        if self.trial_passes > 0:
            self.trial_passes -= 1
        elif self.gain < 1.0:
            self.skip_steps, self.lost_at = self.backoff, R
            self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)
            self._judge_text(paused=True)
        else:
            self.backoff = self.MIN_BACKOFF
            self._judge_text(paused=False)

    def _remeasure_unsure_loss(self, D: int, belief: float) -> None:
        """At a probe (the first pass after a pause) that the policy expects to pay, the drafting
        rate measured at D is measured again unless it shows a loss beyond two standard errors:
        it keeps its mean at the weight of one step, so the probe's next MEASURED_MIN drafting
        steps decide, and the running gain (which that rate held down) is lifted to even so that
        the drafter runs them.
        Otherwise the rate moves only by the one step of each probe, at RATE_EMA's weight, while
        the plain rate stays current: a loss that a few unlucky steps (or the machine's drift
        between the two) put there kept drafting paused through every probe. A loss beyond two
        errors pauses again at once, as before."""
        bound = self.measured_gain_bound(D, True, errors=2.0)
        if belief >= 1.0 and bound is not None and bound >= 1.0:
            self._restart_drafting_rate(D)
            self.gain = max(self.gain, 1.0)

    def _restart_drafting_rate(self, D: int) -> None:
        """The drafting rate measured at D keeps its mean at one step's weight: the next
        MEASURED_MIN drafting steps there decide again."""
        if (D, True) in self.rates:
            self.rates[D, True][1] = min(self.rates[D, True][1], 1)

    def choose(self, drafts: list[Draft], budgets: list[int], other_tokens: int,
               draft_seconds: float, max_total: int | None = None) -> list[Proposal]:
        """One proposal per draft: chains cut by the policy (within budgets), trees pruned to the
        nodes it admits, at most max_total tokens or nodes in all (None: no limit). Chains and
        trees of one step compete for the same pass."""
        if self.tree:
            return self._choose_nodes(drafts, other_tokens, draft_seconds, max_total)
        width = max(len(d.tokens) for d in drafts)
        prior = None
        rows = []
        nothing = torch.zeros(width)
        for d in drafts:
            if not d.tokens:  # a plain row (it commits its token, proposes none): one shared zero row
                rows.append(nothing)
                continue
            c = d.confidence
            if c is None:
                prior = self.acceptance_prior(width) if prior is None else prior
                c = prior[:len(d.tokens)]
            c = c.float().cpu()
            rows.append(c if len(c) == width else torch.nn.functional.pad(c, (0, width - len(c))))
        limits = [min(b, len(d.tokens)) for d, b in zip(drafts, budgets)]
        lengths = self.policy.choose(limits, torch.stack(rows), other_tokens, draft_seconds, max_total)
        if self.free_drafts:
            lengths = cap_total(self._probe(lengths, limits), max_total)
        return [d.cut(n) for d, n in zip(drafts, lengths)]

    def _probe(self, lengths: list[int], limits: list[int]) -> list[int]:
        """lengths, or a token of every chain once the policy has admitted none for the back-off."""
        if any(lengths) or not any(limits):
            if any(lengths):
                self.idle_steps, self.backoff = 0, self.MIN_BACKOFF
            return lengths
        self.idle_steps += 1
        if self.idle_steps < self.backoff:
            return lengths
        self.idle_steps, self.backoff = 0, min(2 * self.backoff, self.MAX_BACKOFF)
        return [min(1, n) for n in limits]

    def _choose_nodes(self, drafts: list[Draft], other_tokens: int, draft_seconds: float,
                      max_total: int | None) -> list[Proposal]:
        """Tree nodes by joint draft probability; chains beside them by their running survival."""
        survival = []
        for d in drafts:
            if d.tree is not None:
                survival.append([d.tree.scores[i] for i in d.tree.ranked()])
            elif not d.tokens:  # a plain row: no candidates
                survival.append([])
            else:
                c = d.confidence if d.confidence is not None else self.acceptance_prior(len(d.tokens))
                survival.append(c.float().cumprod(0).tolist()[:len(d.tokens)])
        sizes = self.policy.choose_nodes(survival, other_tokens, draft_seconds, max_total)
        return [d.cut(n) for d, n in zip(drafts, sizes)]

    def acceptance_prior(self, width: int) -> torch.Tensor:
        """[width]: each position's running chance of acceptance given the one before it, for
        drafts without confidences (the policies take the running product as survival, as they
        do a confidence head's). The counters hold survival itself, a position's acceptances over
        its verifications, which depend on every earlier position too: each is divided by the
        one before, or the product would count the earlier positions' rejections twice."""
        st = self.stats
        survival = [(a + 1) / (v + 2) for a, v in zip(st.accepted_per_pos, st.verified_per_pos)]
        rates = [min(1.0, s / p) for s, p in zip(survival, [1.0] + survival)]
        fill = (rates[-1] if rates else 0.9) if self.free_drafts else 0.5
        return torch.tensor((rates + [fill] * width)[:width])
