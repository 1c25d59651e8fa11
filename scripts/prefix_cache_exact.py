"""Greedy outputs with prefix caching on and off, on the default model (its default drafter):
32 held-out chat prompts in three rounds at batch 16, the later rounds finding the earlier
rounds' prompt pages. Prints, per round, how many outputs equal those of the engine without
caching (every one, where prefix caching is exact: docs/flags.md).

    .venv/bin/python scripts/prefix_cache_exact.py
"""

from __future__ import annotations

import json
import pathlib

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.engine import Engine

PROMPTS = pathlib.Path(__file__).resolve().parent.parent / "data" / "heldout_chat.jsonl"


def rounds(caching: bool, prompts: list[str], num_rounds: int = 3, batch: int = 16) -> tuple[list[dict], Engine]:
    """Each round's outputs (prompt index -> token ids) and the engine that ran them."""
    engine = Engine(EngineConfig(enable_prefix_caching=caching))
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    out = []
    for r in range(num_rounds):
        done: dict[int, list[int]] = {}
        for start in range(0, len(prompts), batch):
            for i in range(start, min(start + batch, len(prompts))):
                ids = engine.prompt_ids([{"role": "user", "content": prompts[i]}], greedy)
                engine.add_request(f"r{r}-{i}", ids, greedy)
            while engine.has_unfinished():
                for o in engine.step():
                    if o.finished:
                        done[int(o.request_id.split("-")[1])] = o.token_ids
        out.append(done)
    return out, engine


def main() -> None:
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text(encoding="utf-8").splitlines()][:32]
    off, _ = rounds(False, prompts)
    on, engine = rounds(True, prompts)
    print(f"prompt tokens found in the cache: {engine.pool.prefix_hits} of {engine.pool.prefix_queries}")
    for r, got in enumerate(on):
        same = sum(got[i] == off[0][i] for i in off[0])
        print(f"round {r}: {same}/{len(off[0])} outputs equal the engine's without caching")


if __name__ == "__main__":
    main()
