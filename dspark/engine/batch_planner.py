"""Which requests run in the next step, and how many tokens each: continuous batching.

Decoding requests come first, each reserving the pages for its anchor and its drafts; when the
pool runs short, the newest request is preempted (its pages freed, recomputed later), first
come, first served as in vLLM. Prefill chunks fill the rest of the token budget, leaving free
the pages the decoding requests need to draft again next step. Under a decode-stall bound
(EngineConfig.max_decode_stall_ms) a step with decoding requests takes only as many prefill
tokens as keep its predicted target pass within the bound, as Sarathi-Serve sizes its chunks
to a time-between-tokens goal: a long prompt then reaches the decoding requests in slices
instead of one long step. The prompt comes first: the decodes are priced at their anchors, and
what the bound leaves after the chunk is the step's draft allowance (draft_allowance), so a
drafting step slices a prompt as a step without a drafter would. Prompt rows take the CPU's
dense path, which the start-up profile (decode-like rows) does not time, so the steps that carry
prompt tokens scale its price by what they measured (BatchPlanner.observe_prefill_step).
"""

from __future__ import annotations

from collections.abc import Callable

from dspark.config import EngineConfig
from dspark.engine.kv_cache import PagePool
from dspark.engine.sequence import Sequence, Status


class BatchPlanner:
    """Owns the waiting and running queues and plans each step under a token and page budget.
    cost: seconds of a target pass of n tokens (policy.CostModel), needed under a decode-stall
    bound."""

    def __init__(self, config: EngineConfig, pool: PagePool, spec, cost: Callable[[int], float] | None = None):
        self.config, self.pool, self.spec, self.cost = config, pool, spec, cost
        stall = config.max_decode_stall_ms
        if stall is not None and cost is None:
            raise ValueError("a decode-stall bound needs the target's cost model")
        self.stall_seconds = stall / 1000 if stall is not None else None
        self.prefill_scale = 1.0  # measured over predicted seconds of steps that carry prompt tokens
        # draft tokens the last planned step may verify in all (None: no limit): what the stall
        # bound leaves beside its prompt chunk
        self.draft_allowance: int | None = None
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def drop(self, seq: Sequence) -> None:
        """Forget a finished or aborted request (its pages are the caller's to free)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def prompts_waiting(self) -> bool:
        """Whether this step may prefill a prompt: a running request is still prefilling, or one
        waits while there is room to admit it (a queue held back by max_num_seqs waits for a
        request to finish, and slices no prompt meanwhile)."""
        if any(s.in_prefill for s in self.running):
            return True
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def plan(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """(decoding requests, [(prefilling request, tokens this step)]), pages reserved."""
        budget = self.config.max_num_batched_tokens
        decode: list[Sequence] = []
        preempted = False
        for seq in list(self.running):
            if seq.in_prefill or seq not in self.running:
                continue
            # Drafts only use pages that are free: when they do not fit, this step decodes plainly
            # (the same tokens), and preemption only ever makes room for a plain step. Otherwise a
            # request would give up its pages for draft slots and be recomputed every step.
            seq.plain_step = False
            need = seq.num_cached + self.spec.max_tokens_for(seq)
            if not self.pool.can_reserve(seq.seq_id, need):
                seq.plain_step = True
                need = seq.num_cached + 1
            while not self.pool.can_reserve(seq.seq_id, need):
                victim = self._pick_victim(exclude=seq)
                if victim is None:
                    break
                self.preempt(victim)
                preempted = True
                if victim in decode:
                    decode.remove(victim)
            if not self.pool.can_reserve(seq.seq_id, need):
                self.preempt(seq)
                preempted = True
                continue
            self.pool.reserve(seq.seq_id, need)
            decode.append(seq)
            budget -= self.spec.priced_tokens_for(seq)
        return decode, self._plan_prefill(decode, budget, preempted)

    # the scale's EMA weight, and how far one step may pull it (a step the machine's noise slowed)
    PREFILL_SCALE_EMA, PREFILL_SCALE_CLAMP = 0.1, 2.0

    def observe_prefill_step(self, tokens: int, seconds: float) -> None:
        """A step whose target pass ran `tokens` tokens, some of them prompt tokens, in `seconds`
        (drafter pass excluded): moves prefill_scale towards its measured / predicted ratio. A
        cost model given by hand (frozen) is taken as it is."""
        if self.cost is None or getattr(self.cost, "frozen", False) or tokens < 1 or not seconds > 0:
            return
        ratio = seconds / self.cost(tokens)
        ratio = min(self.PREFILL_SCALE_CLAMP, max(1 / self.PREFILL_SCALE_CLAMP, ratio))
        self.prefill_scale += self.PREFILL_SCALE_EMA * (ratio - self.prefill_scale)

    def prefill_cap(self, decode_tokens: int) -> int:
        """Most prefill tokens a step whose decoding requests are priced at decode_tokens may add
        under the decode-stall bound: the most whose pass cost(decode_tokens + n) stays within it
        (_bound). At least a page."""
        if self.stall_seconds is None:
            return self.config.max_num_batched_tokens
        return max(self._most_within(decode_tokens, self._bound(decode_tokens)), self.pool.page_size)

    def _bound(self, decode_tokens: int) -> float:
        """The decode-stall bound in the cost model's seconds: the larger of the configured one
        and decode_stall_factor times the decodes' own pass (where the decodes alone come near
        the bound, as with many requests, a large model or a slow machine, a burst of prompts
        would otherwise creep in a page a step), over prefill_scale (a pass with prompt tokens
        costs the cost model's time times that)."""
        bound = max(self.stall_seconds, self.config.decode_stall_factor * self.cost(decode_tokens))
        return bound / self.prefill_scale

    def _most_within(self, tokens: int, bound: float) -> int:
        """The most tokens n (up to the token budget) that a pass of `tokens` more may add with
        cost(tokens + n) within bound; 0 if none."""
        top = self.config.max_num_batched_tokens
        if self.cost(tokens + top) <= bound:
            return top
        lo, hi = 0, top  # cost(tokens + lo) within the bound (or lo = 0), cost(... + hi) past it
        while hi - lo > 1:  # the cost never falls as tokens grow (CostModel prices a monotone envelope)
            mid = (lo + hi) // 2
            if self.cost(tokens + mid) <= bound:
                lo = mid
            else:
                hi = mid
        return lo

    def _plan_prefill(self, decode: list[Sequence], budget: int, preempted: bool) -> list[tuple[Sequence, int]]:
        prefill: list[tuple[Sequence, int]] = []
        self.draft_allowance = None
        # Prefill leaves free the pages the decoding requests need to draft again next step: a chunk
        # that took them would switch their drafting off, and then be preempted (it is the newest)
        # and recomputed, step after step. vLLM keeps lookahead slots free before admitting likewise.
        # requests mid-prefill first, then new arrivals, while tokens and pages last
        candidates = [s for s in self.running if s.in_prefill] + list(self.waiting)
        if not candidates:  # most steps have nothing to prefill
            return prefill
        if decode:  # the decode-stall bound, priced only where a prompt could stall the decodes
            # the decodes at their anchors: the prompt before their drafts (draft_allowance)
            budget = min(budget, self.prefill_cap(len(decode)))
        keep_free = sum(self.pool.pages_needed(s.seq_id, s.num_cached + 2 * self.spec.max_tokens_for(s))
                        for s in decode)
        for seq in candidates:
            if budget <= 0:
                break
            if seq.status is Status.WAITING:
                # as vLLM: no admissions in a step that preempted (a victim let in again at once
                # would only be preempted again)
                if len(self.running) >= self.config.max_num_seqs or preempted:
                    break
                self._match_prefix(seq)
            n = min(budget, seq.prefill_target - seq.num_cached)
            if not seq.output_ids and n == seq.prefill_target - seq.num_cached == 0:
                continue
            room = self.pool.capacity(seq.seq_id) - seq.num_cached - keep_free * self.pool.page_size
            n = min(n, room)
            # admitted only with room for its whole prompt and first token, as in vLLM
            if n <= 0 or (seq.status is Status.WAITING and room <= seq.prefill_target - seq.num_cached):
                if seq.status is Status.WAITING:  # gives back the cached pages it matched
                    self.pool.free(seq.seq_id)
                    seq.num_cached = 0
                break
            if seq.status is Status.WAITING:
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                self.pool.count_admission(seq.prefill_target, seq.num_cached)
            self.pool.reserve(seq.seq_id, seq.num_cached + n)
            prefill.append((seq, n))
            budget -= n
        if decode and prefill and self.stall_seconds is not None:
            tokens = len(decode) + sum(n for _, n in prefill)
            self.draft_allowance = self._most_within(tokens, self._bound(len(decode)))
        return prefill

    def _match_prefix(self, seq: Sequence) -> None:
        """Start a request from the cached pages its tokens begin with (prefix caching), leaving
        at least one token to compute. A request that asks for its prompt's logprobs computes
        every position."""
        if self.pool.prefix_caching and seq.params.prompt_logprobs is None:
            seq.num_cached = self.pool.match_prefix(seq.seq_id, seq.all_ids, seq.prefill_target - 1, seq.prefix_salt)

    def _pick_victim(self, exclude: Sequence) -> Sequence | None:
        """The newest running request admitted after `exclude`; None when `exclude` is the newest,
        which then yields its own pages: first come, first served, as in vLLM."""
        after = self.running[self.running.index(exclude) + 1:]
        return after[-1] if after else None

    def preempt(self, seq: Sequence) -> None:
        """Free a request's pages and queue it for recomputation from its tokens so far."""
        self.pool.free(seq.seq_id)
        self.spec.release(seq.seq_id)
        seq.num_cached = 0
        seq.plain_step = False
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.insert(0, seq)
