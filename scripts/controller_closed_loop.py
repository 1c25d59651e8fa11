"""The verify-length controller under a closed loop in one process: C requests in flight, a new one
queued as soon as one finishes (as `dspark bench serve --concurrency C` does, without HTTP), the
default engine. Prints the throughput, then per number of decoding requests and step kind (True: a
drafter pass, False: plain, "lookup": looked-up chains verified while paused) the steps, tok/s and
ms a step the controller measured, and the order of kinds at C requests (D drafting, . plain,
L lookups).

    .venv/bin/python scripts/controller_closed_loop.py --concurrency 4 --requests 64
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
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts-file", default="data/heldout_chat.jsonl")
    ap.add_argument("--drafter", default=None, help="default: the shipped drafter; 'none' for plain decoding")
    a = ap.parse_args()
    with open(a.prompts_file, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    sp = SamplingParams(max_tokens=a.tokens, temperature=0)
    engine = LLM(drafter=a.drafter, kv_cache_tokens=16384).engine
    controller = engine.spec.controller
    log = []
    if controller is not None:
        observe = controller.observe_outcome

        def logged(D, kind, committed, seconds):  # noqa: ANN001, ANN202, N803
            log.append((D, kind, committed, seconds))
            return observe(D, kind, committed, seconds)

        controller.observe_outcome = logged
    sent, steps, t = 0, 0, time.perf_counter()
    while True:
        while len(engine.running) + len(engine.waiting) < a.concurrency and sent < a.requests:
            engine.add_request(f"r{sent}", [{"role": "user", "content": prompts[sent % len(prompts)]}], sp)
            sent += 1
        if not engine.has_unfinished():
            break
        engine.step()
        steps += 1
    seconds = time.perf_counter() - t
    generated = engine.spec_stats.generated
    print(f"{generated} tokens in {seconds:.2f} s = {generated / seconds:.1f} tok/s, {steps} steps, "
          f"{controller.num_draft_passes if controller else 0} drafter passes")
    by = collections.defaultdict(lambda: [0, 0, 0.0])
    for D, kind, committed, secs in log:  # noqa: N806
        b = by[D, kind]
        b[0], b[1], b[2] = b[0] + 1, b[1] + committed, b[2] + secs
    for (D, kind), (n, committed, secs) in sorted(by.items(), key=str):  # noqa: N806
        print(f"D={D} {kind!s:6}: {n:4d} steps, {committed / secs:7.1f} tok/s, {1e3 * secs / n:6.2f} ms a step, "
              f"{committed / n:.2f} tokens a step")
    marks = {True: "D", False: ".", "lookup": "L"}
    print("".join(marks[kind] for D, kind, _, _ in log if D == a.concurrency))  # noqa: N806


if __name__ == "__main__":
    main()
