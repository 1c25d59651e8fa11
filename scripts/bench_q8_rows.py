"""Q8_0 linears on AMX with bf16 rows (``amx.mm``) against int8 rows (``amx.mm8``), hot in cache.

SmolLM2-135M's MLP shape (3072 x 576) and the LM head (49152 x 576) at 1, 8 and 16 rows; the
median of 300 calls each. Usage: .venv/bin/python scripts/bench_q8_rows.py
"""

from __future__ import annotations

import statistics
import time

import torch

from dspark.models import cpu_ops
from dspark.models.quant import Q8Linear, quantize_q8_0


def median_us(lin: Q8Linear, x: torch.Tensor, calls: int = 300) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        lin(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    amx = cpu_ops.quant()
    if amx is None:
        raise SystemExit("no AMX or VNNI kernels on this CPU (or no compiler)")
    for n in (3072, 49152):
        codes, scale = quantize_q8_0(torch.randn(n, 576) * 0.05)
        bf16, int8 = Q8Linear(codes, scale, amx), Q8Linear(codes, scale, amx, int8_rows=True)
        for rows in (1, 8, 16):
            x = torch.randn(rows, 576).bfloat16()
            print(f"{n:6d} x 576, {rows:2d} rows: bf16 rows {median_us(bf16, x):8.1f} us, "
                  f"int8 rows {median_us(int8, x):8.1f} us")


if __name__ == "__main__":
    main()
