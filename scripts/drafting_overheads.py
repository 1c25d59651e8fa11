"""Hot-loop timings of two per-step costs of a drafting step on CPU: the torch attention backend's
plan for a few batch shapes, and the drafter's context K/V write of a step's rows, through the
fused rotary-and-store kernel and through the torch ops it replaced (alternated, 3 rounds).

    .venv/bin/python scripts/drafting_overheads.py [--rows 2]

Run it on an older checkout (PYTHONPATH=that checkout) for the plan's figures before a change.
"""

from __future__ import annotations

import argparse
import time

import torch

from dspark.engine.attention import AttnBatch, TorchAttention
from dspark.llm import LLM


def per_call_us(fn, reps: int = 2000) -> float:  # noqa: ANN001
    for _ in range(50):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e6 * (time.perf_counter() - t) / reps


def batch(requests: int, q: int, context: int, mask: str = "causal") -> AttnBatch:
    return AttnBatch([q] * requests, [context + 17 * i for i in range(requests)],
                     [list(range(40 * i, 40 * i + 40)) for i in range(requests)], 16, mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2, help="context rows written per call")
    a = ap.parse_args()
    exact, drafts = TorchAttention("cpu"), TorchAttention("cpu", exact=False)
    for name, b, attn in (("decode, 1 request", batch(1, 1, 200), exact),
                          ("decode, 8 requests", batch(8, 1, 200), exact),
                          ("chain of 3, 1 request", batch(1, 3, 200), exact),
                          ("drafter block of 8, 1 request", batch(1, 8, 200, "full"), drafts),
                          ("drafter block of 8, 8 requests", batch(8, 8, 200, "full"), drafts)):
        print(f"plan, {name}: {per_call_us(lambda b=b, attn=attn: attn.plan(b)):.1f} us")
    proposer = LLM(kv_cache_tokens=8192).engine.spec.proposer
    d, kv = proposer.drafter, proposer.kv
    feats = torch.randn(a.rows, d.fc.in_features, dtype=kv.k.dtype)
    pos, slots = torch.arange(100, 100 + a.rows), torch.arange(5, 5 + a.rows)
    fused = getattr(d, "_store_context_kv", None)  # None: a checkout from before the fused write
    with torch.inference_mode():
        for _ in range(3 if fused is not None else 1):
            new = per_call_us(lambda: d.write_context(feats, pos, slots, kv))
            if fused is None:
                print(f"context write of {a.rows} rows: {new:.1f} us")
                break
            d._store_context_kv = lambda *args: False  # the torch ops' path
            old = per_call_us(lambda: d.write_context(feats, pos, slots, kv))
            del d._store_context_kv
            print(f"context write of {a.rows} rows: fused kernel {new:.1f} us, torch ops {old:.1f} us")


if __name__ == "__main__":
    main()
