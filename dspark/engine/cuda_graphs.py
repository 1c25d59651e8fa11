"""CUDA graphs for the uniform forwards of a speculative step: plain decode (1 token per request),
chain verification (anchor + drafts) and the drafter's block.

A GraphPool holds one captured forward per batch size on a ladder. A batch is padded up to the
next size: each request's tokens to the pool's `tokens` (extra tokens sit after the real ones,
so causal attention keeps them out of the real rows; their K/V land in the request's own
reserved slots, which nothing reads before a real token overwrites them, and past its reserved
pages on scratch pages), and missing requests with dummy ones on scratch pages. The real rows are
gathered back in the batch's ragged order. Anything the ladder cannot hold (long prefill chunks,
trees, more requests than the largest size) runs eagerly: `run` returns None.

Without capture (`capture=False`, or on CPU) the pool runs the same padded forward eagerly;
the tests use that to check the padding on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dspark.engine.attention import AttnBatch, make_backend
from dspark.engine.flashinfer_backend import StaticBatch

if TYPE_CHECKING:
    from dspark.engine.engine import Engine

SCRATCH_TOKENS = 64  # cache slots kept outside the page pool for padding requests (blocks up to 63)
LONG_CHAIN_REQUESTS = 8  # most requests a pool for chains longer than a block pads (8 x 33 rows)
ForwardFn = Callable[[torch.Tensor, torch.Tensor, object], tuple]  # (ids, positions, attn) -> tensors


@torch.no_grad()  # no autograd records: they would pin every layer's activations in the graph pool
def capture_graph(fn: Callable[[], tuple], device: torch.device, pool=None) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """Capture fn() in a CUDA graph after two warm-up calls on a side stream (kernel selection,
    lazy attention planning, the allocator); returns the graph and the outputs it writes."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn()
    return graph, outputs


def default_ladder(max_requests: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 32 beyond, ending at max_requests."""
    sizes, n = [], 1
    while n < max_requests:
        sizes.append(n)
        n = n * 2 if n < 8 else n + (8 if n < 64 else 32)
    return sizes + [max_requests]


@dataclass
class _Captured:
    attn: object
    ids: torch.Tensor
    pos: torch.Tensor
    outputs: tuple
    graph: torch.cuda.CUDAGraph | None


class GraphPool:
    """Padded, optionally captured forwards of `fn` for batches of up to max(ladder) requests,
    each adding at most `tokens` tokens under `mask` ("causal" or "full")."""

    def __init__(self, fn: ForwardFn, make_attn: Callable[[int], object], ladder: list[int], tokens: int,
                 mask: str, scratch_pages: list[int], page_size: int, device: torch.device, capture: bool):
        if mask not in ("causal", "full"):
            raise ValueError(f"graphs serve causal or full blocks, not {mask!r}")
        if len(scratch_pages) * page_size < tokens:
            raise ValueError(f"{len(scratch_pages)} scratch pages cannot hold {tokens} padding tokens")
        self.fn, self.make_attn, self.tokens, self.mask = fn, make_attn, tokens, mask
        self.ladder = sorted(set(ladder))
        self.scratch, self.page_size, self.device = scratch_pages, page_size, device
        self.capture = capture and device.type == "cuda"
        self._entries: dict[int, _Captured] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.num_served = 0  # batches this pool ran (captured or, without capture, padded eagerly)

    def size_for(self, num_requests: int) -> int | None:
        return next((n for n in self.ladder if n >= num_requests), None)

    def capture_all(self) -> None:
        """Capture every ladder size, largest first so smaller graphs reuse its memory pool."""
        for n in reversed(self.ladder):
            self._entry(n)

    def _dummy(self, n: int) -> AttnBatch:
        q = self.tokens
        return AttnBatch(q_lens=[q] * n, kv_lens=[q] * n, page_tables=[list(self.scratch)] * n,
                         page_size=self.page_size, mask=self.mask)

    def _entry(self, n: int) -> _Captured:
        if n in self._entries:
            return self._entries[n]
        attn = self.make_attn(n)
        ids = torch.zeros(n * self.tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(self.tokens, device=self.device).repeat(n)
        attn.plan(self._dummy(n))
        graph, outputs = self._capture(attn, ids, pos) if self.capture else (None, ())
        self._entries[n] = e = _Captured(attn, ids, pos, outputs, graph)
        return e

    def _capture(self, attn, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, tuple]:
        return capture_graph(lambda: self.fn(ids, pos, attn), self.device, self._mempool)

    def pad(self, batch: AttnBatch, ids: torch.Tensor):
        """(padded batch, padded ids, padded positions, real rows) or None if the batch does not fit.
        Positions follow from the batch (each new token right after its request's cached ones): the
        runner sends no batch with positions of its own here."""
        R, q = len(batch.q_lens), self.tokens
        n = self.size_for(R)
        if n is None or batch.mask != self.mask:
            return None
        ps = self.page_size
        for ql, kv, pages in zip(batch.q_lens, batch.kv_lens, batch.page_tables):
            if ql > q or (self.mask == "full" and ql != q):
                return None
            if self._overflow(kv - ql + q, len(pages)) > len(self.scratch):
                return None
        # index lists on the host, then one gather each: no per-request device ops
        src, positions, rows, kv_lens, tables = [], [], [], [], []
        at, pad_row = 0, len(ids)  # ids[pad_row] is the appended zero
        for i, (ql, kv, pages) in enumerate(zip(batch.q_lens, batch.kv_lens, batch.page_tables)):
            src.extend(list(range(at, at + ql)) + [pad_row] * (q - ql))
            positions.extend(range(kv - ql, kv - ql + q))
            rows.extend(range(i * q, i * q + ql))
            kv_lens.append(kv - ql + q)
            # padding past the request's reserved pages lands on scratch pages: only padding rows,
            # whose outputs are dropped, ever attend to those positions
            tables.append(pages + self.scratch[:self._overflow(kv - ql + q, len(pages))])
            at += ql
        for _ in range(R, n):
            src.extend([pad_row] * q)
            positions.extend(range(q))
            kv_lens.append(q)
            tables.append(list(self.scratch))
        dev = ids.device
        pad_ids = torch.cat([ids, ids.new_zeros(1)])[torch.tensor(src, device=dev)]
        pad_pos = torch.tensor(positions, dtype=torch.long, device=dev)
        padded = AttnBatch(q_lens=[q] * n, kv_lens=kv_lens, page_tables=tables, page_size=ps, mask=self.mask)
        return padded, pad_ids, pad_pos, torch.tensor(rows, dtype=torch.long, device=dev)

    def _overflow(self, tokens: int, pages: int) -> int:
        """Pages that `tokens` positions need beyond a table of `pages` pages (at least 0)."""
        return max(0, -(-tokens // self.page_size) - pages)

    def run(self, batch: AttnBatch, ids: torch.Tensor) -> tuple | None:
        """The forward's outputs for the real rows of batch (None: run it eagerly instead), gathered
        out of the graph's buffers: copies that the next replay leaves alone."""
        padded = self.pad(batch, ids)
        if padded is None:
            return None
        pbatch, pids, ppos, rows = padded
        e = self._entry(len(pbatch.q_lens))
        e.attn.plan(pbatch)
        self.num_served += 1
        if e.graph is None:
            outputs = self.fn(pids, ppos, e.attn)
        else:
            e.ids.copy_(pids)
            e.pos.copy_(ppos)
            e.graph.replay()
            outputs = e.outputs
        return tuple(o[rows] if o is not None else None for o in outputs)


def install_graphs(engine: Engine, capture: bool = True) -> None:
    """Serve an engine's uniform forwards from padded CUDA graphs at a ladder of batch sizes:
    plain decode and chain verification in its model runner, the drafter's block in its spec
    runner. capture=False pads the same way but runs eagerly (how the CPU tests check the
    padding)."""
    cfg, device = engine.config, engine.device
    ladder = list(cfg.cuda_graph_batch_sizes or default_ladder(cfg.max_num_seqs))
    max_pages = -(-(engine.max_model_len + SCRATCH_TOKENS) // cfg.page_size) + 1  # a table plus padding
    workspace = getattr(engine.attn, "workspace", None)

    def pool(fn, tokens: int, mask: str = "causal", sizes: list[int] | None = None) -> GraphPool:
        def make_attn(n: int):
            return make_backend(cfg.attention_backend, device, StaticBatch(n, tokens, max_pages), workspace)
        return GraphPool(fn, make_attn, sizes or ladder, tokens, mask, engine.scratch_pages, cfg.page_size,
                         device, capture)

    runner, spec = engine.runner, engine.spec
    layers = spec.capture_layers

    def target(ids, pos, attn):
        return runner.model(ids, pos, attn, runner.kv, layers)

    runner.graphs = {q: pool(target, q) for q in sorted({1, 1 + spec.block_size})}
    longest = 1 + spec.longest_chain
    if longest > max(runner.graphs) and longest <= SCRATCH_TOKENS:
        # looked-up chains grow past a block while they are accepted whole: a few requests padded
        # to the longest chain cost one graph replay, where an eager pass pays a launch per kernel;
        # many would pad the whole batch to it, so larger batches with such a chain run eagerly
        runner.graphs[longest] = pool(target, longest, sizes=[n for n in ladder if n <= LONG_CHAIN_REQUESTS])
    runner.graph_capture_layers = layers
    if spec.block_forward is not None:
        spec.proposer.graphs = pool(spec.block_forward, spec.proposer.forward_tokens, "full")
    if capture:
        for p in [*runner.graphs.values(), spec.graphs]:
            if p is not None:
                p.capture_all()
