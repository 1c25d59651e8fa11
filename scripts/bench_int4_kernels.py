"""The int4 kernels side by side: ours (csrc/quant_amx.cpp: AMX tiles, or VNNI where the CPU has no
AMX) and torch's `_weight_int4pack_mm_for_cpu`.

Per linear of SmolLM2-135M's shapes (random weights, bf16, alone in a loop: the weights stay in
cache), then all 120 linears of the model in a row (cold from memory, as in a real pass); the best
of several repeats. Usage: .venv/bin/python scripts/bench_int4_kernels.py
"""

from __future__ import annotations

import os
import time

import torch

from dspark.models.quant import Int4Linear, quantize_int4

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down
ROWS = (1, 4, 9, 16, 144)


def best_of(calls: list[tuple[Int4Linear, torch.Tensor]], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` rounds, each calling every (linear, input) once."""
    out = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        for lin, x in calls:
            lin(x)
        out = min(out, time.perf_counter() - t)
    return out


def layers(kind: str, shapes: list[tuple[int, int]]) -> list[Int4Linear]:
    before = os.environ.get("DSPARK_CPU_OPS")
    os.environ["DSPARK_CPU_OPS"] = "1" if kind == "amx" else "0"
    try:
        made = [Int4Linear(quantize_int4(torch.randn(n, k) * 0.05), None, torch.bfloat16) for n, k in shapes]
    finally:
        if before is None:
            os.environ.pop("DSPARK_CPU_OPS")
        else:
            os.environ["DSPARK_CPU_OPS"] = before
    if kind == "amx" and made[0].amx is None:
        raise SystemExit("no AMX or VNNI kernel on this machine")
    return made


def main() -> None:
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}; microseconds per call (one linear, warm)")
    print("shape       " + "".join(f"  amx M={m:<4} torch M={m:<4}" for m in ROWS))
    for (n, k), amx, ref in zip(SHAPES, layers("amx", SHAPES), layers("torch", SHAPES)):
        cells = []
        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            cells += [best_of([(amx, x)] * 20, 10) / 20 * 1e6, best_of([(ref, x)] * 20, 10) / 20 * 1e6]
        print(f"{n:4d} x {k:4d} " + "".join(f"  {c:10.1f}" for c in cells))
    model = SHAPES * 30
    print("all 120 linears of the model, cold (ms)")
    for kind in ("amx", "torch"):
        lins = layers(kind, model)
        for m in (1, 4, 9, 16, 32, 144):
            xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
            ms = best_of([(lin, xs[lin.in_features]) for lin in lins], 10) * 1e3
            print(f"  {kind:5s} M={m:<3d} {ms:6.2f}")


if __name__ == "__main__":
    main()
