"""Output logprobs: the target's raw log-softmax at each output token, the same with and without
speculation (chains and trees), equal to a full forward of transformers' model over the output."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from spec_helpers import alphabet_prompts, make_engine, run_requests

from dspark.config import MAX_LOGPROBS, SamplingParams
from dspark.models.loader import load_transformers_model

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
    hf = load_transformers_model(folders["target"]).eval()

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


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_equal_a_full_forward(folders, prompts, chunk):
    """Every prompt token after the first gets transformers' log-softmax at its position, also
    when the prompt is prefilled in chunks (7 tokens a forward) beside other requests."""
    hf = load_transformers_model(folders["target"]).eval()
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    engine = make_engine(folders["target"], folders["dspark"], **kw)
    sp = dataclasses.replace(GREEDY, max_tokens=4, prompt_logprobs=2)
    outs = run_requests(engine, [(p, sp, None) for p in prompts] + [(prompts[0], GREEDY, None)])
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        for i, e in enumerate(out.prompt_logprobs[1:], start=1):
            row = ref[i - 1]
            assert e.logprob == pytest.approx(float(row[p[i]]), abs=1e-4)
            x = row[p[i]]  # a prompt token may rank low, among near ties
            assert int((row > x + 1e-4).sum()) + 1 <= e.rank <= int((row > x - 1e-4).sum()) + 1
            assert [t for t, _ in e.top] == row.topk(2).indices.tolist()
    assert outs[-1].prompt_logprobs is None


def test_prompt_logprobs_end_where_the_output_logprobs_begin(folders, prompts):
    """The prompt p + [t] scores t as the request on p scored its output token t."""
    engine = make_engine(folders["target"])
    first = run_requests(engine, [(prompts[1], dataclasses.replace(GREEDY, max_tokens=1), None)])[0]
    sp = dataclasses.replace(GREEDY, max_tokens=1, logprobs=None, prompt_logprobs=3)
    again = run_requests(engine, [(prompts[1] + first.token_ids, sp, None)])[0]
    e, ref = again.prompt_logprobs[-1], first.logprobs[0]
    assert (e.rank, [t for t, _ in e.top]) == (ref.rank, [t for t, _ in ref.top])
    assert e.logprob == pytest.approx(ref.logprob, abs=1e-5)
