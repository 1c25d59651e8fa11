"""The FlashInfer backend's page layout, checked on CPU: attention computed by reading the CSR
arrays the way FlashInfer's paged wrappers do equals the torch backend's output for chains,
the drafter's full block, tree masks and decode rows. The kernels themselves are checked in
tests/test_gpu.py on a CUDA machine."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import tree_mask

from dspark.engine.attention import AttnBatch, TorchAttention
from dspark.engine.flashinfer_backend import paged_layout

H, HKV, D, PAGE = 4, 2, 8, 4


def layout_attention(q, k_cache, v_cache, lay, scale) -> torch.Tensor:
    """FlashInfer's semantics: request i's keys are its pages in order, the last one holding
    last_page_len tokens; causal is bottom-right aligned; a custom mask is [q, kv] row-major."""
    out = torch.empty_like(q, dtype=torch.float64)
    kp, vp = k_cache.view(-1, PAGE, HKV, D), v_cache.view(-1, PAGE, HKV, D)
    mask_at = 0
    for i in range(len(lay.qo_indptr) - 1):
        q0, q1 = int(lay.qo_indptr[i]), int(lay.qo_indptr[i + 1])
        pages = lay.kv_indices[int(lay.kv_indptr[i]):int(lay.kv_indptr[i + 1])].long()
        kv = (len(pages) - 1) * PAGE + int(lay.last_page_len[i])
        k = kp[pages].reshape(-1, HKV, D)[:kv].double().repeat_interleave(H // HKV, 1)
        v = vp[pages].reshape(-1, HKV, D)[:kv].double().repeat_interleave(H // HKV, 1)
        n = q1 - q0
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k) * scale
        if lay.custom_mask is not None:
            allowed = lay.custom_mask[mask_at:mask_at + n * kv].view(n, kv)
            mask_at += n * kv
        elif lay.causal:
            allowed = torch.arange(kv)[None, :] <= (kv - n + torch.arange(n))[:, None]
        else:
            allowed = torch.ones(n, kv, dtype=torch.bool)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    return out


@pytest.mark.parametrize("mask", ["causal", "full", "custom", "decode"])
def test_layout_matches_torch_backend(mask):
    g = torch.Generator().manual_seed(1)
    seqs = [(0, 1), (6, 1), (13, 1)] if mask == "decode" else [(7, 1), (12, 9), (0, 5), (30, 8)]
    tables, used = [], 0
    for ctx, n in seqs:
        need = -(-(ctx + n) // PAGE) + 1  # one spare reserved page, as the engine reserves ahead
        tables.append(list(range(used + need - 1, used - 1, -1)))  # out of order on purpose
        used += need
    k_cache = torch.randn(used * PAGE, HKV, D, generator=g)
    v_cache = torch.randn(used * PAGE, HKV, D, generator=g)
    customs = [tree_mask(n, g) for _, n in seqs] if mask == "custom" else []
    batch = AttnBatch(q_lens=[n for _, n in seqs], kv_lens=[c + n for c, n in seqs], page_tables=tables,
                      page_size=PAGE, mask="causal" if mask == "decode" else mask, custom_masks=customs)
    N = sum(n for _, n in seqs)
    q = torch.randn(N, H, D, generator=g)
    k_new, v_new = torch.randn(N, HKV, D, generator=g), torch.randn(N, HKV, D, generator=g)
    lay = paged_layout(batch)
    assert lay.decode_only == (mask == "decode")
    torch_attn = TorchAttention("cpu")
    torch_attn.plan(batch)
    expected = torch_attn.forward(q, k_new, v_new, k_cache, v_cache, D ** -0.5)  # also writes the cache
    got = layout_attention(q, k_cache, v_cache, lay, D ** -0.5)
    torch.testing.assert_close(got.float(), expected, atol=1e-5, rtol=1e-5)


def test_layout_rejects_short_page_table():
    batch = AttnBatch(q_lens=[3], kv_lens=[9], page_tables=[[0, 1]], page_size=PAGE)
    with pytest.raises(ValueError, match="need 3 pages"):
        paged_layout(batch)
