"""What a drafting step costs at fixed chain lengths, against a plain step, in one process: engines
for plain decoding and for the drafter verifying exactly k draft tokens a step (`--spec-policy
fixed`, n-gram assist off), each prompt run on every engine in turn so that a drifting machine
slows all alike. Prints per engine tok/s, tau, ms per step and the drafter pass's ms per step.

    .venv/bin/python scripts/fixed_chain_costs.py --prompts 13 --lengths 1,2,3
"""

from __future__ import annotations

import argparse
import json
import time

from dspark.config import SamplingParams
from dspark.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--drafter", default=None, help="default: the shipped one")
    ap.add_argument("--prompts-file", default="data/heldout_chat.jsonl")
    ap.add_argument("--prompts", type=int, default=13, help="the first is a warm-up")
    ap.add_argument("--lengths", default="1,2,3", help="draft tokens verified per step, comma-separated")
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    prompts = [json.loads(line)["prompt"] for line in open(a.prompts_file)][:a.prompts]
    engines = {"plain": LLM(model=a.model, drafter="none", kv_cache_tokens=8192)}
    for k in (int(x) for x in a.lengths.split(",")):
        engines[f"k={k}"] = LLM(model=a.model, drafter=a.drafter, policy="fixed", block_size=k, ngram_assist=0,
                                kv_cache_tokens=8192)
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    totals = {name: [0.0, 0, 0, 0.0] for name in engines}  # seconds, tokens, steps, drafter seconds
    for i, prompt in enumerate(prompts):
        for name, llm in engines.items():
            eng = llm.engine
            steps, generated, drafted = eng.spec_stats.steps, eng.spec_stats.generated, eng.draft_time
            t = time.perf_counter()
            llm.generate([[{"role": "user", "content": prompt}]], params)
            if i == 0:
                continue  # warm-up
            t_ = totals[name]
            t_[0] += time.perf_counter() - t
            t_[1] += eng.spec_stats.generated - generated
            t_[2] += eng.spec_stats.steps - steps
            t_[3] += eng.draft_time - drafted
    plain = totals["plain"][1] / totals["plain"][0]
    for name, (sec, tok, steps, draft) in totals.items():
        print(f"{name}: {tok / sec:.1f} tok/s ({tok / sec / plain:.3f}x plain), tau {tok / steps:.3f}, "
              f"{1e3 * sec / steps:.2f} ms a step, drafter {1e3 * draft / steps:.2f} ms a step")


if __name__ == "__main__":
    main()
