"""The CPU attention kernels alone (csrc/attend.cpp): ``attend`` (decode rows, chains, trees) and
``attend_causal`` (prompt chunks), microseconds per call of one layer's attention, keys in whole
pages of the cache as a served request holds them.

    .venv/bin/python scripts/attend_bench.py [--heads 9,3] [--head-dim 64] [--rounds 20]

Cases are (kernel, requests, query rows per request, cached keys); rounds alternate the cases so
the machine's drift lands on all alike; the median of the rounds is printed. To compare two
builds, run it on each checkout in turn, several times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark.models import cpu_ops

CASES = [("attend", 1, 1, 256), ("attend", 8, 1, 256), ("attend", 1, 9, 256), ("attend", 8, 4, 256),
         ("attend", 1, 1, 1024), ("causal", 1, 64, 64), ("causal", 1, 256, 0), ("causal", 1, 64, 512)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="9,3", help="query heads, KV heads (default: SmolLM2-135M's)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    ops = cpu_ops.load()
    if ops is None or not hasattr(ops, "attend_causal"):
        raise SystemExit("no AVX512 CPU kernels here (attend_causal is AVX512-only)")
    nh, nkv = (int(v) for v in args.heads.split(","))
    d = args.head_dim
    g = torch.Generator().manual_seed(0)
    slots = 20000
    kc = torch.randn(slots, nkv, d, generator=g).bfloat16()
    vc = torch.randn(slots, nkv, d, generator=g).bfloat16()
    calls = []
    for kind, reqs, rows, cached in CASES:
        keys = cached + rows
        gather = torch.stack([torch.arange(keys) + 2048 * r for r in range(reqs)])  # each request's own pages
        q = torch.randn(reqs * rows, nh, d, generator=g).bfloat16()
        q_index = torch.arange(reqs * rows).view(reqs, rows)
        visible = (cached + 1 + torch.arange(rows)).repeat(reqs, 1)
        mask = (torch.arange(keys)[None, None, :] < visible[:, :, None]).contiguous()
        out = torch.empty_like(q)
        if kind == "attend":
            def call(q=q, gather=gather, q_index=q_index, mask=mask, out=out):
                ops.attend(q, kc, vc, gather, q_index, mask, d ** -0.5, out)
        else:
            def call(q=q, gather=gather, q_index=q_index, visible=visible, out=out):
                ops.attend_causal(q, kc, vc, gather, q_index, visible, d ** -0.5, out)
        calls.append((f"{kind} {reqs}x{rows} rows over {cached} cached keys", call))
    times: dict[str, list[float]] = {name: [] for name, _ in calls}
    for r in range(args.rounds + 1):
        for name, call in calls:
            t = time.perf_counter()
            for _ in range(10):
                call()
            if r:  # the first round warms up
                times[name].append((time.perf_counter() - t) / 10)
    print(f"{nh} query heads, {nkv} KV heads of {d}, {torch.get_num_threads()} threads; us per call, median of "
          f"{args.rounds} rounds")
    for name, ts in times.items():
        print(f"  {name:<40} {1e6 * statistics.median(ts):8.1f}")


if __name__ == "__main__":
    main()
