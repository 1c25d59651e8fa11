"""The torch attention backend against dense per-sequence attention, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from dspark.engine.attention import AttnBatch, TorchAttention

H, HKV, D, PAGE = 6, 2, 16, 4


def dense_reference(q, k, v, ctx: int, causal: bool = True) -> torch.Tensor:
    """GQA attention of q [n, H, D] over k, v [ctx + n, HKV, D] in float64 (causal, or every
    new token seeing every other, as a drafter block does)."""
    n = q.shape[0]
    kk = k.double().repeat_interleave(H // HKV, 1)
    vv = v.double().repeat_interleave(H // HKV, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * D ** -0.5
    allowed = torch.arange(ctx + n)[None, :] <= (ctx + torch.arange(n))[:, None]
    if causal:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


def run_paged(seqs: list[tuple[int, int]], dtype: torch.dtype, attn: TorchAttention, mask: str = "causal",
              custom_masks: list | None = None):
    """Random cached and new K/V for (cached tokens, new tokens) per sequence, written to a paged
    cache with pages out of order, then one planned forward -> (out, q, full_k, full_v)."""
    g = torch.Generator().manual_seed(0)
    pages, tables = 0, []
    for ctx, n in seqs:
        need = -(-(ctx + n) // PAGE)
        tables.append(list(range(pages + need - 1, pages - 1, -1)))  # pages out of order on purpose
        pages += need
    k_cache = torch.zeros(pages * PAGE, HKV, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    batch = AttnBatch(q_lens=[n for _, n in seqs], kv_lens=[c + n for c, n in seqs], page_tables=tables,
                      page_size=PAGE, mask=mask, custom_masks=custom_masks or [])
    full_k = [torch.randn(c + n, HKV, D, generator=g).to(dtype) for c, n in seqs]
    full_v = [torch.randn(c + n, HKV, D, generator=g).to(dtype) for c, n in seqs]
    for (ctx, _), pt, k, v in zip(seqs, tables, full_k, full_v):
        slots = torch.tensor([pt[p // PAGE] * PAGE + p % PAGE for p in range(ctx)], dtype=torch.long)
        k_cache[slots], v_cache[slots] = k[:ctx], v[:ctx]
    q = torch.randn(sum(n for _, n in seqs), H, D, generator=g).to(dtype)
    attn.plan(batch)
    out = attn.forward(q, torch.cat([k[c:] for (c, _), k in zip(seqs, full_k)]),
                       torch.cat([v[c:] for (c, _), v in zip(seqs, full_v)]), k_cache, v_cache, D ** -0.5)
    return out, q, full_k, full_v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_query_lengths_match_dense(dtype):
    """Decode rows, a verification chain and a prefill chunk in one batch, each against its
    own dense attention; bf16 caches are attended in fp32 on CPU and come back in bf16."""
    seqs = [(7, 1), (12, 9), (0, 21), (30, 1)]  # (cached tokens, new tokens)
    out, q, full_k, full_v = run_paged(seqs, dtype, TorchAttention("cpu"))
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    row = 0
    for (ctx, n), k, v in zip(seqs, full_k, full_v):
        ref = dense_reference(q[row:row + n], k, v, ctx)
        torch.testing.assert_close(out[row:row + n].double(), ref, atol=tol, rtol=tol)
        row += n


@pytest.mark.parametrize("seqs", [[(19, 8)], [(7, 8), (19, 8)]], ids=["one-block-unmasked", "padded-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inexact_drafter_blocks_match_dense(seqs, dtype):
    """The drafter's backend (exact=False): a lone block sees every key, so it runs without a
    mask (in bf16 where the cache is bf16); blocks padded to a common length keep one."""
    attn = TorchAttention("cpu", exact=False)
    out, q, full_k, full_v = run_paged(seqs, dtype, attn, mask="full")
    assert (attn.groups[0].mask is None) == (len(seqs) == 1)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    row = 0
    for (ctx, n), k, v in zip(seqs, full_k, full_v):
        ref = dense_reference(q[row:row + n], k, v, ctx, causal=False)
        torch.testing.assert_close(out[row:row + n].double(), ref, atol=tol, rtol=tol)
        row += n


def test_prefill_beside_a_tree_gets_the_bits_it_gets_beside_chains():
    """A long prefill chunk riding in a tree-verification pass (custom mask, its own mask None) is
    attended as in a causal pass, bit for bit: a prompt admitted while others verify trees must
    start from the KV it would have beside chains, or bf16 greedy outputs drift from plain ones."""
    seqs = [(10, 6), (0, 60), (7, 1)]  # a tree of 6, a 60-token prefill chunk, a decode row
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]], dtype=torch.bool)
    with_tree, with_chain = TorchAttention("cpu"), TorchAttention("cpu")
    beside_tree, *_ = run_paged(seqs, torch.bfloat16, with_tree, "custom", [tree, None, None])
    beside_chain, *_ = run_paged(seqs, torch.bfloat16, with_chain, "causal")
    assert torch.equal(beside_tree[6:], beside_chain[6:])
    # the chunk's group is the inexact one in both (float32 there: float64 would round otherwise,
    # rarely, but over a long generation that is enough to leave plain decoding)
    exact = [[g.short for g in a.groups if 6 in g.dest.tolist()] for a in (with_tree, with_chain)]
    assert exact == [[False], [False]]
    # a tree longer than the exact buckets stays exact, in a group of its own
    run_paged([(3, 40), (0, 60)], torch.bfloat16, with_tree, "custom", [torch.ones(40, 40).tril().bool(), None])
    assert sorted((len(g.dest), g.short) for g in with_tree.groups) == [(40, True), (60, False)]
