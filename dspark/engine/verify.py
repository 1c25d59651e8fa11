"""One verification pass: lay out the ragged target batch (prefill chunks, chains and
trees), then accept losslessly. Pure bookkeeping around sampling.py and tree.py."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from dspark.engine.logits_processors import process_logits
from dspark.engine.sampling import accept_chain, position_noise, race_sample, warp_logits
from dspark.engine.sequence import Sequence
from dspark.engine.tree import DraftTree, accept_trees
from dspark.models import cpu_ops


@dataclass
class Work:
    """What one request contributes to a step, and what it got back."""

    seq: Sequence
    kind: str  # "decode" | "prefill"
    tokens: list[int]
    drafts: list[int] = field(default_factory=list)
    tree: DraftTree | None = None
    samples: bool = False  # a token is sampled from this work's last verified row(s)
    q: torch.Tensor | None = None  # [len(drafts), V] draft distributions (None: one-hot drafts)
    num_proposed: int = 0  # tokens the proposer drafted (statistics)
    looked_up: bool = False  # the drafts are a looked-up chain (the n-gram assist)
    first_row: int = 0
    first_logit: int = 0  # this work's first row in the pass's logits (layout sets both)
    kept_rows: list[int] = field(default_factory=list)  # offsets into tokens that stay cached
    new_tokens: list[int] = field(default_factory=list)
    logprobs: list | None = None  # logprobs.TokenLogprob per new token, when the request asks

    @property
    def num_verified(self) -> int:
        return len(self.tree) if self.tree is not None else len(self.drafts)

    def depths(self) -> list[int]:
        """How far past this work's first token each of its tokens sits (a tree node: its depth)."""
        return [0, *self.tree.depths] if self.tree is not None else list(range(len(self.tokens)))

    def positions(self) -> list[int]:
        start = self.seq.num_cached
        return [start + d for d in self.depths()]

    @property
    def prompt_rows(self) -> int:
        """Leading tokens that are prompt tokens: quantized linears take their dense path for them
        (a request prefilled again after a preemption also feeds tokens it had generated); none
        for a request whose prompt takes the decode kernels."""
        if self.kind != "prefill" or self.seq.prompt_on_decode_kernels:
            return 0
        return max(0, min(len(self.tokens), len(self.seq.prompt_ids) - self.seq.num_cached))

    @property
    def num_logit_rows(self) -> int:
        if self.kind == "decode":
            return len(self.tokens)
        return 1 if self.samples else 0

    def logit_rows(self) -> list[int]:
        if self.kind == "decode":
            return list(range(self.first_row, self.first_row + len(self.tokens)))
        return [self.first_row + len(self.tokens) - 1] if self.samples else []


def layout(works: list[Work]) -> tuple[list, list[int], str, list | None, torch.Tensor | None]:
    """Items, logit rows, mask kind, custom masks and positions for ModelRunner.forward."""
    row = logit = 0
    for w in works:
        w.first_row, w.first_logit = row, logit
        row += len(w.tokens)
        logit += w.num_logit_rows
    items = [(w.seq, w.tokens) for w in works]
    rows = [r for w in works for r in w.logit_rows()]
    if not any(w.tree is not None for w in works):
        return items, rows, "causal", None, None
    # chains and prefill chunks beside the trees stay causal (None): attended like in a causal
    # pass, so a prompt prefilled beside trees gets the bits it would get beside chains
    masks = [w.tree.mask() if w.tree is not None else None for w in works]
    positions = torch.tensor([p for w in works for p in w.positions()])
    return items, rows, "custom", masks, positions


def _warp_rows(sampled: list[tuple[Work, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities [N, V] of every request's verified rows, concatenated, under its temperature,
    top-k, top-p and min-p; and the rows per request [R]."""
    logits = torch.cat([rows for _, rows in sampled])
    counts = torch.tensor([rows.shape[0] for _, rows in sampled])
    params = [w.seq.params for w, _ in sampled]

    def per_row(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).repeat_interleave(counts).to(logits.device)

    probs = warp_logits(logits, per_row([q.temperature for q in params], torch.float32),
                        per_row([q.top_k for q in params], torch.long),
                        per_row([q.top_p for q in params], torch.float32),
                        per_row([q.min_p for q in params], torch.float32))
    return probs, counts


def _warp_padded(sampled: list[tuple[Work, torch.Tensor]], width: int) -> torch.Tensor:
    """[R, width, V] probabilities of each request's verified rows (see _warp_rows); zero past its
    own rows. Only the real rows are warped: a batch of short chains beside one long looked-up
    chain would otherwise sort padding."""
    probs, counts = _warp_rows(sampled)
    out = probs.new_zeros(len(sampled), width, probs.shape[-1])
    # request by request, row by row: the order of the concatenated rows
    out[(torch.arange(width) < counts[:, None]).to(probs.device)] = probs
    return out


def _uniforms(seqs: list[Sequence], needs: list[list[int]], width: int) -> torch.Tensor:
    """[R, width] uniforms. Request r draws exactly len(needs[r]) + 1 from its own generator: into
    the columns needs[r], then the last column (the sampling draw). What a seeded request consumes
    so depends only on its own drafts, never on what else shares the batch (greedy ones draw none)."""
    u = torch.full((len(seqs), width), 0.5)
    for r, s in enumerate(seqs):
        if s.generator is not None:
            x = torch.rand(len(needs[r]) + 1, generator=s.generator)
            if needs[r]:
                u[r, needs[r]] = x[:-1]
            u[r, -1] = x[-1]
    return u


def _tree_needs(trees: list[DraftTree]) -> list[list[int]]:
    """The uniform columns accept_trees reads for each tree: d * K + j for depth d, child j."""
    kids = [Counter(t.parents) for t in trees]
    K = max((max(k.values(), default=0) for k in kids), default=0)
    return [[d * K + j for d in range(max(t.depths, default=0)) for j in range(max(k.values(), default=0))]
            for t, k in zip(trees, kids)]


def _draft_probs(works: list[Work], K: int, V: int, device: torch.device) -> torch.Tensor | None:
    """[R, K, V] draft distributions of the chains' verified tokens (one-hot rows where a draft is
    deterministic), or None when every draft is one-hot."""
    if K == 0 or all(w.q is None for w in works):
        return None
    q = torch.zeros(len(works), K, V, device=device)
    for r, w in enumerate(works):
        n = len(w.drafts)
        if not n:
            continue
        if w.q is not None:
            q[r, :n] = w.q[:n]
        else:
            q[r, torch.arange(n), torch.tensor(w.drafts, device=device)] = 1.0
    return q


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [R] (the first of equal maxima). On CPU the fused kernel: torch's argmax
    over bf16 is several times slower than over a float copy, which itself costs about a tenth of
    a millisecond a row of a 49k vocabulary (a few percent of a small model's step)."""
    ops = cpu_ops.for_tensor(logits) if logits.dim() == 2 and logits.shape[-1] and logits.stride(-1) == 1 else None
    if ops is not None:
        return ops.argmax_rows(logits)
    return (logits.float() if logits.device.type == "cpu" else logits).argmax(-1)


def accept(works: list[Work], logits: torch.Tensor | None) -> None:
    """Fill kept_rows and new_tokens of every work from the target logits of its rows."""
    logits = process_logits(works, logits)
    sampled, greedy = [], []
    for w in works:
        at, n = w.first_logit, w.num_logit_rows
        if n and w.seq.params.greedy:
            greedy.append((w, at, n))
        elif n:
            sampled.append((w, logits[at:at + n]))
        if w.kind == "prefill":
            w.kept_rows = list(range(len(w.tokens)))
    if greedy:
        best = greedy_tokens(logits).tolist()
        for w, start, n in greedy:
            _accept_greedy(w, best[start:start + n])
    seeded = [(w, lg) for w, lg in sampled if w.seq.seed is not None]
    if seeded:
        _accept_seeded(seeded)
    unseeded = [(w, lg) for w, lg in sampled if w.seq.seed is None]
    chains = [(w, lg) for w, lg in unseeded if w.tree is None]
    trees = [(w, lg) for w, lg in unseeded if w.tree is not None]
    dev = logits.device if logits is not None else None
    if chains:
        R, K = len(chains), max(len(w.drafts) for w, _ in chains)
        V = logits.shape[-1]
        drafts = torch.zeros(R, max(K, 1), dtype=torch.long)
        for r, (w, _) in enumerate(chains):
            drafts[r, :len(w.drafts)] = torch.tensor(w.drafts, dtype=torch.long)
        seqs = [w.seq for w, _ in chains]
        p = _warp_padded(chains, K + 1)
        lens = torch.tensor([len(w.drafts) for w, _ in chains], device=dev)
        q = _draft_probs([w for w, _ in chains], K, V, dev)
        u = _uniforms(seqs, [list(range(len(w.drafts))) for w, _ in chains], K + 1).to(dev)
        n_acc, nxt = accept_chain(p, drafts[:, :K].to(dev), q, lens, u[:, :K], u[:, K])
        for r, (w, _) in enumerate(chains):
            a = int(n_acc[r])
            if w.kind == "decode":
                w.kept_rows = list(range(a + 1))
            w.new_tokens = w.drafts[:a] + [int(nxt[r])]
    if trees:
        N1 = max(len(w.tokens) for w, _ in trees)
        seqs = [w.seq for w, _ in trees]
        p = _warp_padded(trees, N1)
        D = max(max(w.tree.depths, default=0) for w, _ in trees)
        u = _uniforms(seqs, _tree_needs([w.tree for w, _ in trees]), D * N1 + 1).to(dev)
        paths, nxt = accept_trees(p, [w.tree for w, _ in trees], u)
        for r, (w, _) in enumerate(trees):
            w.kept_rows = [0] + paths[r]
            w.new_tokens = [w.tree.tokens[i - 1] for i in paths[r]] + [int(nxt[r])]


def _accept_seeded(seeded: list[tuple[Work, torch.Tensor]]) -> None:
    """Seeded requests: every verified row is sampled with the noise of the output position it
    predicts, and drafts are kept while they equal those samples (greedy acceptance against
    them). Each committed token is then exactly the one plain decoding with this seed samples at
    its position, so the output depends on neither the drafts nor how many were verified (the
    load-aware policy's choice varies with timing). The price: a sampled draft survives with
    probability P(draft == sample) rather than rejection sampling's sum(min(p, q)); the
    drafter races with the same noise (chain_walk.py), which keeps the two close."""
    probs, counts = _warp_rows(seeded)
    # the output position each row samples: a decode row's depth past the anchor; a prefill's one
    # row samples the first output token
    at = [(w.seq.seed, len(w.seq.output_ids) + d) for w, _ in seeded
          for d in (w.depths() if w.kind == "decode" else [0])]
    noise = position_noise([s for s, _ in at], [j for _, j in at], probs.shape[-1], probs.device)
    best = race_sample(probs, noise).tolist()
    start = 0
    for (w, _), n in zip(seeded, counts.tolist()):
        _accept_greedy(w, best[start:start + n])
        start += n


def _accept_greedy(w: Work, best: list[int]) -> None:
    """Greedy acceptance from the target's argmax at each verified row: keep drafts while they
    equal it, then take it. This is exactly what rejection sampling does against a one-hot target
    (the same argmax, the same tie-break), without [R, K+1, V] probabilities."""
    if w.tree is None:
        a = 0
        while a < len(w.drafts) and w.drafts[a] == best[a]:
            a += 1
        if w.kind == "decode":
            w.kept_rows = list(range(a + 1))
        w.new_tokens = w.drafts[:a] + [best[a]]
        return
    t = w.tree
    children: dict[int, list[int]] = {}
    for i, par in enumerate(t.parents, start=1):
        children.setdefault(par, []).append(i)
    cur, path = 0, []
    while (nxt := next((c for c in children.get(cur, ()) if t.tokens[c - 1] == best[cur]), None)) is not None:
        path.append(nxt)
        cur = nxt
    w.kept_rows = [0] + path
    w.new_tokens = [t.tokens[i - 1] for i in path] + [best[cur]]
