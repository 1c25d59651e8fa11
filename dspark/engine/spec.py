"""Speculation glue between the engine and a proposer: draft budgets, the n-gram assist composed
with a neural proposer, the verify-length controller, and the per-step Proposals.

A step whose drafting the controller pauses is decided before the step is planned (begin_step),
so that it costs what a step without a drafter costs: each request reserves and is charged one
slot (plus a looked-up chain, where the policy would verify one), no drafter pass runs, nothing
is looked up that the policy would cut, and the drafter's context writes wait for the pause to
end (drafter_context.py). The target pass still captures the drafter's feature layers: see
DrafterContext for why capturing them beats recomputing them when drafting resumes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from dspark.config import SpecConfig
from dspark.engine.assist import NgramAssist
from dspark.engine.controller import VerifyLengthController
from dspark.engine.policy import CostModel, cap_total, make_policy
from dspark.engine.proposal import Draft, Proposal, Proposer
from dspark.engine.sequence import Sequence, SpecStats


class SpecRunner:
    """Runs one proposer for the engine. Each step: budgets per request, then (for neural
    proposers) prompt lookup first, the proposer's pass for the requests without a looked-up
    chain, and the controller's cut of every draft. Deterministic proposers (prompt lookup
    alone) are verified whole, except under the load-aware policy, which cuts their chains at the
    running acceptance per position like any other (each verified token is a row of the pass).
    With the base Proposer every request verifies just its anchor (plain decoding)."""

    LOOKUP_VERDICT_STEPS = 64

    def __init__(self, cfg: SpecConfig, proposer: Proposer, stats: SpecStats, max_model_len: int):
        self.cfg, self.proposer, self.stats = cfg, proposer, stats
        self.max_model_len = max_model_len  # the engine lowers it when the KV cache is small
        self.name = proposer.name
        self.capture_layers = proposer.capture_layers
        self.block_size = proposer.num_drafts
        neural = proposer.num_drafts > 0 and not proposer.deterministic
        if cfg.tree and neural and not proposer.trees:
            raise ValueError(f"--tree needs a drafter that drafts trees; {proposer.name} drafts chains")
        # a block size the user set caps looked-up chains too; the drafter's own lets them grow
        self.assist = NgramAssist(cfg.ngram_assist, max(cfg.ngram_max, cfg.ngram_assist), self.block_size,
                                  cfg.block_size or cfg.ngram_assist_max_len) if neural and cfg.ngram_assist else None
        # load-aware needs the target's cost profile: calibrate() supplies it once the engine is
        # complete (CUDA graphs change what a pass costs)
        policy = None if cfg.policy == "load-aware" else make_policy(cfg.policy, cfg.threshold, None)
        priced = neural or (proposer.num_drafts > 0 and cfg.policy == "load-aware")
        self.controller = VerifyLengthController(policy, stats, cfg.tree and neural, free_drafts=not neural) \
            if priced else None
        # this step's mode (begin_step): drafting paused, and whether a paused step looks chains up
        self.paused, self.lookups = False, self.assist is not None
        # the deepest drafter chain this step drafts and may verify (None: no cap; begin_step)
        self.chain_depth: int | None = None
        self._lookup_verdicts: dict[int, list] = {}  # rows -> _lookups_pay's last verdict there
        self._paused_with: set[int] | None = None  # the decoding requests of the pass that paused drafting
        self.passed = False  # whether this step's propose ran the proposer's pass
        self.verified = False  # ... and whether it proposed any token to verify
        # prefix caching shares pages, and with them the drafter's context at their slots: then
        # every request keeps its context, drafting or not (the engine sets it)
        self.shared_prefixes = False

    @property
    def graphs(self):  # noqa: ANN201 - cuda_graphs.GraphPool
        return self.proposer.graphs

    @property
    def block_forward(self):  # noqa: ANN201 - the proposer's capturable forward, or None
        return self.proposer.block_forward

    def calibrate(self, cost: Callable[[], CostModel]) -> None:
        """Called once the engine is built (after CUDA graphs): measure what the policy needs."""
        if self.controller is not None and self.controller.policy is None:
            self.controller.policy = make_policy(self.cfg.policy, self.cfg.threshold, cost())

    @property
    def policy(self):  # noqa: ANN201 - policy.Policy, or None without a neural proposer
        return self.controller.policy if self.controller is not None else None

    # ------------------------------------------------------------------ budgets
    def draft_budget(self, seq: Sequence, cap: int | None = None) -> int:
        """Most draft tokens worth verifying for seq (cap: instead of the block size, unless the
        request set its own): never past max_tokens or the context."""
        return 0 if seq.plain_step else self._room(seq, cap)

    def _room(self, seq: Sequence, cap: int | None = None) -> int:
        """draft_budget before the planner knows whether seq's drafts fit the free pages."""
        if not seq.spec_enabled or not self.block_size:
            return 0
        block = seq.block_size or cap or self.block_size
        left = seq.params.max_tokens - len(seq.output_ids) - 1
        room = self.max_model_len - seq.num_cached - 2
        return max(0, min(block, left, room))

    def lookup_budget(self, seq: Sequence) -> int:
        """Most looked-up tokens seq may verify this step."""
        return self.draft_budget(seq, self.assist.span(seq.seq_id))

    def block_size_error(self, block_size: int | None) -> str | None:
        """Why a request's own block size cannot run here (None: it can, or it has no effect)."""
        if block_size is None or not self.block_size:
            return None
        top = 32 if self.proposer.deterministic else self.block_size
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= top:
            return f"block_size must be an integer in [1, {top}] for drafter {self.name}, got {block_size!r}"
        return None

    def context_headroom(self) -> int:
        """Cache slots past max_model_len a step may reserve for one request. A chain never
        passes the context (draft_budget stops at it); a drafter block or a tree may."""
        return max(self.cfg.tree_budget if self.cfg.tree else 0, self.proposer.context_headroom())

    @property
    def longest_chain(self) -> int:
        """Most proposed tokens a request's chain may hold (CUDA graphs pad chains to it)."""
        return self.assist.max_len if self.assist is not None else self.block_size

    def max_tokens_for(self, seq: Sequence) -> int:
        """Cache slots beyond num_cached this step may write for seq (after begin_step): its
        verified tokens with a drafter chain as deep as its budget, and in a drafting step at
        least the slots the drafter's block pass writes into its own cache."""
        n = self._verify_tokens(seq, None)
        return n if n == 1 or self.paused else max(n, self.proposer.forward_tokens)

    def priced_tokens_for(self, seq: Sequence) -> int:
        """Tokens seq may add to this step's target pass (after begin_step), which the token
        budget prices: no block-pass slots, and a drafter chain no deeper than this step's
        chain_depth (_propose drafts no deeper). (The decode-stall bound prices the anchors
        alone and caps the drafts with what it leaves: propose's max_drafts.)"""
        return self._verify_tokens(seq, self.chain_depth)

    def _verify_tokens(self, seq: Sequence, depth: int | None) -> int:
        """1 + the most tokens seq may verify this step: a looked-up chain, a tree's nodes, or a
        drafter chain at most `depth` deep (None: its whole budget); 1 without a budget."""
        budget = self.draft_budget(seq)
        if not budget:
            return 1
        looked = self.lookup_budget(seq) if self.lookups else 0
        if self.paused:  # no drafter pass: at most a looked-up chain after the anchor
            return 1 + looked
        if self.cfg.tree:
            nodes = self.cfg.tree_budget
        else:
            nodes = budget if depth is None else min(budget, depth)
        return 1 + max(nodes, looked)

    # ------------------------------------------------------------------ one step
    def begin_step(self, seqs: list[Sequence], prompts_waiting: bool = False) -> None:
        """Decide, before the step is planned, whether it drafts: seqs are the decoding requests.
        A paused step reserves no draft slots (max_tokens_for), so it leaves the token budget and
        the pages to prefill as a step without a drafter would. While prompts wait to be prefilled
        no step looks chains up: each request's looked-up span would be reserved, and priced
        against the decode-stall bound and the token budget, slicing the prompts thinner (more
        steps that stall the decodes) for chains that mostly go unverified."""
        self.paused, self.lookups = False, self.assist is not None and not prompts_waiting
        if self.controller is None or self.proposer.deterministic:
            return
        # chains: a pass drafts no deeper than the policy has lately verified (plus one): fewer
        # autoregressive steps for EAGLE-3 heads and draft models, fewer positions for an eager
        # block pass (BlockProposer._block_length). No budget exceeds the block, so the
        # block-wide width caps each one; worked out once a step for the planner and _propose
        self.chain_depth = None if self.cfg.tree else self.controller.draft_width(self.block_size)
        rooms = [b for b in map(self._room, seqs) if b > 0]
        if not rooms:
            return
        new_text = False
        if self.controller.skip_steps == 0:
            self._paused_with = None
        else:  # (a set of request ids only while paused: most steps under load are)
            ids = {s.seq_id for s in seqs}
            if self._paused_with is None:  # paused without a pass of ours saying so (_propose)
                self._paused_with = ids
            new_text = self._paused_with.isdisjoint(ids)
        self.paused = self.controller.paused(len(rooms), max(rooms), len(seqs), new_text, prompts_waiting,
                                             resume_pays=lambda gain: self._catch_up_pays(seqs, gain))
        if self.controller.declined_text:  # the next new text: once these requests have left
            self._paused_with = ids
        if self.paused and self.lookups:
            # the prefill tokens are not planned yet: priced as none (propose checks again); and
            # what paused steps that verified lookups measured at this load
            self.lookups = self._lookups_pay(len(seqs), 0) and self.controller.lookups_pay(len(seqs))

    def _catch_up_pays(self, seqs: list[Sequence], gain: float) -> bool:
        """Whether ending a pause over these decoding requests repays its catch-up: the first
        drafter pass writes the context the paused steps deferred (DrafterContext), and drafting
        at `gain` saves 1 - 1/gain of a plain step (the policy's cost model) for each token the
        requests have left (their median; a stop may end them sooner). At a level's tail the
        last requests, a few tokens from their ends, resumed drafting and wrote a thousand or
        more paused rows first, the time of two plain steps, for nothing."""
        seconds = self.proposer.catch_up_seconds()
        cost = getattr(self.policy, "cost", None)
        if not seconds or cost is None:
            return True
        left = statistics.median_high(s.params.max_tokens - len(s.output_ids) for s in seqs)
        return (1.0 - 1.0 / gain) * left * cost(len(seqs)) > seconds

    def _lookups_pay(self, rows: int, other_tokens: int) -> bool:
        """Whether the policy would verify any looked-up token in a pass of `rows` decoding rows
        and other_tokens prefill tokens with no drafter pass to pay. Every looked-up chain has the
        same prior survival, highest at its first token, and the policies admit candidates best
        first: if one chain's first token is not worth its row, no looked-up token is, so the
        lookups themselves can be skipped."""
        policy = self.policy
        if policy is None:
            return True
        # asked twice a step, every paused step: a verdict stands while the question (prefill
        # tokens, the chains' first-token rate) is the same, for LOOKUP_VERDICT_STEPS asks (the
        # policy's cost model moves slowly), so a paused step costs what a plain one does
        rate = self.assist.first_rate()
        last = self._lookup_verdicts.get(rows)  # [other_tokens, rate, verdict, asks left]
        if last is not None and last[:2] == [other_tokens, rate] and last[3] > 0:
            last[3] -= 1
            return last[2]
        conf = torch.zeros(rows, 1)
        conf[0] = rate
        verdict = policy.choose([1] + [0] * (rows - 1), conf, other_tokens, 0.0)[0] > 0
        self._lookup_verdicts[rows] = [other_tokens, rate, verdict, self.LOOKUP_VERDICT_STEPS]
        return verdict

    def propose(self, seqs: list[Sequence], other_tokens: int = 0,
                max_drafts: int | None = None) -> dict[int, Proposal]:
        """A Proposal per drafting request; other_tokens: prefill tokens in the same pass;
        max_drafts: the most draft tokens (or tree nodes) verified in all (None: no limit; 0: a
        plain step, no drafter pass), what the decode-stall bound leaves beside a prompt chunk."""
        out = self._propose(seqs, other_tokens, max_drafts)
        self.verified = any(p.tokens or p.tree is not None for p in out.values())
        return out

    def _propose(self, seqs: list[Sequence], other_tokens: int, max_drafts: int | None) -> dict[int, Proposal]:
        self.passed = False
        if self.assist is not None:
            self.assist.clear()
        budgets = [self.draft_budget(s) for s in seqs]
        active = [s for s, b in zip(seqs, budgets) if b > 0]
        if not active or max_drafts == 0:
            return {}
        budgets = [b for b in budgets if b > 0]
        if self.proposer.deterministic:
            drafts = self.proposer.draft(active, budgets)
            if self.controller is None:  # under a fixed or threshold policy: verified whole
                lengths = cap_total([len(d.tokens) for d in drafts], max_drafts)
                return {s.seq_id: Proposal(d.tokens[:n], num_proposed=d.num_proposed)
                        for s, d, n in zip(active, drafts, lengths)}
            plain = [Draft([])] * (len(seqs) - len(active))  # found for free: priced, no pass to pay
            chosen = self.controller.choose(drafts + plain, budgets + [0] * len(plain), other_tokens, 0.0, max_drafts)
            return dict(zip([s.seq_id for s in active], chosen))
        paused = self.paused
        if paused and (not self.lookups or not self._lookups_pay(len(seqs), other_tokens)):
            return {}  # a plain step: nothing looked up that the policy would cut anyway
        t0 = time.perf_counter()
        looked = self.assist.look_up(active, [self.lookup_budget(s) for s in active]) if self.lookups else {}
        if paused and not looked:
            return {}
        # paused: no drafter pass, yet a looked-up chain costs nothing to find, so the policy prices
        # it; the other requests propose nothing (budget 0), their tokens still counted in the pass
        neural = [] if paused else [(s, b) for s, b in zip(active, budgets) if s.seq_id not in looked]
        deepest = self.block_size if self.chain_depth is None else self.chain_depth
        drafted = self.proposer.draft([s for s, _ in neural], [min(b, deepest) for _, b in neural]) if neural else []
        by_seq = {s.seq_id: d for (s, _), d in zip(neural, drafted)}
        if looked:
            prior = self.assist.prior(max(len(c) for c in looked.values()))
            by_seq.update((sid, Draft(chain, prior[:len(chain)], looked_up=True)) for sid, chain in looked.items())
        drafts = [by_seq.get(s.seq_id) or Draft([]) for s in active]
        budgets = [len(d.tokens) if d.looked_up or paused else b for d, b in zip(drafts, budgets)]
        # a request that cannot draft still commits its anchor's token: a plain row of the pass
        # (budget 0), so the policy weighs the pass's whole output, not only the drafting rows'
        plain = len(seqs) - len(active)
        seconds = self.controller.estimated_draft_seconds(len(neural))
        chosen = self.controller.choose(drafts + [Draft([])] * plain, budgets + [0] * plain, other_tokens, seconds,
                                        max_drafts)
        out = dict(zip([s.seq_id for s in active], chosen))
        for sid in looked:
            self.assist.send(sid, looked[sid], len(out[sid].tokens))
        if neural:
            self.passed = True
            self.controller.record_pass(len(neural), time.perf_counter() - t0, len(seqs))
            if self.controller.skip_steps > 0:  # this pass paused drafting: on these requests' text
                self._paused_with = {s.seq_id for s in seqs}
            if not self.cfg.tree:
                self.controller.record_width(max(len(out[s.seq_id].tokens) for s, _ in neural))
        if paused:  # a chain the policy cut to nothing leaves a plain step, as the pause would
            return {sid: p for sid, p in out.items() if p.tokens}
        return out

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A decode-only step's target tokens and its wall seconds outside the drafter pass (the
        pass, acceptance and commit), for policies that price verification."""
        cost = getattr(self.policy, "cost", None)
        if cost is not None:
            cost.observe(tokens, seconds)

    def observe_outcome(self, decodes: int, committed: int, seconds: float) -> None:
        """A decode-only step's requests, the tokens they committed and its wall seconds, drafter
        pass included: the controller's measured gain of drafting."""
        if self.controller is None or self.proposer.deterministic:
            return
        if self.passed or not self.verified:
            self.controller.observe_outcome(decodes, self.passed, committed, seconds)
        elif self.paused:  # looked-up chains verified without a drafter pass
            self.controller.observe_lookups(decodes, committed, seconds)

    def commit(self, ctx_rows, result) -> None:
        """Called after each forward with (seq, first new position, batch rows kept there in order)."""
        if self.assist is not None and self.assist.verified:
            for seq, _, kept in ctx_rows:
                self.assist.observe(seq.seq_id, len(kept) - 1)
        paused = self.controller is not None and self.controller.skip_steps > 0
        if result.feats is None:  # a pass without requests that keep a context (capture_for)
            ctx_rows = []
        elif not self.shared_prefixes:  # a request that never drafts needs none
            ctx_rows = [r for r in ctx_rows if r[0].spec_enabled]
        # shared prefixes: a prompt page is shared (Engine._commit) with the drafter's context at its
        # slots, so prompt positions are not deferred through a pause
        self.proposer.commit(ctx_rows, result.feats, flush=not paused, prompts_now=self.shared_prefixes)

    def capture_for(self, seqs: list[Sequence]) -> tuple[int, ...]:
        """The target layers this step's pass captures for the proposer's context: none when no
        request in it may ever draft (and no shared prefix may need its context)."""
        if self.shared_prefixes or any(s.spec_enabled for s in seqs):
            return self.capture_layers
        return ()

    def release(self, seq_id: int) -> None:
        """seq_id finished or was preempted: drop what is kept across its steps."""
        if self.assist is not None:
            self.assist.forget(seq_id)
        self.proposer.release(seq_id)
