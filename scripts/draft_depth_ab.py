"""Drafter passes as deep as the policy verifies, against the whole block, in one process: engine
variants on the same model, waves of B requests alternated between them (the order flipping
every wave, the first wave a warm-up), so that a drifting machine slows all alike.

    .venv/bin/python scripts/draft_depth_ab.py --batch 1 --waves 24
    .venv/bin/python scripts/draft_depth_ab.py --batch 4 --waves 8 --tokens 64

Variants (--variants, comma-separated): plain (--drafter none); default; steady (the default
never pausing: every step drafts, so a step's cost is a drafting step's); idle (the default always
paused: what a step that drafts nothing costs beside plain); fixedK (the fixed policy
verifying K tokens); and any of default/steady with "-whole" (every pass runs the drafter's whole
block, as before passes followed the policy's depth). A variant may end in ":ATTR=VALUE", which sets
one of the controller's constants on that engine alone (e.g. "default:GAIN_EMA=0.1"). Prints each
variant's output tok/s, its ratio to the first variant, and its tau.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import time

from dspark.config import SamplingParams
from dspark.llm import LLM


def make(name: str) -> LLM:
    """One engine variant (see the module docstring)."""
    name, _, setting = name.partition(":")
    if setting:  # a controller constant changed on this engine alone, as "default:GAIN_EMA=0.1"
        llm = make(name)
        attr, _, value = setting.partition("=")
        controller = llm.engine.spec.controller
        if not hasattr(controller, attr):
            raise SystemExit(f"the controller has no {attr!r}")
        setattr(controller, attr, type(getattr(controller, attr))(value))
        return llm
    if name == "plain":
        return LLM(drafter="none", kv_cache_tokens=8192)
    if name.startswith("fixed"):
        return LLM(kv_cache_tokens=8192, policy="fixed", block_size=int(name[5:]))
    if name == "idle":  # paused as a real pause is: its context writes wait (skip_steps > 0)
        llm = LLM(kv_cache_tokens=8192)
        llm.engine.spec.controller.paused = lambda *a, **k: True
        llm.engine.spec.controller.skip_steps = 10**9
        return llm
    base, _, suffix = name.partition("-")
    if base not in ("default", "steady") or suffix not in ("", "whole"):
        raise SystemExit(f"unknown variant {name!r}")
    llm = LLM(kv_cache_tokens=8192)
    spec = llm.engine.spec
    controller = spec.controller
    if suffix == "whole":
        block = spec.proposer.drafter.config.block_size
        spec.proposer._block_length = lambda budgets: block  # noqa: SLF001 - the variant under test
        controller.draft_width = lambda budget: budget
    if base == "steady":
        never_pause(controller)
    return llm


def never_pause(controller) -> None:  # noqa: ANN001 - a VerifyLengthController
    """Every step drafts: no pause is taken, and none a pass would start is kept."""
    controller.paused = lambda *a, **k: False
    record = controller.record_pass

    def never_pausing(*a, **k) -> None:  # noqa: ANN002, ANN003
        record(*a, **k)
        controller.skip_steps = 0

    controller.record_pass = never_pausing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="plain,default,default-whole,steady,steady-whole")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--waves", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts-file", default="data/heldout_chat.jsonl")
    ap.add_argument("--shuffle", type=int, default=None, metavar="SEED", help="prompts in a seeded order")
    a = ap.parse_args()
    names = a.variants.split(",")
    engines = {n: make(n) for n in names}
    with open(a.prompts_file, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    if a.shuffle is not None:  # the file is sorted by category: a seeded mix of all of them
        random.Random(a.shuffle).shuffle(prompts)
    sp = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    waves = [prompts[w * a.batch:(w + 1) * a.batch] for w in range(a.waves + 1)]
    measure(engines, waves, sp, warm_up=True, rotate=False)


def measure(engines: dict[str, LLM], waves: list[list[str]], sp: SamplingParams, warm_up: bool,
            rotate: bool) -> None:
    """Each wave of prompts (chat messages) through every engine in turn, the order flipping every
    wave (rotate: rotating by one, for more than two engines); warm_up: the first wave is not
    measured. Prints each engine's output tok/s, its ratio to the first engine's, and its tau."""
    names = list(engines)
    seconds, tokens, steps = collections.defaultdict(float), collections.Counter(), collections.Counter()
    for w, wave in enumerate(waves):
        if rotate:
            order = names[w % len(names):] + names[:w % len(names)]
        else:
            order = names if w % 2 == 0 else names[::-1]
        for n in order:
            eng = engines[n].engine
            s0, g0 = eng.spec_stats.steps, eng.spec_stats.generated
            t = time.perf_counter()
            engines[n].generate([[{"role": "user", "content": p}] for p in wave], sp)
            if w or not warm_up:
                seconds[n] += time.perf_counter() - t
                tokens[n] += eng.spec_stats.generated - g0
                steps[n] += eng.spec_stats.steps - s0
    first = tokens[names[0]] / seconds[names[0]]
    for n in names:
        rate = tokens[n] / seconds[n]
        print(f"{n}: {rate:.1f} tok/s ({rate / first:.3f}x {names[0]}), tau {tokens[n] / max(1, steps[n]):.3f}")


if __name__ == "__main__":
    main()
