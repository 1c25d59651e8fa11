"""A seeded sampled request gives the tokens plain decoding with that seed gives, token for token,
whatever drafts it: DSpark chains and trees, EAGLE-3 and n-gram chains, draft models, per-request
block sizes and the load-aware policy (whose verify lengths follow the clock)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from spec_helpers import alphabet_prompts, make_engine, run_requests

from dspark.config import SamplingParams
from dspark.engine.sampling import RACE_BLOCK, position_noise, race_sample

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

SAMPLED = [SamplingParams(temperature=0.8, max_tokens=16, seed=11),
           SamplingParams(temperature=1.0, top_k=4, max_tokens=16, seed=12),
           SamplingParams(temperature=0.6, top_p=0.9, min_p=0.05, max_tokens=16, seed=2**64 - 1)]


@pytest.fixture(scope="module")
def requests():
    prompts = alphabet_prompts([15, 24, 33], seed=5)
    return [(p, sp) for p in prompts for sp in SAMPLED]


@pytest.fixture(scope="module")
def plain(folders, requests):
    engine = make_engine(folders["target"], "none")
    return [o.token_ids for o in run_requests(engine, [(p, sp, None) for p, sp in requests])]


def test_position_noise_is_a_fixed_function_of_seed_and_position():
    a = position_noise([7] * 100, list(range(100)), 600)
    assert a.shape == (100, 3 + RACE_BLOCK) and (a > 0).all() and torch.isfinite(a).all()
    assert torch.equal(a[40:60], position_noise([7] * 20, list(range(40, 60)), 600))
    assert torch.equal(position_noise([9, 7, 2**64 - 1], [5, 3, 3], 600)[1], a[3])  # rows are independent
    assert not torch.equal(position_noise([8], [3], 600)[0], a[3])
    assert not torch.equal(position_noise([7 + 2**32], [3], 600)[0], a[3])  # the seed's high bits count
    assert abs(float(a.mean()) - 1) < 0.02 and abs(float(a.var()) - 1) < 0.05  # Exp(1)


def _probs(seed: int, V: int, scale: float) -> torch.Tensor:
    return (torch.randn(V, generator=torch.Generator().manual_seed(seed)) * scale).softmax(-1)


def test_race_sample_is_exact():
    """20,000 races over a 600-token distribution (blocks padded past the vocabulary): chi-square."""
    stats = pytest.importorskip("scipy.stats")
    p = _probs(0, 600, 2.0)
    n = 20_000
    tok = race_sample(p.expand(n, -1), position_noise([3] * n, list(range(n)), 600))
    counts = torch.bincount(tok, minlength=600).double()
    big = p * n >= 5  # chi-square wants expected counts of 5 or more: pool the rest
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([p[big].double(), p[~big].double().sum()[None]])
    exp = exp / exp.sum() * n
    assert float(stats.chisquare(obs.numpy(), exp.numpy()).pvalue) > 1e-3


def test_race_sample_barely_moves_with_rounding_and_couples_close_distributions():
    """A rounding-sized change of the probabilities keeps the token; a 10%-TV change mostly does
    (the drafter's tokens agree with the target's where their distributions do)."""
    n, V = 4000, 49152
    noise = position_noise([5] * n, list(range(n)), V)
    p = _probs(1, V, 3.0)
    same = race_sample(p.expand(n, -1), noise)
    wiggle = p * (1 + 1e-6 * torch.randn(V, generator=torch.Generator().manual_seed(2)))
    assert (race_sample(wiggle.expand(n, -1), noise) == same).float().mean() > 0.999
    q = 0.9 * p + 0.1 * _probs(3, V, 3.0)
    assert (race_sample(q.expand(n, -1), noise) == same).float().mean() > 0.8


SPEC = [("dspark", {}), ("dspark", {"tree": True, "tree_budget": 10, "tree_topk": 2}),
        ("dspark", {"policy": "load-aware"}), ("dspark_soft", {}), ("ngram", {}), ("eagle3", {}),
        ("draft_model", {})]


@pytest.mark.parametrize("drafter,kw", SPEC, ids=["dspark", "dspark-tree", "dspark-load-aware", "dspark-soft",
                                                  "ngram", "eagle3", "draft-model"])
def test_seeded_output_equals_plain_decoding(folders, requests, plain, drafter, kw, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))  # the load-aware cost profile lands here
    if drafter == "draft_model":
        spec = {"drafter": None, "draft_model": folders["draft_model"], "block_size": 4}
    else:
        spec = {"drafter": folders.get(drafter, drafter)}
    engine = make_engine(folders["target"], **spec, **kw)
    # per-request block sizes in one batch (trees and the draft model: the engine's)
    cap = 0 if kw.get("tree") or drafter == "draft_model" else {"dspark_soft": 4, "eagle3": 5}.get(drafter, 8)
    blocks = [min(b, cap) or None for b in (8, 2, 5, 8, 1, 3, 6, 4, 8)]
    outs = run_requests(engine, [(p, sp, b) for (p, sp), b in zip(requests, blocks)])
    assert [o.token_ids for o in outs] == plain
    assert engine.spec_stats.accepted > 0, engine.spec_stats.as_dict()
    # again, one at a time: the same tokens without neighbours
    again = run_requests(engine, [(p, dataclasses.replace(sp), None) for p, sp in requests[:2]])
    assert [o.token_ids for o in again] == plain[:2]
