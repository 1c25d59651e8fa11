"""FlashInfer attention over the paged KV cache (CUDA only).

`plan` turns the AttnBatch into FlashInfer's CSR page layout once per forward; the
wrapper itself is planned lazily at the first layer, because only then are the head
counts, head size, dtypes and scale known (the target and the drafter each own a
backend). A forward where every request adds one token runs the paged decode kernel;
anything else (prefill chunks, chains, the drafter's block, trees) runs the paged
prefill kernel: causal for chains and prompts (bottom-right aligned, so new token i sees
the cached ones and new tokens <= i), no mask for the drafter block, a custom mask for
trees. The cache is [slots, Hkv, D] per layer, which is NHD pages viewed flat.

Every wrapper is pinned to FlashInfer's "fa2" kernels: they take custom masks (the Hopper
"fa3" ones do not), and the tensor-core decode kernel is the same JIT module as the prefill
one, so a fresh machine compiles one module per head size and dtype. Decode and verification
batches are bound by memory, where fa2 loses nothing; long prompt prefills on Hopper would be
faster on fa3 (time to first token), which is the price of this choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.attention import AttnBatch


@dataclass
class PagedLayout:
    """FlashInfer's view of one ragged batch (int32 CSR arrays on the host)."""

    qo_indptr: torch.Tensor  # [n + 1] query rows of request i: qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: torch.Tensor  # [n + 1] its pages: kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # page ids, in position order
    last_page_len: torch.Tensor  # [n] tokens in each request's last page (1..page_size)
    causal: bool
    custom_mask: torch.Tensor | None  # flat bool, request by request, each [q, kv] row-major
    decode_only: bool  # every request adds exactly one token


def paged_layout(batch: AttnBatch) -> PagedLayout:
    """The CSR page arrays and mask FlashInfer's paged wrappers plan from."""
    ps = batch.page_size
    qo, kv_ptr, indices, last = [0], [0], [], []
    masks = []
    for i, (q, kv, pages) in enumerate(zip(batch.q_lens, batch.kv_lens, batch.page_tables)):
        if kv < q or kv < 1:
            raise ValueError(f"request {i}: kv length {kv} must cover its {q} new tokens")
        used = -(-kv // ps)
        if used > len(pages):
            raise ValueError(f"request {i}: {kv} tokens need {used} pages, the table has {len(pages)}")
        qo.append(qo[-1] + q)
        indices.extend(pages[:used])
        kv_ptr.append(len(indices))
        last.append(kv - (used - 1) * ps)
        if batch.mask == "custom":
            m = torch.ones(q, kv, dtype=torch.bool)
            own = batch.custom_masks[i]  # None: causal (a chain or prefill chunk beside trees)
            m[:, kv - q:] = own.to(torch.bool) if own is not None else torch.ones(q, q).tril().bool()
            masks.append(m.flatten())
    i32 = torch.int32
    return PagedLayout(
        qo_indptr=torch.tensor(qo, dtype=i32), kv_indptr=torch.tensor(kv_ptr, dtype=i32),
        kv_indices=torch.tensor(indices, dtype=i32), last_page_len=torch.tensor(last, dtype=i32),
        causal=batch.mask == "causal", custom_mask=torch.cat(masks) if masks else None,
        decode_only=batch.mask != "custom" and all(q == 1 for q in batch.q_lens))


@dataclass(frozen=True)
class StaticBatch:
    """Capacity of a CUDA-graph backend: requests, tokens per request, pages per request."""

    requests: int
    tokens: int
    max_pages: int


class FlashInferAttention:
    """Paged prefill/decode kernels from FlashInfer behind the backend interface of TorchAttention.

    `static` makes the wrappers CUDA-graph safe: their index arrays and the slot mapping live in
    fixed device buffers that every `plan` rewrites in place, so a captured forward replays on
    the new batch. Such a backend serves one (requests, tokens) shape."""

    name = "flashinfer"
    WORKSPACE_BYTES = 128 << 20
    KERNELS = "fa2"

    def __init__(self, device: str | torch.device, static: StaticBatch | None = None,
                 workspace: torch.Tensor | None = None):
        import flashinfer

        self.device = dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        # backends that never run at the same time (the engine's eager one and its graphs) share one
        self.workspace = ws = workspace if workspace is not None else \
            torch.zeros(self.WORKSPACE_BYTES, dtype=torch.uint8, device=dev)  # FlashInfer wants it zeroed
        self.static = static
        self._decode = self._prefill = None
        fa = self.KERNELS
        if static is None:
            # tensor cores: the decode kernel then takes any GQA group size (SmolLM2's is 3)
            self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True,
                                                                        backend=fa)
            self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=fa)
        else:
            i32 = dict(dtype=torch.int32, device=dev)
            R = static.requests
            qo, kv_ptr, idx, last = (torch.zeros(R + 1, **i32), torch.zeros(R + 1, **i32),
                                     torch.zeros(R * static.max_pages, **i32), torch.zeros(R, **i32))
            self.slot_mapping = torch.zeros(R * static.tokens, dtype=torch.long, device=dev)
            if static.tokens == 1:
                self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=kv_ptr,
                    paged_kv_indices_buffer=idx, paged_kv_last_page_len_buffer=last, backend=fa)
            else:
                self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    ws, "NHD", use_cuda_graph=True, qo_indptr_buf=qo, paged_kv_indptr_buf=kv_ptr,
                    paged_kv_indices_buf=idx, paged_kv_last_page_len_buf=last, backend=fa)
        self.layout: PagedLayout | None = None
        self._planned_for: tuple | None = None
        self._heads: tuple | None = None

    def plan(self, batch: AttnBatch) -> None:
        self.layout = paged_layout(batch)
        self.page_size = batch.page_size
        slots = torch.tensor(batch.slot_mapping(), dtype=torch.long)
        if self.static is None:
            self.slot_mapping = slots.to(self.device, non_blocking=True)
        else:
            if batch.q_lens != [self.static.tokens] * self.static.requests or batch.mask == "custom":
                raise ValueError(f"a static backend for {self.static} got query lengths {batch.q_lens} "
                                 f"({batch.mask} mask)")
            self.slot_mapping.copy_(slots, non_blocking=True)
        self._planned_for = None
        if self._heads is not None:  # known from an earlier forward: plan now, outside any graph capture
            self._plan_kernels(self._heads)

    def _plan_kernels(self, key: tuple) -> None:
        H, Hkv, D, q_dtype, kv_dtype, scale = key
        lay, ps = self.layout, self.page_size
        if lay.decode_only:
            # no split-KV: a decode step then sums in the same order eagerly and in a graph
            self._decode.plan(lay.kv_indptr, lay.kv_indices, lay.last_page_len, H, Hkv, D, ps,
                              q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=scale, disable_split_kv=True)
            self._wrapper = self._decode
        else:
            mask = lay.custom_mask.to(self.device) if lay.custom_mask is not None else None
            self._wrapper = self._prefill  # plan() refused masks if static
            self._wrapper.plan(lay.qo_indptr, lay.kv_indptr, lay.kv_indices, lay.last_page_len, H, Hkv, D, ps,
                               custom_mask=mask, causal=lay.causal and mask is None, sm_scale=scale,
                               q_data_type=q_dtype, kv_data_type=kv_dtype)
        self._planned_for = self._heads = key

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [N, H, D]; k, v: [N, Hkv, D] for the new tokens; caches: [slots, Hkv, D]."""
        k_cache.index_copy_(0, self.slot_mapping, k)
        v_cache.index_copy_(0, self.slot_mapping, v)
        key = (q.shape[1], k.shape[1], q.shape[2], q.dtype, k_cache.dtype, float(scale))
        if self._planned_for != key:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("plan a static flashinfer backend once eagerly before capturing a graph")
            self._plan_kernels(key)
        ps = self.page_size
        pages = (k_cache.view(-1, ps, *k_cache.shape[1:]), v_cache.view(-1, ps, *v_cache.shape[1:]))
        return self._wrapper.run(q, pages)
