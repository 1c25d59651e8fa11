"""Plain decoding against the default drafter in one process: two engines on the same model, waves
of requests alternated between them, so that a drifting machine slows both alike.

    .venv/bin/python scripts/engines_ab.py --model /root/widened/target-Q4_K_M.gguf \\
        --drafter /root/widened/drafter --batch 4 --prompts 16 --tokens 48
    .venv/bin/python scripts/engines_ab.py --batch 32 --max-num-seqs 8 --prompts 96 --tokens 64
        # waves of 32 requests, 8 decoding at once: continuous batching, as a server under load

Prints each engine's total seconds, its steps and median step, and how many of the drafting
engine's steps drafted nothing (paused).
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from dspark.config import SamplingParams
from dspark.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default=None, help="the drafting engine's drafter (default: the shipped one)")
    ap.add_argument("--prompts-file", default="data/heldout_chat.jsonl")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="requests decoding at once (a wave larger than this: continuous batching)")
    a = ap.parse_args()
    limit = {} if a.max_num_seqs is None else {"max_num_seqs": a.max_num_seqs}
    engines = {"plain": LLM(model=a.model, drafter="none", kv_cache_tokens=8192, **limit),
               "default": LLM(model=a.model, drafter=a.drafter, kv_cache_tokens=8192, **limit)}
    steps = collections.defaultdict(list)
    for name, llm in engines.items():
        eng = llm.engine
        real = eng.step

        def step(real=real, name=name, eng=eng):  # noqa: ANN202
            t = time.perf_counter()
            out = real()
            steps[name].append((time.perf_counter() - t, eng.spec.paused))
            return out

        eng.step = step
    with open(a.prompts_file, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f][:a.prompts]
    sp = SamplingParams(max_tokens=a.tokens, temperature=0)
    total = collections.defaultdict(float)
    for i in range(0, len(prompts), a.batch):
        for name, llm in engines.items():
            t = time.perf_counter()
            llm.generate([[{"role": "user", "content": p}] for p in prompts[i:i + a.batch]], sp)
            total[name] += time.perf_counter() - t
    for name in engines:
        times = sorted(t for t, _ in steps[name])
        paused = sorted(t for t, p in steps[name] if p)
        drafting = sorted(t for t, p in steps[name] if not p)
        line = (f"{name}: {total[name]:.2f} s, {len(times)} steps, median step {1e3 * times[len(times) // 2]:.1f} ms, "
                f"mean {1e3 * sum(times) / len(times):.1f} ms, "
                f"slowest tenth {1e3 * sum(times[-len(times) // 10:]):.0f} ms in all, paused {len(paused)}")
        if paused and drafting and name != "plain":
            line += (f" (median {1e3 * paused[len(paused) // 2]:.1f} ms; the {len(drafting)} drafting steps' "
                     f"{1e3 * drafting[len(drafting) // 2]:.1f} ms)")
        print(line)
    print(f"default / plain throughput: {total['plain'] / total['default']:.3f}x, "
          f"tau {engines['default'].engine.spec_stats.tau:.3f}")


if __name__ == "__main__":
    main()
