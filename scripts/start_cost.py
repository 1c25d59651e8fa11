"""What starting an engine costs: wall seconds to a ready Engine on the default model (plain
decoding), and the process's peak resident memory after a 20-token greedy request.

    .venv/bin/python scripts/start_cost.py

Run it twice: the first start of a new checkout also builds the CPU kernels and converts the
GGUF (both cached under ~/.cache/dspark)."""

import resource
import time

from dspark.config import EngineConfig, SamplingParams, SpecConfig
from dspark.engine.engine import Engine

t0 = time.perf_counter()
engine = Engine(EngineConfig(device="cpu", spec=SpecConfig(drafter="none")))
print(f"engine ready in {time.perf_counter() - t0:.2f} s; linears {engine.quantization}")
engine.add_request("a", "Hello, how are you?", SamplingParams(temperature=0, max_tokens=20))
tokens: list[int] = []
while engine.has_unfinished():
    tokens += [t for o in engine.step() if o.finished for t in o.token_ids]
print(f"tokens {tokens}")
print(f"peak resident memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")
