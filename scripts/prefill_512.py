"""Prefill speed of one 512-token prompt in one engine step, to set beside `llama-bench -p 512`.

    .venv/bin/python scripts/prefill_512.py FILE.gguf            # e.g. /root/widened/target-Q4_0.gguf
    ~/.cache/dspark/llama.cpp/build/bin/llama-bench -m FILE.gguf -p 512 -n 0 -r 3 -t 2

Four prompts of random token ids, one after another (the first warms up); prints each one's time
and the median tok/s of the last three. NO_PROMPT_KERNEL=1 sends prompt rows through the decode
kernels instead of `mm_prompt` (what the engine did before it).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from dspark.config import EngineConfig, SamplingParams, SpecConfig
from dspark.engine.engine import Engine
from dspark.models.quant import Int4Linear, Q8Linear


def main(model: str, tokens: int = 512) -> None:
    if os.environ.get("NO_PROMPT_KERNEL"):
        for cls in (Int4Linear, Q8Linear):
            cls._prompt_args = lambda self: None
    engine = Engine(EngineConfig(model=model, spec=SpecConfig(drafter="none"), max_num_batched_tokens=2 * tokens))
    print("linears:", engine.quantization)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rates = []
    for rep in range(4):
        engine.add_request(f"p{rep}", torch.randint(100, 40000, (tokens,), generator=g).tolist(), params)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        seconds = time.perf_counter() - t0
        rates.append(tokens / seconds)
        print(f"prompt {rep}: {seconds:.2f} s, {rates[-1]:.1f} tok/s")
    print(f"median of the last 3: {statistics.median(rates[1:]):.1f} tok/s")


if __name__ == "__main__":
    main(sys.argv[1])
