"""Attention backends over the paged KV cache.

The interface mirrors FlashInfer's paged wrappers: `plan` once per forward
from the batch layout (page tables, query and KV lengths, mask), then
`forward` once per layer. The "torch" backend is the CPU reference: it gathers
each sequence's keys into a padded batch and runs one masked SDPA per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from dspark.models.llama import cpu_reduced_precision, exact_dtype


@dataclass
class AttnBatch:
    """Layout of one ragged forward: sequence i adds q_lens[i] tokens after its
    kv_lens[i] - q_lens[i] cached ones. mask: "causal" (chains, prefill),
    "full" (every new token sees every other: the drafter block) or "custom"
    (custom_masks[i] is a [q, q] bool tensor among the new tokens, or None for a
    causal sequence riding along: a chain or a prefill chunk; all cached tokens
    stay visible)."""

    q_lens: list[int]
    kv_lens: list[int]
    page_tables: list[list[int]]
    page_size: int
    mask: str = "causal"
    custom_masks: list[torch.Tensor | None] = field(default_factory=list)

    def slot_mapping(self) -> list[int]:
        out: list[int] = []
        ps = self.page_size
        for q, kv, pages in zip(self.q_lens, self.kv_lens, self.page_tables):
            out.extend(pages[p // ps] * ps + p % ps for p in range(kv - q, kv))
        return out


@dataclass
class _Group:
    """Sequences padded together: gather indices into the cache, query rows, mask, output rows."""

    gather: torch.Tensor  # [S, Lmax] cache slots
    q_index: torch.Tensor  # [S, Qmax] rows of q (padding -> the zero row)
    row_mask: torch.Tensor  # [S, Qmax, Lmax]: which keys each query row sees (the fused kernel's layout)
    out_rows: torch.Tensor  # rows of the flattened [S * Qmax] output that are real queries
    dest: torch.Tensor  # where those rows go in the [N] output
    short: bool  # decode steps and verification chains/trees (exact), not long prefill chunks
    dense: bool = False  # the only group, no padding: q and the output need no re-indexing
    sdpa_masked: bool = True  # False: SDPA runs unmasked (every query sees every key; inexact only)
    visible: torch.Tensor | None = None  # [S, Qmax]: causal rows see their first n keys (None: not causal)

    def fused(self, ops, head_dim: int) -> bool:  # noqa: ANN001 - ops: the fused CPU kernels (models.cpu_ops)
        """Whether ``ops`` attends this group in one kernel: a short group (``attend``), or causal
        rows where the build has ``attend_causal`` for this head dim."""
        return self.short or (self.visible is not None and head_dim in (64, 128) and hasattr(ops, "attend_causal"))

    @property
    def kernel_mask(self) -> torch.Tensor:
        """What a fused kernel takes for this group's keys: ``row_mask`` (``attend``, a short
        group) or ``visible`` (``attend_causal``, the decoder stack's 2-D third tensor)."""
        return self.row_mask if self.short else self.visible

    @property
    def mask(self) -> torch.Tensor | None:
        """SDPA's mask [S, 1, Qmax, Lmax] (one for every head), or None when it runs unmasked."""
        return self.row_mask[:, None] if self.sdpa_masked else None


class TorchAttention:
    """Reference backend: gather paged K/V into padded batches, one masked SDPA per group.

    Sequences are grouped by query length (single tokens, short chains and trees, long prefill
    chunks) so a prefill chunk does not pad every decoding request's query to its length.
    exact=False (the drafter's, whose proposals need no bit-equality) attends short groups in
    float32 instead of float64, and an unmasked group (one block seeing all its keys) in the
    cache's own dtype, where CPU SDPA is fastest. With the fused CPU kernels (``attend``'s ops)
    short groups skip the gather and SDPA altogether and are exact by a fixed summation order."""

    name = "torch"
    # Query-length group bounds: q == 1, q <= 16, q <= 33, longer. Every bounded group is attended
    # exactly (the fused kernel, or float64 SDPA in bf16 on CPU without it), so the last bound is
    # the longest chain (a block or a looked-up chain of at most 32 + its anchor: config.py caps a
    # requested block size and ngram_assist_max_len at 32; a drafter emitting more than 32 a block
    # would need a wider bound, which would also move short prefill chunks to the exact path);
    # trees are exact whatever their size. A verified token must get the bits it would get
    # decoded alone; longer prefill chunks need not.
    BUCKETS = (1, 16, 33)

    def __init__(self, device: str | torch.device, exact: bool = True):
        self.device = torch.device(device)
        self.exact = exact

    def plan(self, batch: AttnBatch) -> None:
        self.num_tokens = sum(batch.q_lens)
        self.slot_mapping = torch.tensor(batch.slot_mapping(), dtype=torch.long, device=self.device)
        starts, at = [], 0
        for q in batch.q_lens:
            starts.append(at)
            at += q
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, q in enumerate(batch.q_lens):
            bucket = next((j for j, b in enumerate(self.BUCKETS) if q <= b), len(self.BUCKETS))
            # a long tree is attended exactly, a long prefill chunk is not: never in one group
            tree = bucket == len(self.BUCKETS) and self._is_tree(batch, i)
            groups.setdefault((bucket, tree), []).append(i)
        self.groups = [self._plan_group(batch, idx, starts, exact=bucket < len(self.BUCKETS) or tree)
                       for (bucket, tree), idx in sorted(groups.items())]
        if len(self.groups) == 1 and len(set(batch.q_lens)) == 1:  # e.g. every request decoding one token
            self.groups[0].dense = True

    @staticmethod
    def _is_tree(batch: AttnBatch, i: int) -> bool:
        return batch.mask == "custom" and batch.custom_masks[i] is not None

    def _plan_group(self, batch: AttnBatch, idx: list[int], starts: list[int], exact: bool) -> _Group:
        # whole-group array ops, not a loop of small ones per request: at a few hundred requests a
        # step, planning would otherwise cost a good part of a decode step. In numpy: on these
        # small arrays torch's per-op dispatch cost several times the work (planned twice a
        # drafting step, for the drafter's block and the target's pass)
        ps = batch.page_size
        q = np.array([batch.q_lens[i] for i in idx], dtype=np.int64)
        kv = np.array([batch.kv_lens[i] for i in idx], dtype=np.int64)
        first = np.array([starts[i] for i in idx], dtype=np.int64)
        qmax, lmax = int(q.max()), int(kv.max())
        n_pages = -(-lmax // ps)
        table = np.array([pages[:n_pages] + [0] * (n_pages - len(pages[:n_pages]))
                          for pages in (batch.page_tables[i] for i in idx)], dtype=np.int64)
        pos, j = np.arange(lmax), np.arange(qmax)
        seen = pos < kv[:, None]  # [S, Lmax]: cached or new keys of each request
        real = j < q[:, None]  # [S, Qmax]: real query rows (the rest is padding)
        gather = np.where(seen, table[:, pos // ps] * ps + pos % ps, 0)
        q_index = np.where(real, first[:, None] + j, self.num_tokens)  # pad -> the zero row
        g_idx, j_idx = real.nonzero()
        out_rows, dest = g_idx * qmax + j_idx, first[g_idx] + j_idx
        if batch.mask == "full":
            mask = real[:, :, None] & seen[:, None, :]
        else:  # causal: chains and prefill chunks, in a causal pass or beside trees
            last = (kv - q)[:, None] + j  # each query row's own position
            mask = (pos <= last[:, :, None]) & seen[:, None, :] & real[:, :, None]
            for g, i in enumerate(idx if batch.mask == "custom" else ()):
                if self._is_tree(batch, i):
                    n, ctx = batch.q_lens[i], batch.kv_lens[i] - batch.q_lens[i]
                    mask[g, :n, :ctx] = True
                    mask[g, :n, ctx:ctx + n] = batch.custom_masks[i].cpu().numpy().astype(bool)
        mask[:, :, 0] |= ~real  # padded query rows see one key so softmax stays finite
        dev = self.device
        # exact groups keep their mask even when it hides nothing: SDPA's unmasked kernel sums in
        # another order, and a decoded token must match the same token verified
        keep = self.exact or not bool(mask.all())
        # long causal groups (prompt chunks) only: short ones take the masked kernel, and a decode
        # step should not build a tensor it never reads
        causal = not exact and batch.mask != "full" and not any(self._is_tree(batch, i) for i in idx)
        visible = torch.from_numpy(np.where(real, last + 1, 0)).to(dev) if causal else None
        return _Group(*(torch.from_numpy(a).to(dev) for a in (gather, q_index, mask, out_rows, dest)), exact,
                      sdpa_masked=keep, visible=visible)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [N, H, D]; k, v: [N, Hkv, D] for the new tokens; caches: [slots, Hkv, D]."""
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        return self.attend(q, k_cache, v_cache, scale)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               ops=None) -> torch.Tensor:  # noqa: ANN001 - ops: the fused CPU kernels (models.cpu_ops)
        """Attention of q [N, H, D] over caches that already hold this pass's K/V. With ops, short
        groups (decode, chains, trees, drafter blocks) run the fused kernel, which visits each
        row's keys in one fixed order, and long prefill chunks its causal form where the build has
        one (AVX512 and AVX2 builds: the same bits per row, so a prompt's K/V do not depend on how it was chunked
        and a cached prefix equals one computed again); elsewhere they keep SDPA."""
        N, H, D = q.shape
        fused = ops is not None
        qz = None
        out = q.new_empty(N, H, D) if len(self.groups) > 1 or fused else None
        for g in self.groups:
            if fused and g.fused(ops, D):
                kernel = ops.attend if g.short else ops.attend_causal
                kernel(q, k_cache, v_cache, g.gather, g.q_index, g.kernel_mask, scale, out)
                continue
            if qz is None and not g.dense:
                qz = torch.cat([q, q.new_zeros(1, H, D)])
            qp = q.view(g.q_index.shape[0], -1, H, D) if g.dense else qz[g.q_index]  # [S, Qmax, H, D]
            kp = k_cache[g.gather]  # [S, Lmax, Hkv, D]
            vp = v_cache[g.gather]
            mask = g.mask
            if cpu_reduced_precision(qp) and mask is not None:
                # CPU SDPA with a boolean mask runs several times slower in bf16/fp16 than in
                # fp32 (measured 4x at q=1), so prefill chunks are attended in fp32, and decode/
                # verification groups in float64 (exact_dtype: plain and speculative decoding
                # must reach the same bits).
                dt = exact_dtype(qp) if g.short and self.exact else torch.float32
                qp, kp, vp = qp.to(dt), kp.to(dt), vp.to(dt)
            o = F.scaled_dot_product_attention(
                qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                attn_mask=mask, scale=scale, enable_gqa=H != k_cache.shape[1]).to(q.dtype)
            o = o.transpose(1, 2).reshape(-1, H, D)
            if not g.dense:
                o = o[g.out_rows]
            if out is None:
                return o
            out[g.dest] = o
        return out


def exact_prompt_chunks(model, attn, device: torch.device, workers=None) -> bool:  # noqa: ANN001
    """Whether a prompt's K/V come out the same however its prefill is chunked: the CPU kernels'
    causal attention (every row's keys in one fixed order) and row-alone linears
    (models.quantize.rows_alone), on one process. Prefix caching is then exact, and on by default."""
    if device.type != "cpu" or workers is not None or getattr(attn, "name", None) != "torch":
        return False
    from dspark.models import cpu_ops
    from dspark.models.quantize import rows_alone

    ops = cpu_ops.load()
    head_dim = model.config.head_dim
    return ops is not None and hasattr(ops, "attend_causal") and head_dim in (64, 128) and rows_alone(model)


def make_backend(name: str, device: str | torch.device, static=None, workspace: torch.Tensor | None = None,
                 exact: bool = True):  # noqa: ANN201 - TorchAttention or FlashInferAttention
    """Pick an attention backend: "torch", "flashinfer" or "auto". static (a StaticBatch) asks for
    CUDA-graph-safe buffers and workspace shares another FlashInfer backend's scratch memory; the
    torch backend, which is never captured, ignores both. exact=False: see TorchAttention."""
    dev = torch.device(device)
    if name == "auto":
        name = "torch"
        if dev.type == "cuda":
            try:
                import flashinfer  # noqa: F401

                name = "flashinfer"
            except ImportError:
                pass
    if name == "torch":
        return TorchAttention(dev, exact)
    if name == "flashinfer":
        from dspark.engine.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(dev, static, workspace)
    raise ValueError(f"unknown attention backend {name!r}: choose torch, flashinfer or auto")
