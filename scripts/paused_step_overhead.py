"""Host time of decode-only steps outside the target pass: plain decoding against the default
drafter (paused for most steps at this load) and the default without prompt lookups, in one process.

    .venv/bin/python scripts/paused_step_overhead.py [--requests 8] [--rounds 8] [--steps 40]

Each round adds `requests` prompts to every engine in turn, prefills them, and times the next
`steps` steps (all of them decode-only), then lets the requests finish; the first round only
warms up (the drafter pauses during it). Prints each engine's output tokens per second over the
timed steps, its ms per step, and the ms per step spent in the target pass and in each of the
spec runner's hooks (begin_step, propose, commit, ...), with the counts of steps that were
paused, ran a drafter pass, or verified anything past the anchors.
"""

from __future__ import annotations

import argparse
import collections
import time

from step_costs import timed  # this folder: run as a script, it is on sys.path

from dspark.bench.prompts import load_prompts
from dspark.config import SamplingParams
from dspark.llm import LLM

HOOKS = ("begin_step", "propose", "commit", "observe_step", "observe_outcome")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts-file", default="data/heldout_chat.jsonl")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    prompts = load_prompts(a.prompts_file, 10**6)  # every prompt of the file
    kw = {"kv_cache_tokens": 8192, "max_num_seqs": a.requests}
    engines = {"none": LLM(drafter="none", **kw), "default": LLM(**kw), "no lookups": LLM(ngram_assist=0, **kw)}
    spent = {name: collections.Counter() for name in engines}
    calls = collections.Counter()
    for name, llm in engines.items():
        eng = llm.engine
        timed(spent[name], calls, eng.runner, "forward", "target pass")
        timed(spent[name], calls, eng.planner, "plan", "planner.plan")
        for hook in HOOKS:
            timed(spent[name], calls, eng.spec, hook, f"spec.{hook}")
    sp = SamplingParams(max_tokens=a.steps + 24, temperature=0.0, ignore_eos=True)
    total = {name: collections.Counter() for name in engines}
    for rnd in range(a.rounds):
        for name, llm in engines.items():
            eng = llm.engine
            for i in range(a.requests):
                eng.add_request(f"{rnd}-{i}", prompts[(rnd * a.requests + i) % len(prompts)], sp)
            while eng.planner.waiting or any(s.in_prefill for s in eng.planner.running):
                eng.step()
            spent[name].clear()
            before = sum(len(s.output_ids) for s in eng.planner.running)
            t, steps, counts = time.perf_counter(), 0, collections.Counter()
            while eng.planner.running and steps < a.steps:
                eng.step()
                steps += 1
                counts.update(paused=eng.spec.paused, passed=eng.spec.passed, verified=eng.spec.verified)
            seconds = time.perf_counter() - t
            tokens = sum(len(s.output_ids) for s in eng.planner.running) - before
            hooks = collections.Counter(spent[name])
            while eng.planner.running:
                eng.step()
            if rnd == 0:
                continue
            total[name].update(hooks)
            total[name].update(counts)
            total[name].update({"seconds": seconds, "steps": steps, "tokens": tokens})
    for name, t in total.items():
        n = t["steps"]
        print(f"{name}: {t['tokens'] / t['seconds']:.1f} tok/s, {1e3 * t['seconds'] / n:.2f} ms a step over {n} "
              f"steps ({t['paused']} paused, {t['passed']} drafter passes, {t['verified']} verified drafts)")
        for key in ["target pass", "planner.plan"] + [f"spec.{h}" for h in HOOKS]:
            print(f"    {key:22s} {1e3 * t[key] / n:.3f} ms")


if __name__ == "__main__":
    main()
