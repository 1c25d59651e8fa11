"""min_p (vLLM's): after temperature, tokens less likely than min_p times the most likely one are
dropped, before top-k and top-p. By hand on small distributions, and through the engine: seeded
sampling with drafts (chains and trees) matches the target's min-p distribution exactly."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch
from spec_helpers import make_engine, run_requests
from test_spec_lossless import PASS, SMALL_PROMPT, chi2_pvalue, small  # noqa: F401 - small is a fixture

from dspark.config import SamplingParams
from dspark.engine.sampling import warp_logits
from dspark.models.loader import load_transformers_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("t,min_p,k,want", [
    (1.0, 0.6, 0, [4 / 7, 3 / 7, 0.0, 0.0]),  # keeps p >= 0.24
    (1.0, 0.45, 0, [4 / 9, 3 / 9, 2 / 9, 0.0]),  # keeps p >= 0.18
    (1.0, 1.0, 0, [1.0, 0.0, 0.0, 0.0]),
    (1.0, 0.0, 0, [0.4, 0.3, 0.2, 0.1]),
    (1.0, 0.2, 2, [4 / 7, 3 / 7, 0.0, 0.0]),  # min-p first, then top-k
])
def test_min_p_by_hand(t, min_p, k, want):
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    probs = warp_logits(logits, torch.tensor(t), torch.tensor(k), torch.tensor(1.0), torch.tensor(min_p))
    assert torch.allclose(probs, torch.tensor(want), atol=1e-6), probs


def test_min_p_applies_after_temperature():
    """At T = 2 the probabilities flatten (sqrt), so a cut that drops 0.1 at T = 1 keeps it."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    cold = warp_logits(logits, torch.tensor(1.0), torch.tensor(0), torch.tensor(1.0), torch.tensor(0.3))
    hot = warp_logits(logits, torch.tensor(2.0), torch.tensor(0), torch.tensor(1.0), torch.tensor(0.3))
    assert cold[3] == 0 and hot[3] > 0  # sqrt(0.1 / 0.4) = 0.5 >= 0.3


def _exact(folder: str, t: float, min_p: float) -> dict:

    hf = load_transformers_model(folder).eval()

    def dist(ctx):
        with torch.no_grad():
            logits = hf(torch.tensor([SMALL_PROMPT + ctx])).logits[0, -1].double()
        p = (logits / t).softmax(-1)
        keep = (p >= min_p * p.max()).nonzero()[:, 0]
        return dict(zip(keep.tolist(), (p[keep] / p[keep].sum()).tolist()))

    return {(a, b, c): pa * pb * pc for a, pa in dist([]).items() for b, pb in dist([a]).items()
            for c, pc in dist([a, b]).items()}


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampled_min_p_matches_the_target(small, tree):  # noqa: F811
    engine = make_engine(small["small_target"], small["small_dspark"], tree=tree, tree_budget=4, tree_topk=2,
                         max_num_seqs=1000)
    sp = SamplingParams(temperature=1.3, min_p=0.15, max_tokens=4, ignore_eos=True)
    outs = run_requests(engine, [(SMALL_PROMPT, dataclasses.replace(sp, seed=i), None) for i in range(3000)])
    exact = _exact(small["small_target"], 1.3, 0.15)
    seen = Counter(tuple(o.token_ids[:3]) for o in outs)
    assert not set(seen) - set(exact), "a token below the min-p cut was sampled"
    keys = sorted(exact)
    pv = chi2_pvalue(np.array([seen.get(x, 0) for x in keys]), np.array([exact[x] for x in keys]))
    assert pv > PASS, f"p-value {pv}"
    assert 0 < engine.spec_stats.accepted < engine.spec_stats.verified
