"""How the machine's speed recovers after the engine stops for a while: one decode pass of the
default model (one row at context 256) repeated, then a 40 ms spell of sleep or of the main thread
spinning in Python (the worker thread idle), then the next 30 passes' milliseconds. On the 2-core
AMX VM of docs/benchmarks.md the passes after either spell ran up to ~2x slower, recovering over
~20 passes; with no spell they did not.

    .venv/bin/python scripts/idle_slowdown.py none sleep spin none sleep spin
"""

from __future__ import annotations

import sys
import time

import torch

from dspark.bench.roofline import eager_pass
from dspark.engine.attention import make_backend
from dspark.engine.kv_cache import KVCache
from dspark.models.loader import load_model


def main() -> None:
    spells = sys.argv[1:] or ["none", "sleep", "spin"]
    model, _ = load_model(None, torch.device("cpu"), torch.bfloat16, "auto")  # the default model
    c = model.config
    page, context = 16, 256
    kv = KVCache(c.num_hidden_layers, -(-(context + 1) // page), page, c.num_key_value_heads, c.head_dim,
                 torch.bfloat16, torch.device("cpu"))
    step = eager_pass(model, make_backend("auto", torch.device("cpu")), kv, 1, 1, context)
    with torch.inference_mode():
        def one_pass() -> float:
            t = time.perf_counter()
            step()
            return 1e3 * (time.perf_counter() - t)

        for _ in range(100):
            one_pass()
        for spell in spells:
            t = time.perf_counter()
            if spell == "sleep":
                time.sleep(0.04)
            elif spell == "spin":
                while time.perf_counter() - t < 0.04:
                    pass
            print(f"{spell:<6}", " ".join(f"{one_pass():.1f}" for _ in range(30)), flush=True)


if __name__ == "__main__":
    main()
