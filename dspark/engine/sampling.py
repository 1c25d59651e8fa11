"""Sampling and lossless verification, vectorized over the batch.

Randomness comes in as uniforms, so every sampling decision below is a tensor op
(inverse-CDF sampling instead of torch.multinomial, which cannot take per-row
generators). An unseeded request draws them from its own generator. A seeded
one samples each output position by an exponential race whose noise comes from
(seed, position) alone, so its tokens are what plain decoding with that seed
gives, whatever was drafted, verified or batched beside it (see verify.py).
"""

from __future__ import annotations

import functools

import torch


def warp_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p (vLLM's order); rows with
    temperature 0 become one-hot at the argmax. logits [..., V]; the parameters are [...] tensors."""
    logits = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    # shifted so the largest is 0: a tiny temperature sends the rest to -inf, never to inf - inf
    x = (logits - logits.amax(-1, keepdim=True)) / t[..., None]
    if min_p is not None and bool((min_p > 0).any()):
        # p < min_p * p_max, in log space with the largest at 0 (the largest itself always stays)
        x = x.masked_fill(x < min_p.float().log()[..., None], float("-inf"))
    V = x.shape[-1]
    k = torch.where(top_k <= 0, torch.full_like(top_k, V), top_k.clamp(max=V))
    need_filter = bool((k < V).any()) or bool((top_p < 1).any())
    if need_filter:
        # where every row keeps at most kmax tokens, its survivors are among its kmax largest:
        # a partial top-k instead of sorting the whole vocabulary (the common top_k=20..50 case)
        kmax = int(k.max())
        if kmax < V:
            sorted_x, order = x.topk(kmax, dim=-1)
        else:
            sorted_x, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(sorted_x.shape[-1], device=x.device)
        # top-k first, then top-p over the renormalised survivors (vLLM's and HF's order)
        sorted_x = sorted_x.masked_fill(rank >= k[..., None], float("-inf"))
        probs_sorted = sorted_x.softmax(-1)
        before = probs_sorted.cumsum(-1) - probs_sorted  # mass strictly above this token
        sorted_x = sorted_x.masked_fill(before >= top_p[..., None].float(), float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter_(-1, order, sorted_x)
    probs = x.softmax(-1)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[..., None], onehot, probs)
    return probs


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of probs [..., V] from uniforms u [...]."""
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    idx = torch.searchsorted(cdf, (u[..., None] * total).contiguous(), right=True).squeeze(-1)
    # guard against rounding past the last non-zero entry
    idx = idx.clamp(max=probs.shape[-1] - 1)
    bad = probs.gather(-1, idx[..., None]).squeeze(-1) <= 0
    if bool(bad.any()):
        idx = torch.where(bad, probs.argmax(-1), idx)
    return idx


def accept_chain(p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None, lens: torch.Tensor,
                 u_accept: torch.Tensor, u_sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over a padded batch of chains.

    p: [R, K+1, V] target probabilities at each verified slot; draft: [R, K] draft tokens;
    q: [R, K, V] draft probabilities, or None when the draft is deterministic (one-hot);
    lens: [R] drafted tokens per row (<= K); u_accept: [R, K], u_sample: [R] uniforms.
    Returns (accepted count [R], the correction-or-bonus token [R]).
    Token j is kept with probability min(1, p/q); at the first rejection the token is drawn
    from normalize((p - q)+); when all pass, the bonus is drawn from p at slot lens.
    """
    R, K1, V = p.shape
    K = K1 - 1
    rows = torch.arange(R, device=p.device)
    if K == 0:
        return torch.zeros(R, dtype=torch.long, device=p.device), sample(p[:, 0], u_sample)
    p_tok = p[:, :K].gather(-1, draft[..., None]).squeeze(-1)
    q_tok = torch.ones_like(p_tok) if q is None else q.gather(-1, draft[..., None]).squeeze(-1)
    ok = u_accept * q_tok < p_tok  # u < p/q without dividing by zero
    ok &= torch.arange(K, device=p.device)[None] < lens[:, None]
    n_acc = ok.long().cumprod(-1).sum(-1)
    final = p[rows, n_acc]  # [R, V]
    rejected = n_acc < lens
    if bool(rejected.any()):
        slot = n_acc.clamp(max=K - 1)
        if q is None:
            q_row = torch.zeros_like(final).scatter_(-1, draft[rows, slot][:, None], 1.0)
        else:
            q_row = q[rows, slot]
        resid = (final - q_row).clamp(min=0)
        # an all-zero residual only happens when p == q, where rejection has probability 0
        resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, final)
        final = torch.where(rejected[:, None], resid, final)
    return n_acc, sample(final, u_sample)


_M32 = (1 << 32) - 1
RACE_BLOCK = 256  # tokens per block of the two-level race below


def _pcg32(x):  # noqa: ANN001, ANN202 - a Python int or an int64 tensor, each below 2**32
    """PCG's output permutation as a 32-bit hash (Jarzynski and Olano, 2020). Every product stays
    below 2**63, so int64 tensors compute it exactly, on any device, as Python ints do."""
    state = (x * 747796405 + 2891336453) & _M32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _M32
    return (word >> 22) ^ word


def position_noise(seeds: list[int], positions: list[int], vocab_size: int,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """[len(positions), blocks + RACE_BLOCK] Exp(1) draws for race_sample, row i a fixed function
    of (seeds[i], positions[i]) computed by integer hashing: a position's noise never depends on
    what was drawn before it, so a seeded request samples position j alike however its steps were
    cut, and it is the same noise on every device. One call serves a whole batch of rows."""
    keys = {s: _pcg32((s & _M32) ^ _pcg32((s >> 32) & _M32)) for s in set(seeds)}  # a request's rows share one
    rows = [_pcg32((keys[s] + j) & _M32) for s, j in zip(seeds, positions)]
    slots = _slot_hashes(-(-vocab_size // RACE_BLOCK) + RACE_BLOCK, torch.device(device or "cpu"))
    h = _pcg32(torch.tensor(rows, dtype=torch.int64, device=device)[:, None] ^ slots)
    u = ((h >> 8).float() + 0.5) * 2.0 ** -24  # 24 bits, exact in float32, strictly inside (0, 1)
    return -torch.log1p(-u)


@functools.lru_cache(maxsize=8)
def _slot_hashes(width: int, device: torch.device) -> torch.Tensor:
    """The slots' hashes, the same for every row: made once per device, not copied there each step."""
    return _pcg32(torch.arange(width, device=device))


def race_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [N, V] by an exponential race in two levels: the block of
    RACE_BLOCK token ids whose mass over its Exp(1) draw is largest, then within it the token
    whose probability over its slot's draw is largest. Each level is an exact race (the winner
    is drawn in proportion to mass), so the token is exactly distributed as probs, and unlike an
    inverse CDF it moves only where two ratios nearly tie: the rounding of a differently batched
    pass almost never changes it, and two close distributions given the same noise mostly agree.
    noise [N, blocks + RACE_BLOCK] from position_noise; slots share their draws across blocks,
    which is exact since only the winning block races."""
    N, V = probs.shape
    nb = noise.shape[-1] - RACE_BLOCK
    p = probs.float()
    if nb * RACE_BLOCK != V:
        p = torch.nn.functional.pad(p, (0, nb * RACE_BLOCK - V))
    p = p.reshape(N, nb, RACE_BLOCK)
    block = (p.sum(-1) / noise[:, :nb]).argmax(-1)
    inside = p[torch.arange(N, device=p.device), block]
    return block * RACE_BLOCK + (inside / noise[:, nb:]).argmax(-1)
