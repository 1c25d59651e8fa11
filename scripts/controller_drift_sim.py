"""The verify-length controller on simulated steps, with and without a machine whose speed drifts:
how close its choice of drafting or plain steps comes to always taking the better kind.

A drafting step commits 1, 2 or 3 tokens (uniform) in 0.1 s; a plain step 1 token in 0.05 g s,
so drafting gains g over plain. Each step's time takes +-10% noise; with --drift, the machine
also runs up to 2x slower at the start of every 300 steps, recovering over 60 (as a shared VM
does after an idle spell). The policy's belief is always a gain of 1.5, so only the measured rates
can pause drafting. Prints, per g, achieved tokens/s over the better kind's at full speed (mean
and worst of 20 seeds of 2,000 steps; with drift even a perfect choice stays below 1).

What it leaves out: on a real machine a plain step taken between drafting steps runs slower than
one in a run of plain steps (caches and the core's speed settle over a few steps), so a change
that looks neutral here can still tilt the real controller towards drafting (docs/benchmarks.md,
the eleventh session's section). Compare two versions of the controller by running this file
with each checkout first on PYTHONPATH.

    .venv/bin/python scripts/controller_drift_sim.py [--drift]
"""

from __future__ import annotations

import argparse
import random
import statistics

from dspark.engine.controller import VerifyLengthController
from dspark.engine.policy import Policy
from dspark.engine.sequence import SpecStats


class _Hopeful(Policy):
    """Believes drafting always pays."""
    last_gain = 1.5


def run(gain: float, seed: int, drift: bool, steps: int = 2000) -> float:
    """Tokens per second over `steps` steps chosen by the controller."""
    rng = random.Random(seed)
    c = VerifyLengthController(_Hopeful(), SpecStats())
    c.record_pass(1, 0.6)  # start-up pass: not measured
    tokens = seconds = 0.0
    for step in range(steps):
        slow = 1.0 + max(0.0, 1.0 - (step % 300) / 60) if drift else 1.0
        noise = rng.uniform(0.9, 1.1) * slow
        if c.paused():
            s, k = 0.05 * gain * noise, 1
            c.observe_outcome(1, False, k, s)
        else:
            s, k = 0.1 * noise, rng.choice((1, 2, 3))
            c.record_pass(1, 0.01)
            c.observe_outcome(1, True, k, s)
        tokens += k
        seconds += s
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drift", action="store_true")
    a = ap.parse_args()
    for gain in (0.8, 0.9, 1.0, 1.1, 1.2, 1.5):
        best = max(20.0, 1 / (0.05 * gain))
        got = [run(gain, seed, a.drift) / best for seed in range(20)]
        print(f"gain {gain}: mean {statistics.mean(got):.3f}, worst {min(got):.3f}")


if __name__ == "__main__":
    main()
