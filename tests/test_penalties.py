"""Presence, frequency and repetition penalties (vLLM's), applied to every verified row with the
drafts before it: greedy output equals transformers' penalized argmax with and without speculation
(chains and trees), and seeded sampling through the engine matches the penalized target exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from spec_helpers import alphabet_prompts, make_engine, run_requests
from test_spec_lossless import PASS, SMALL_PROMPT, chi2_pvalue

from dspark.config import SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

PENALTIES = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "repetition_penalty": 1.4}


def penalize(logits: torch.Tensor, prompt: list[int], out: list[int], presence: float, frequency: float,
             repetition: float) -> torch.Tensor:
    """vLLM's order by hand: repetition over prompt and output, then frequency and presence."""
    x = logits.clone()
    for t in set(prompt) | set(out):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(out):
        x[t] -= frequency * out.count(t) + presence
    return x


def _hf(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("drafter,tree", [("none", False), ("dspark", False), ("dspark", True)])
def test_greedy_penalties_equal_a_reference(folders, drafter, tree):
    hf = _hf(folders["target"])
    engine = make_engine(folders["target"], folders.get(drafter, drafter), tree=tree, tree_budget=8)
    prompts = alphabet_prompts([15, 31], seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=60, **PENALTIES)
    unpenalized = SamplingParams(temperature=0.0, max_tokens=60)
    plain = run_requests(engine, [(p, unpenalized, None) for p in prompts])
    outs = run_requests(engine, [(p, params, None) for p in prompts])
    for prompt, out, free in zip(prompts, outs, plain):
        ref: list[int] = []
        with torch.no_grad():
            while len(ref) < 60:
                logits = hf(torch.tensor([prompt + ref])).logits[0, -1].float()
                ref.append(int(penalize(logits, prompt, ref, 0.7, 0.4, 1.4).argmax()))
        assert out.token_ids == ref
        assert out.token_ids != free.token_ids  # the penalties changed the text
    if drafter == "dspark":
        assert engine.spec_stats.accepted > 0


def _exact_first_three(folder: str, prompt: list[int], t: float, k: int) -> dict:
    hf = _hf(folder)

    def dist(out):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].double()
        top = penalize(logits, prompt, out, 0.7, 0.4, 1.4).topk(k)
        return dict(zip(top.indices.tolist(), (top.values / t).softmax(-1).tolist()))

    return {(a, b, c): pa * pb * pc for a, pa in dist([]).items() for b, pb in dist([a]).items()
            for c, pc in dist([a, b]).items()}


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampled_penalties_match_the_penalized_target(folders, tree):
    engine = make_engine(folders["small_target"], folders["small_dspark"], tree=tree, tree_budget=4,
                         tree_topk=2, max_num_seqs=1000)
    sp = SamplingParams(temperature=1.5, top_k=3, max_tokens=4, ignore_eos=True, **PENALTIES)
    outs = run_requests(engine, [(SMALL_PROMPT, dataclasses.replace(sp, seed=i), None) for i in range(3000)])
    exact = _exact_first_three(folders["small_target"], SMALL_PROMPT, 1.5, 3)
    seen: dict = {}
    for o in outs:
        seen[tuple(o.token_ids[:3])] = seen.get(tuple(o.token_ids[:3]), 0) + 1
    assert set(seen) <= set(exact)
    keys = sorted(exact)
    pv = chi2_pvalue(np.array([seen.get(x, 0) for x in keys]), np.array([exact[x] for x in keys]))
    assert pv > PASS, f"p-value {pv}"
    assert 0 < engine.spec_stats.accepted < engine.spec_stats.verified


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                                {"repetition_penalty": True}])
def test_bad_penalties_refused(kw):
    with pytest.raises(ValueError, match="penalty"):
        SamplingParams(**kw)


def test_each_row_sees_the_drafts_before_it():
    """Row contexts by hand: a chain's row i follows its first i drafts; a tree row follows the
    path from the anchor to its node; the penalties count the output and that path."""
    from types import SimpleNamespace

    from dspark.engine.logits_processors import process_logits, row_prefixes
    from dspark.engine.tree import DraftTree
    from dspark.engine.verify import Work

    params = SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=2.0)
    seq = SimpleNamespace(params=params, output_ids=[4], prompt_ids=[1], eos_ids=frozenset(),
                          early_stop_ids=frozenset(), seq_id=0, grammar=None)
    chain = Work(seq, "decode", [4, 5, 6], drafts=[5, 6], samples=True)
    assert row_prefixes(chain, 3) == [[], [5], [5, 6]]
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[0, 0, 1, 3], depths=[1, 1, 2, 3], scores=[1.0] * 4)
    tw = Work(seq, "decode", [4] + tree.tokens, tree=tree, samples=True)
    assert row_prefixes(tw, 5) == [[], [5], [6], [5, 7], [5, 7, 8]]
    logits = torch.full((3, 10), 2.0)
    out = process_logits([chain], logits)
    assert torch.equal(logits, torch.full((3, 10), 2.0))  # the raw logits stay
    # token 1: prompt only (repetition); 4: output once; 5: output once from row 1 on; 6: from row 2
    assert out[0, [0, 1, 4, 5, 6]].tolist() == [2.0, 1.0, 1.0 - 1.5, 2.0, 2.0]
    assert out[1, [4, 5, 6]].tolist() == [-0.5, -0.5, 2.0]
    assert out[2, [4, 5, 6]].tolist() == [-0.5, -0.5, -0.5]
