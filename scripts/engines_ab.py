"""Plain decoding against the default drafter in one process: two engines on the same model, waves
of requests alternated between them, so that a drifting machine slows both alike.

    .venv/bin/python scripts/engines_ab.py --model /root/widened/target-Q4_K_M.gguf \\
        --drafter /root/widened/drafter --batch 4 --prompts 16 --tokens 48
    .venv/bin/python scripts/engines_ab.py --batch 32 --max-num-seqs 8 --prompts 96 --tokens 64
        # waves of 32 requests, 8 decoding at once: continuous batching, as a server under load
    ... --spread 32   # each request's max_tokens in [tokens, tokens + 32): requests end apart

Prints each engine's total seconds, its steps and median step, how many of the drafting engine's
steps drafted nothing (paused), and the steps that carried prompt rows: how many, their rows
(prompt and decode) and their seconds.
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
    ap.add_argument("--spread", type=int, default=0,
                    help="request i asks max_tokens = tokens + (7 i mod spread): lengths apart, as real traffic")
    a = ap.parse_args()
    limit = {} if a.max_num_seqs is None else {"max_num_seqs": a.max_num_seqs}
    engines = {"plain": LLM(model=a.model, drafter="none", kv_cache_tokens=8192, **limit),
               "default": LLM(model=a.model, drafter=a.drafter, kv_cache_tokens=8192, **limit)}
    steps = collections.defaultdict(list)
    prompt_steps = collections.defaultdict(lambda: [0, 0, 0.0])  # engine -> [steps, rows, seconds]
    for name, llm in engines.items():
        eng = llm.engine
        real, forward = eng.step, eng.runner.forward
        rows = []

        def counted(items, *args, forward=forward, rows=rows, **kw):  # noqa: ANN001, ANN202
            rows.append(sum(len(t) for _, t in items) if any(kw.get("prompt_rows") or ()) else 0)
            return forward(items, *args, **kw)

        def step(real=real, name=name, eng=eng, rows=rows):  # noqa: ANN202
            rows.clear()
            t = time.perf_counter()
            out = real()
            seconds = time.perf_counter() - t
            steps[name].append((seconds, eng.spec.paused))
            if rows and rows[0]:
                ps = prompt_steps[name]
                ps[0], ps[1], ps[2] = ps[0] + 1, ps[1] + rows[0], ps[2] + seconds
            return out

        eng.step, eng.runner.forward = step, counted
    with open(a.prompts_file, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f][:a.prompts]
    sps = [SamplingParams(max_tokens=a.tokens + (7 * i) % a.spread if a.spread else a.tokens, temperature=0)
           for i in range(len(prompts))]
    total = collections.defaultdict(float)
    for i in range(0, len(prompts), a.batch):
        for name, llm in engines.items():
            t = time.perf_counter()
            llm.generate([[{"role": "user", "content": p}] for p in prompts[i:i + a.batch]], sps[i:i + a.batch])
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
        ps = prompt_steps[name]
        print(line + f"; {ps[0]} steps with prompt rows ({ps[1]} rows, {ps[2]:.2f} s)")
    print(f"default / plain throughput: {total['plain'] / total['default']:.3f}x, "
          f"tau {engines['default'].engine.spec_stats.tau:.3f}")


if __name__ == "__main__":
    main()
