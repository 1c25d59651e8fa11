"""What prompt rows cost the target's decoder stack through the CPU's prompt path (the AMX prompt
GEMM, mm_prompt) and through the decode kernels, on the embedded model: passes with prompt rows
are captured from a plain engine (a few-token prompt chunk beside 15 decoding requests, and
prompts of 64 to 512 tokens alone), then each call is replayed both ways.

    .venv/bin/python scripts/prompt_rows_cost.py [--prompts-file data/heldout_chat.jsonl]

Prints the rows of each pass, its prompt rows, and the median ms of each path (20 replays; 7
for the long prompts). Where prompt rows have no path of their own (no AMX) both columns take
the decode kernels. What `--prompt-gemm-min-tokens` was chosen from (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

from dspark.bench.prompts import load_prompts
from dspark.config import SamplingParams
from dspark.llm import LLM
from dspark.models import cpu_ops


def median_ms(stack, args: tuple, reps: int) -> float:  # noqa: ANN001 - the kernel
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        stack(*args)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts-file", default="data/heldout_chat.jsonl")
    a = ap.parse_args()
    ops = cpu_ops.load()
    if ops is None or not hasattr(ops, "decode_stack"):
        raise SystemExit("the CPU kernels (decode_stack) are not built here")
    stack, calls = ops.decode_stack, []

    def grab(h, weights, *rest):  # noqa: ANN001, ANN002, ANN202
        if len(weights) > 100 and rest[-3].numel() > 0:  # the target's stack, with prompt rows
            calls.append((h.clone(), weights, rest))
        return stack(h, weights, *rest)

    ops.decode_stack = grab
    prompts = load_prompts(a.prompts_file, 10**6)  # every prompt of the file
    # every prompt on the prompt path while capturing, so that each pass holds prompt rows
    eng = LLM(drafter="none", kv_cache_tokens=16384, max_num_seqs=32, prompt_gemm_min_tokens=0).engine
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(15):
        eng.add_request(f"decode-{i}", prompts[i], sp)
    for _ in range(30):
        eng.step()
    calls.clear()
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for i, n in enumerate((4, 16, 32)):  # a chunk of n prompt tokens beside the decodes
        eng.add_request(f"chunk-{i}", eng.prompt_ids(prompts[20 + i], one)[:n], one)
        eng.step()
    while eng.has_unfinished():
        eng.step()
    beside = len(calls)
    text = " ".join(prompts[:40])
    for i, n in enumerate((64, 128, 256, 512)):  # whole prompts alone
        eng.add_request(f"long-{i}", eng.prompt_ids(text, one)[7 * i:7 * i + n], one)
        while eng.has_unfinished():
            eng.step()
    ops.decode_stack = stack
    print("rows  prompt rows  prompt path ms  decode kernels ms")
    for j, (h, weights, rest) in enumerate(calls):
        reps = 20 if j < beside else 7
        decode = (*rest[:-1], [])  # no linear takes mm_prompt: every row on the decode kernels
        print(f"{h.shape[0]:4d}  {rest[-3].numel():11d}  {median_ms(stack, (h, weights, *rest), reps):14.2f}  "
              f"{median_ms(stack, (h, weights, *decode), reps):17.2f}")


if __name__ == "__main__":
    main()
