"""Start-up profile of target pass cost against tokens per pass, cached per machine."""

from __future__ import annotations

import hashlib
import json
import logging
import time

import torch

from dspark.atomic import atomic_path
from dspark.config import SamplingParams
from dspark.engine.policy import CostModel
from dspark.engine.sequence import Sequence
from dspark.models import cpu_ops
from dspark.models.loader import cache_dir

log = logging.getLogger(__name__)

# Token counts profiled. Besides powers of two, each side of 4, 8 and 16 rows: torch's CPU int4
# kernel works in blocks of 4 rows, so 5 rows cost what 8 do, and a straight line from 4 to 8
# would price a chain of 4 drafts far too cheaply; our int4 and int8 kernels grow row by row on
# VNNI and step where they move to AMX tiles (past 4 rows for int8 codes, 16 for int4).
LADDER = [1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 17, 32, 64, 128, 256]


def _key(engine) -> str:
    # a small KV cache measures only part of the ladder (the fit): its profile is kept apart
    kernels = cpu_ops.quant_kind() if "Int4Linear" in engine.quantization else None
    ops = cpu_ops.load()
    stack = hasattr(ops, "decode_stack")  # a pass in one C++ call costs less
    # and the kernels' sources: a profile measured by other kernels prices other passes
    src = cpu_ops.sources_digest() if ops is not None else None
    raw = (f"v9|kernels={kernels}|stack={stack}|src={src}|{engine.model_path}|{engine.device}|{engine.dtype}"
           f"|{torch.get_num_threads()}"
           f"|{engine.attn.name}|graphs={bool(engine.runner.graphs)}|fit={_fit(engine.pool, LADDER)}"
           f"|linears={','.join(sorted(engine.quantization))}|tp={engine.config.tensor_parallel_size}")
    if engine.device.type == "cuda":
        raw += "|" + torch.cuda.get_device_name(engine.device)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _fit(pool, ladder: list[int]) -> tuple[int, int, list[int]]:
    """(sequences, context tokens each, ladder) that the free pages hold: up to 16 sequences with 64
    cached tokens each, fewer and shorter in a small pool (the profile prices the tokens in a pass,
    not the context), and only the ladder's passes that still fit."""
    nseq = max(1, min(16, pool.num_free))
    room = (pool.num_free // nseq) * pool.page_size
    fits = [n for n in ladder if -(-n // nseq) < room]
    if not fits:
        raise ValueError(f"the KV cache ({pool.num_free} free pages) cannot hold a profile pass")
    return nseq, min(64, room - -(-fits[-1] // nseq)), fits


def measure(engine, ladder: list[int] = LADDER, repeats: int = 3) -> CostModel:
    """Fastest of `repeats` target passes with n tokens spread over up to 16 short sequences
    (on a shared machine noise only adds time; CostModel caps what is still out of order).
    Every row gets logits and the drafter's feature layers are captured, as in a real step (the
    LM head is a large share), so the same forwards take CUDA graphs where the engine has them.
    The ladder is swept whole `repeats` times after one unmeasured sweep, rather than one token
    count `repeats` times in a row: a burst of other work (another server starting beside this
    one) then slows one pass of several token counts, not every pass of one, whose inflated
    price the policy would never try and so never correct."""
    nseq, ctx, ladder = _fit(engine.pool, ladder)
    seqs = [Sequence(seq_id=-1 - i, request_id=f"profile-{i}", prompt_ids=[0] * ctx,
                     params=SamplingParams(), generator=None, eos_ids=frozenset()) for i in range(nseq)]
    times: list[list[float]] = [[] for _ in ladder]
    try:
        for s in seqs:
            engine.pool.reserve(s.seq_id, ctx + -(-max(ladder) // nseq))
            s.num_cached = ctx
        batches = []
        for n in ladder:
            per = [n // nseq + (i < n % nseq) for i in range(nseq)]
            batches.append([(s, [0] * k) for s, k in zip(seqs, per) if k])
        for sweep in range(repeats + 1):
            for n, items, out in zip(ladder, batches, times):
                if engine.device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                engine.runner.forward(items, list(range(n)), capture=engine.spec.capture_layers)
                if engine.device.type == "cuda":
                    torch.cuda.synchronize()
                if sweep:  # the first sweep sets up each shape
                    out.append(time.perf_counter() - t)
    finally:
        for s in seqs:
            engine.pool.free(s.seq_id)
    return CostModel(list(ladder), [min(t) for t in times])


# Token counts a cached profile is checked at on every start, and how far (either way) a fresh
# measurement of them may lie from it before the whole profile is measured again.
CHECK, CHECK_RATIO = (1, 8), 1.5


def stale(cost: CostModel, probe: CostModel) -> bool:
    """Whether a fresh probe of a few token counts says the cached profile was taken on another
    machine state: one compiling in the background while it was measured prices every pass
    several times too dearly, for every later start (learning in a run is not kept)."""
    for n, s in zip(probe.tokens, probe.seconds):
        if n in cost.tokens:
            ratio = s / cost.seconds[cost.tokens.index(n)]
            if not 1 / CHECK_RATIO <= ratio <= CHECK_RATIO:
                return True
    return False


def load_or_measure(engine) -> CostModel:
    """The cached profile for this model and machine, measuring it the first time, and again when
    a quick probe finds it stale."""
    path = cache_dir() / f"cost-{_key(engine)}.json"
    try:
        d = json.loads(path.read_text())
        cost = CostModel(d["tokens"], d["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        cost = None  # absent or unreadable: measure again
    if cost is not None:
        checks = [n for n in CHECK if n in cost.tokens]
        probe = measure(engine, checks, repeats=2) if checks else None
        if probe is None or not stale(cost, probe):
            return cost
        log.info("the cached cost profile %s is stale (ms at %s tokens: %s now, %s cached); measuring again",
                 path.name, checks, [round(s * 1e3, 2) for s in probe.seconds],
                 [round(cost.seconds[cost.tokens.index(n)] * 1e3, 2) for n in checks])
    cost = measure(engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    # written whole or not at all: a server stopped while it loads exits mid-load
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps({"tokens": cost.tokens, "seconds": cost.seconds}))
    return cost
