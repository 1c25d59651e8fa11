"""Output logprobs: the target's raw log-softmax at each output token, the same with and without
speculation (chains and trees), equal to a full forward of transformers' model over the output."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from spec_helpers import alphabet_prompts, make_engine, run_requests

from dspark.config import MAX_LOGPROBS, SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=24, seed=7, logprobs=0)


@pytest.fixture(scope="module")
def prompts():
    return alphabet_prompts([15, 17, 31], seed=11)


@pytest.fixture(scope="module")
def reference(folders):
    """log_softmax of transformers' logits at every position after the prompt, per output."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["target"], dtype=torch.float32).eval()

    def get(prompt: list[int], out) -> torch.Tensor:
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1:]
        return torch.log_softmax(logits.float(), -1)

    return get


def _check(out, ref: torch.Tensor, k: int) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for i, (tok, e) in enumerate(zip(out.token_ids, out.logprobs)):
        assert e.logprob == pytest.approx(float(ref[i, tok]), abs=1e-4)
        assert e.rank == int((ref[i] > ref[i, tok] + 1e-5).sum()) + 1
        assert [t for t, _ in e.top] == ref[i].topk(k).indices.tolist()
        assert [v for _, v in e.top] == pytest.approx(ref[i].topk(k).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("drafter,tree", [("none", False), ("dspark", False), ("dspark", True), ("ngram", False)])
def test_logprobs_equal_a_full_forward(folders, prompts, reference, drafter, tree):
    engine = make_engine(folders["target"], folders.get(drafter, drafter), tree=tree, tree_budget=8)
    reqs = [(p, sp, None) for p in prompts for sp in (GREEDY, SAMPLED)]
    outs = run_requests(engine, reqs)
    if drafter == "dspark":
        assert engine.spec_stats.accepted > 0  # speculation ran and kept drafts
    for (p, sp, _), out in zip(reqs, outs):
        _check(out, reference(p, out), sp.logprobs)
        if sp.greedy:
            assert all(e.rank == 1 for e in out.logprobs)


def test_greedy_logprobs_same_with_and_without_speculation(folders, prompts):
    engine = make_engine(folders["target"], folders["dspark"])
    spec = run_requests(engine, [(p, GREEDY, None) for p in prompts])
    plain = run_requests(engine, [(p, GREEDY, None) for p in prompts], spec=False)
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids
        assert [(e.rank, [t for t, _ in e.top]) for e in a.logprobs] == [(e.rank, [t for t, _ in e.top])
                                                                           for e in b.logprobs]
        assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-5)


def test_logprobs_stop_with_the_output(folders, prompts):
    """A stop token inside an accepted block ends the logprobs where it ends the tokens."""
    engine = make_engine(folders["target"], folders["dspark"])
    full = run_requests(engine, [(prompts[0], GREEDY, None)])[0]
    end = full.token_ids.index(full.token_ids[5]) + 1  # the stop token's first appearance
    stop = dataclasses.replace(GREEDY, stop_token_ids=[full.token_ids[5]])
    out = run_requests(engine, [(prompts[0], stop, None)])[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:end]
    assert out.logprobs == full.logprobs[:end]
    none = run_requests(engine, [(prompts[0], dataclasses.replace(GREEDY, logprobs=None), None)])[0]
    assert none.logprobs is None and none.token_ids == full.token_ids


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 1.5])
def test_bad_logprobs_refused(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_top_alternatives_list_ties_by_id():
    """The top-k equals a stable full sort: ties (bf16 logits tie often) by id, the lowest first,
    including ties across the k-th place."""
    from dspark.engine.logprobs import _top

    g = torch.Generator().manual_seed(0)
    for k in range(1, 8):
        for x in (torch.randint(0, 6, (4, 50), generator=g).float(), torch.randn(4, 50, generator=g)):
            lp = torch.log_softmax(x, -1)
            v, i = _top(lp, k)
            ref = torch.sort(-lp, dim=-1, stable=True).indices[:, :k]
            assert torch.equal(i, ref) and torch.equal(v, lp.gather(1, ref))
