"""Speculation with a DSpark/DFlash block drafter: one drafter pass per step for every
decoding request, a policy that picks verification lengths from the confidences, and
the drafter's incremental context cache."""

from __future__ import annotations

import time

import torch

from dspark.config import SpecConfig
from dspark.engine.assist import NgramAssist
from dspark.engine.attention import make_backend
from dspark.engine.drafter_context import DrafterContext
from dspark.engine.kv_cache import KVCache
from dspark.engine.policy import make_policy
from dspark.engine.sampling import sample, warp_logits
from dspark.engine.sequence import Sequence
from dspark.engine.spec import SpecRunner
from dspark.engine.structured import DraftConstraint, TreeConstraint
from dspark.engine.tree import DraftTree, build_trees
from dspark.models.drafters.checkpoint import load_drafter
from dspark.models.packed import pack_linears


class NeuralSpecRunner(SpecRunner):
    """Drives a BlockDrafter over the shared page pool with its own K/V tensors."""

    name = "dspark"

    def __init__(self, cfg: SpecConfig, engine, path: str):
        super().__init__(cfg, engine)
        # frozen: the engine never trains it, and frozen heads keep float32 copies (MarkovHead)
        self.drafter = load_drafter(path, engine.model, engine.dtype, engine.device).requires_grad_(False)
        pack_linears(self.drafter.layers)  # the backbone's projections; the heads' weights are read directly
        pack_linears(self.drafter, only=("fc",))
        dc = self.drafter.config
        self.name = dc.kind
        if cfg.block_size is not None and cfg.block_size > dc.num_drafts:
            raise ValueError(f"block size {cfg.block_size} exceeds the {dc.num_drafts} tokens this drafter emits")
        self.block_size = cfg.block_size or dc.num_drafts
        # a block size the user set caps looked-up chains too; the drafter's own lets them grow
        self.assist = NgramAssist(cfg.ngram_assist, max(cfg.ngram_max, cfg.ngram_assist), self.block_size,
                                  cfg.block_size or cfg.ngram_assist_max_len) if cfg.ngram_assist else None
        self.capture_layers = tuple(dc.target_layer_ids)
        pool = engine.pool
        self.kv = KVCache(dc.num_hidden_layers, engine.kv_pages, pool.page_size, dc.num_key_value_heads,
                          dc.head_dim, engine.dtype, engine.device)
        # drafts need no bit-equality with anything, so the drafter attends in the faster dtypes
        self.attn = make_backend(engine.config.attention_backend, engine.device, exact=False)
        # load-aware needs the target's cost profile: calibrate() measures it once the engine is
        # complete (CUDA graphs change what a pass costs)
        self.policy = None if cfg.policy == "load-aware" else make_policy(cfg.policy, cfg.threshold, None)
        self._q: dict[int, torch.Tensor] = {}
        self.draft_seconds: dict[int, float] = {}  # EMA of a drafter pass's wall time, by batch size
        self.num_draft_passes = 0
        self._skip_steps, self._backoff, self.gain = 0, self.MIN_BACKOFF, 1.0
        self.context = DrafterContext(self.drafter, self.kv, pool, engine.device)

    def calibrate(self) -> None:
        if self.policy is None:
            from dspark.engine.profile import load_or_measure

            self.policy = make_policy(self.cfg.policy, self.cfg.threshold, load_or_measure(self.engine))

    def observe_step(self, tokens: int, seconds: float) -> None:
        cost = getattr(self.policy, "cost", None)
        if cost is not None:
            cost.observe(tokens, seconds)

    def max_tokens_for(self, seq: Sequence) -> int:
        budget = self.draft_budget(seq)
        if not budget:
            return 1
        nodes = self.cfg.tree_budget if self.cfg.tree else budget
        if self.assist is not None:  # room for a looked-up chain longer than a block
            nodes = max(nodes, self.lookup_budget(seq))
        return max(1 + nodes, self.drafter.config.block_size)

    @property
    def longest_chain(self) -> int:
        return self.assist.max_len if self.assist is not None else self.block_size

    def lookup_budget(self, seq: Sequence) -> int:
        """Most looked-up tokens seq may verify this step."""
        return self.draft_budget(seq, self.assist.span(seq.seq_id))

    def context_headroom(self) -> int:
        return max(self.cfg.tree_budget if self.cfg.tree else 0, self.drafter.config.block_size)

    # While the load-aware policy finds (on a running average) that even its best choice loses to
    # plain decoding once the drafter's own pass is paid for, drafting pauses for a number of
    # steps that doubles on each failed retry (up to MAX_BACKOFF), then the drafter is tried again.
    MIN_BACKOFF, MAX_BACKOFF, GAIN_EMA, DRAFT_TIME_EMA = 4, 64, 0.25, 0.2

    def estimated_draft_seconds(self, R: int) -> float:
        """Measured drafter pass time at batch R, from the nearest batch size seen (0 before any)."""
        if not self.draft_seconds:
            return 0.0
        near = min(self.draft_seconds, key=lambda n: abs(n - R))
        return self.draft_seconds[near] * max(1.0, R / near)

    def _record_pass(self, R: int, seconds: float) -> None:
        self.num_draft_passes += 1
        priced = bool(self.draft_seconds)  # the very first choice took the drafter to be free
        old = self.draft_seconds.get(R, seconds)
        self.draft_seconds[R] = old + self.DRAFT_TIME_EMA * (seconds - old)
        gain = getattr(self.policy, "last_gain", None)
        if gain is None or not priced:
            return
        self.gain += self.GAIN_EMA * (gain - self.gain)
        if self.gain < 1.0:
            self._skip_steps = self._backoff
            self._backoff = min(2 * self._backoff, self.MAX_BACKOFF)
        else:
            self._backoff = self.MIN_BACKOFF

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], other_tokens: int = 0) -> dict[int, list[int] | DraftTree]:
        self._q.clear()
        self._proposed.clear()  # a request that drafts nothing this step proposed nothing
        if self.assist is not None:
            self.assist.clear()
        budgets = [self.draft_budget(s) for s in seqs]
        active = [s for s, b in zip(seqs, budgets) if b > 0]
        if not active:
            return {}
        other_tokens += len(seqs) - len(active)  # their anchors ride in the pass, as prefill does
        if self._skip_steps > 0:
            self._skip_steps -= 1
            return {}
        t0 = time.perf_counter()
        budgets = [b for b in budgets if b > 0]
        looked = self.assist.look_up(active, [self.lookup_budget(s) for s in active]) if self.assist else {}
        neural = [s for s in active if s.seq_id not in looked]
        h = self._block_pass(neural) if neural else None
        draft_seconds = self.estimated_draft_seconds(len(neural)) if neural else 0.0
        if self.cfg.tree:  # looked-up requests verify a chain beside the others' trees
            out = self._propose_trees(neural, self.drafter.draft_logits(h) if neural else None, looked,
                                      other_tokens, draft_seconds)
        else:
            out = self._propose_chains(active, budgets, neural, h, looked, other_tokens, draft_seconds)
        if neural:
            self._record_pass(len(neural), time.perf_counter() - t0)
        return out

    def _block_pass(self, active: list[Sequence]) -> torch.Tensor:
        """The drafter's forward over [anchor, MASK...] per request -> [R, num_drafts, H] draft slots."""
        dc = self.drafter.config
        B, R = dc.block_size, len(active)
        items = [(s, [s.output_ids[-1]] + [dc.mask_token_id] * (B - 1)) for s in active]
        batch, ids, pos = self.engine.runner.batch_layout(items, mask="full")
        out = self.graphs.run(batch, ids) if self.graphs is not None else None
        if out is None:
            self.attn.plan(batch)
            out = self.block_forward(ids, pos, self.attn)
        return self.drafter.draft_hidden(out[0].view(R, B, -1))

    def _propose_chains(self, active: list[Sequence], budgets: list[int], neural: list[Sequence],
                        h: torch.Tensor | None, looked: dict[int, list[int]],
                        other_tokens: int, draft_seconds: float) -> dict[int, list[int]]:
        """Drafted chains for `neural`, looked-up ones for the rest, cut to what the policy admits
        (the confidence head's estimates for drafts, the assist's running rates for lookups)."""
        drafted, conf, stops = self._draft_chains(neural, h) if neural else ([], None, [])
        if not looked:  # every request drafted: the rows are already in active's order
            lengths = self.policy.choose(budgets, conf, other_tokens, draft_seconds)
            return {s.seq_id: self._send_draft(s.seq_id, d, n, stop)
                    for s, d, n, stop in zip(active, drafted, lengths, stops)}
        by_seq = {s.seq_id: r for r, s in enumerate(neural)}
        rows = [by_seq.get(s.seq_id) for s in active]  # None: looked up
        width = max([len(c) for c in looked.values()] + [self.drafter.config.num_drafts])
        prior = self.assist.prior(width)
        budgets = [b if r is not None else len(looked[s.seq_id]) for s, b, r in zip(active, budgets, rows)]
        pad = width - self.drafter.config.num_drafts  # drafted rows: zeros past their block
        conf_rows = torch.stack([prior if r is None else torch.nn.functional.pad(conf[r], (0, pad)) for r in rows])
        lengths = self.policy.choose(budgets, conf_rows, other_tokens, draft_seconds)
        return {s.seq_id: self._send_lookup(s.seq_id, looked[s.seq_id], n) if r is None
                else self._send_draft(s.seq_id, drafted[r], n, stops[r]) for s, r, n in zip(active, rows, lengths)}

    def _send_draft(self, seq_id: int, drafts: list[int], n: int, stop: int | None) -> list[int]:
        """The first n drafts (fewer where a grammar stops them), counted as proposed in full."""
        self._proposed[seq_id] = self.drafter.config.num_drafts
        return drafts[:n if stop is None else min(n, stop)]

    def _send_lookup(self, seq_id: int, chain: list[int], n: int) -> list[int]:
        """The first n tokens of a looked-up chain, counted as proposed in full."""
        self._proposed[seq_id] = len(chain)
        return self.assist.send(seq_id, chain, n)

    def _draft_chains(self, active: list[Sequence], h: torch.Tensor) -> tuple[list[list[int]], torch.Tensor, list]:
        """Walk the Markov head over the draft slots h [R, num_drafts, H]: per request its drafts,
        their confidences [R, num_drafts] (on the CPU) and where a grammar stops them (None: no
        stop). Sampled requests' draft distributions go to self._q."""
        dc, dev = self.drafter.config, self.engine.device
        nd, R = dc.num_drafts, len(active)
        greedy = all(s.params.greedy for s in active)
        # Greedy drafts are one-hot, so they walk the (reduced) draft vocabulary and map the picks
        # back, skipping a [R, V] scatter per slot; sampled drafts need q over the target's.
        base = self.drafter.draft_logits(h) if greedy else self.drafter.head(h)  # [R, nd, V or Vd]
        to_target = self.drafter.draft_to_target if greedy else None
        if not greedy:  # the warping settings and each request's uniforms, only when sampling
            temp = torch.tensor([s.params.temperature for s in active], device=dev)
            top_k = torch.tensor([s.params.top_k for s in active], device=dev)
            top_p = torch.tensor([s.params.top_p for s in active], device=dev)
            min_p = torch.tensor([s.params.min_p for s in active], device=dev)
            u = torch.full((R, nd), 0.5)
            for r, s in enumerate(active):
                if s.generator is not None:
                    u[r] = torch.rand(nd, generator=s.generator)
            u = u.to(dev)
        prev = torch.tensor([s.output_ids[-1] for s in active], device=dev)
        grammars = [s.grammar for s in active]
        constraint = DraftConstraint(grammars, self.engine.model_config.vocab_size, to_target) \
            if any(g is not None for g in grammars) else None
        tokens, probs, prevs = [], [], []
        try:
            for k in range(nd):
                prevs.append(prev)
                logits = self.drafter.step_logits(base[:, k], prev)
                if constraint is not None:
                    logits = constraint.mask(logits, k)
                if greedy:
                    prev = logits.argmax(-1)
                    if to_target is not None:
                        prev = to_target[prev]
                else:
                    q = warp_logits(logits, temp, top_k, top_p, min_p)
                    prev = sample(q, u[:, k])
                    probs.append(q)
                tokens.append(prev)
                if constraint is not None:
                    constraint.advance(prev, k)
        finally:  # the matchers go back to their requests' committed state whatever happens
            stops = constraint.finish() if constraint is not None else [None] * R
        conf = self.drafter.confidence(h, torch.stack(prevs, 1))
        conf = torch.sigmoid(conf).float().cpu() if conf is not None else self._acceptance_prior(R, nd)
        for r, s in enumerate(active):
            if probs and not s.params.greedy:
                self._q[s.seq_id] = torch.stack([p[r] for p in probs])
        return torch.stack(tokens, 1).tolist(), conf, stops

    def block_forward(self, ids: torch.Tensor, pos: torch.Tensor, attn) -> tuple[torch.Tensor]:
        """The drafter's block forward -> (final hidden,): run eagerly, or captured by a GraphPool."""
        return (self.drafter.block_hidden(ids, pos, attn, self.kv),)

    def _propose_trees(self, active: list[Sequence], base: torch.Tensor | None, looked: dict[int, list[int]],
                       other_tokens: int, draft_seconds: float) -> dict[int, DraftTree | list[int]]:
        """base: [R, num_drafts, draft vocab] logits of `active` (None when it is empty).
        Top-k children per node through the Markov head, pruned to the node budget, then to
        what the policy admits (load-aware: by joint draft probability, like a chain's survival;
        the looked-up chains compete for the same pass by their running survival). Children are
        tried as one-hot proposals, so no q is kept."""
        trees = self._build_trees(active, base) if active else []
        chains = list(looked.items())
        survival = [[t.scores[i] for i in t.ranked()] for t in trees]
        if chains:
            alive = self.assist.prior(max(len(c) for _, c in chains)).cumprod(0).tolist()
            survival += [alive[:len(c)] for _, c in chains]
        sizes = self.policy.choose_nodes(survival, other_tokens, draft_seconds)
        out: dict[int, DraftTree | list[int]] = {sid: self._send_lookup(sid, chain, n)
                                                 for (sid, chain), n in zip(chains, sizes[len(trees):])}
        for s, t, n in zip(active, trees, sizes):
            self._proposed[s.seq_id] = self.cfg.tree_budget
            if n == len(t) and n:  # the whole tree (fixed): as built, no re-ranking
                out[s.seq_id] = t
            else:  # pruned to the admitted nodes; none admitted: verify the anchor alone
                out[s.seq_id] = t.top(n) if n else []
        return out

    def _build_trees(self, active: list[Sequence], base: torch.Tensor) -> list[DraftTree]:
        """Each request's draft tree, at most its draft budget deep, under its grammar if any."""
        anchors = torch.tensor([s.output_ids[-1] for s in active], device=base.device)
        depth = [self.draft_budget(s) for s in active]
        grammars = [s.grammar for s in active]
        constraint = TreeConstraint(grammars, self.engine.model_config.vocab_size, self.drafter.draft_to_target) \
            if any(g is not None for g in grammars) else None
        return build_trees(base[:, :max(depth)], anchors, self.drafter.markov_head,
                           [self.cfg.tree_budget] * len(active), depth, self.cfg.tree_topk,
                           vocab=self.drafter.draft_to_target, constraint=constraint)

    def _acceptance_prior(self, R: int, nd: int) -> torch.Tensor:
        """Without a confidence head, each position's running acceptance rate stands in."""
        st = self.engine.spec_stats
        rates = [(a + 1) / (v + 2) for a, v in zip(st.accepted_per_pos, st.verified_per_pos)]
        rates = (rates + [0.5] * nd)[:nd]
        return torch.tensor(rates).expand(R, nd)

    def draft_probs(self, rows, K: int, V: int, proposals) -> torch.Tensor | None:
        if not self._q or K == 0:
            return None
        q = torch.zeros(len(rows), K, V, device=self.engine.device)
        for r, (seq, _, n, d) in enumerate(rows):
            if not n:
                continue
            stored = self._q.get(seq.seq_id)
            if stored is not None:
                q[r, :n] = stored[:n]
            else:  # a greedy request's draft is one-hot
                q[r, torch.arange(n), torch.tensor(d, device=q.device)] = 1.0
        return q

    @torch.inference_mode()
    def commit(self, ctx_rows, result) -> None:
        if self.assist is not None and self.assist.verified:
            for seq, _, kept in ctx_rows:
                self.assist.observe(seq.seq_id, len(kept) - 1)
        self.context.add(ctx_rows, result.feats, flush=self._skip_steps == 0)

    def release(self, seq_id: int) -> None:
        if self.assist is not None:
            self.assist.forget(seq_id)

    def looked_up(self, seq: Sequence) -> bool:
        return self.assist is not None and self.assist.verified.get(seq.seq_id, 0) > 0

    def context_pending(self) -> bool:
        return bool(self.context.pending)
