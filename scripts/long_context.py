"""Prefill and plain decoding after long prompts, one request at a time, prefix caching off.

The prompts are held-out chat questions joined in groups of 40 (1,000-7,600 tokens with the
default tokenizer) and a closing question; each request generates 65 tokens (EOS ignored), so its
decode rate covers 64 tokens at that depth. Compare with llama.cpp at the same depths:
`llama-bench -m MODEL.gguf -p 0 -n 64 -d 1076,1806,1734,5912,7624,1169 -t 2` (decode) and
`-p 1076,1806,5912 -n 0` (prefill).

    .venv/bin/python scripts/long_context.py [MODEL]
"""

from __future__ import annotations

import json
import pathlib
import sys

from dspark.config import SamplingParams
from dspark.llm import LLM

HELD_OUT = pathlib.Path(__file__).resolve().parent.parent / "data" / "heldout_chat.jsonl"


def long_prompts(per: int = 40, count: int = 6) -> list[str]:
    questions = [json.loads(line)["prompt"] for line in HELD_OUT.open()]
    return ["Here are some questions people asked:\n\n" + "\n\n".join(questions[i * per:(i + 1) * per])
            + "\n\nWhich of these questions is the hardest, and why?" for i in range(count)]


def main() -> None:
    llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else None, drafter="none", enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    llm.generate(["hi"], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    for p in long_prompts():
        ids = tok(p)["input_ids"]
        o = llm.generate([ids], SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True))[0]
        print(f"depth {len(ids)}: prefill {len(ids) / o.ttft:.0f} tok/s ({o.ttft:.2f} s)  "
              f"decode {64 / o.decode_time:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
