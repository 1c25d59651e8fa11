"""The default model's own quantized products by rows in the pass: one layer's gate/up and down
(int4) and the LM head (Q8_0 rows), best of 5 rounds, with whichever kernel build this CPU loads.

    .venv/bin/python scripts/layer_products.py [--rows 1,9,32] [--threads 2]

Past one row these products are compute-bound on CPUs without VNNI, and a verification pass of
k + 1 rows pays them k + 1 times (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import time

import torch

from dspark.llm import LLM


def best_seconds(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,9,32")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = LLM(drafter="none").engine.model
    mlp = model.layers[0].mlp
    head_in, vocab = model.config.hidden_size, model.config.vocab_size
    products = [("gate_up", mlp.gate_up_proj, mlp.gate_up_proj.in_features, mlp.gate_up_proj.out_features, 60),
                ("down", mlp.down_proj, mlp.down_proj.in_features, mlp.down_proj.out_features, 60),
                ("head", model.logits, head_in, vocab, 20)]
    with torch.inference_mode():
        for name, fn, k, n, calls in products:
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k)
                s = best_seconds(lambda: fn(x), calls)  # noqa: B023 - called before x changes
                print(f"{name:8s} {rows:3d} rows {s * 1e3:8.3f} ms {rows * k * n / s / 1e9:6.1f} GMAC/s")


if __name__ == "__main__":
    main()
