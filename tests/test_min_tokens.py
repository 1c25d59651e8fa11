"""min_tokens: no EOS, stop token id or stop string before that many output tokens; greedy
output then follows the target's argmax with those tokens banned, with and without speculation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from spec_helpers import alphabet_prompts, make_engine, run_requests

from dspark.config import SamplingParams
from dspark.models.loader import load_transformers_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

MIN = 10


@pytest.fixture(scope="module")
def prompts():
    return alphabet_prompts([15, 17, 31], seed=5)


def _reference(hf, prompt: list[int], stop: int, n: int, min_tokens: int) -> list[int]:
    """Greedy decoding with transformers, `stop` banned for the first min_tokens, until it appears."""
    out: list[int] = []
    step, past = torch.tensor([prompt]), None
    with torch.no_grad():
        while len(out) < n:
            res = hf(step, past_key_values=past, use_cache=True)
            logits, past = res.logits[0, -1].float(), res.past_key_values
            if len(out) < min_tokens:
                logits[stop] = float("-inf")
            out.append(int(logits.argmax()))
            step = torch.tensor([[out[-1]]])
            if out[-1] == stop:
                break
    return out


@pytest.mark.parametrize("drafter,tree", [("none", False), ("dspark", False), ("dspark", True)])
def test_greedy_min_tokens_equal_a_reference(folders, prompts, drafter, tree):
    hf = load_transformers_model(folders["target"]).eval()
    engine = make_engine(folders["target"], folders.get(drafter, drafter), tree=tree, tree_budget=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=60)
    cases = []  # (prompt, stop, min_tokens): the ban lifts at different places in a drafted block
    for prompt, full in zip(prompts, run_requests(engine, [(p, greedy, None) for p in prompts])):
        stop = full.token_ids[2]  # would end the output at its third token
        cases += [(prompt, stop, low) for low in (MIN, 20, 25, 27, 30)]
    outs = run_requests(engine, [(prompt, dataclasses.replace(greedy, stop_token_ids=[stop], min_tokens=low), None)
                                 for prompt, stop, low in cases])
    for (prompt, stop, low), out in zip(cases, outs):
        assert out.token_ids == _reference(hf, prompt, stop, 60, low)
        assert len(out.token_ids) > low and stop not in out.token_ids[:low]
    if drafter == "dspark":
        assert engine.spec_stats.accepted > 0


def test_sampled_min_tokens_hold_against_eos(folders):
    """A random 12-token target emits EOS (id 2) now and then: without min_tokens about a third of
    48 sampled outputs end before 12 tokens, with it none does, and speculation keeps drafting."""
    engine = make_engine(folders["small_target"], folders["small_dspark"])
    prompt = [3, 5, 7, 9, 4]
    base = SamplingParams(temperature=1.0, max_tokens=30)
    free = run_requests(engine, [(prompt, dataclasses.replace(base, seed=s), None) for s in range(48)])
    assert sum(o.finish_reason == "stop" and len(o.token_ids) < 12 for o in free) >= 10
    held = run_requests(engine, [(prompt, dataclasses.replace(base, seed=s, min_tokens=12), None)
                                 for s in range(24)])
    for o in held:
        assert len(o.token_ids) >= 12 and 2 not in o.token_ids[:12]
        assert o.finish_reason == "length" or o.token_ids[-1] == 2
    # ignore_eos still bans EOS before min_tokens (as vLLM), and lets it through, not stopping, after
    ignoring = run_requests(engine, [(prompt, dataclasses.replace(base, seed=s, min_tokens=12, ignore_eos=True),
                                      None) for s in range(24)])
    assert all(len(o.token_ids) == 30 and 2 not in o.token_ids[:12] for o in ignoring)
    assert any(2 in o.token_ids[12:] for o in ignoring)
    assert engine.spec_stats.proposed > 0


def test_stop_string_waits_for_min_tokens(folders, prompts):
    engine = make_engine(folders["target"], folders["dspark"])
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    full = run_requests(engine, [(prompts[0], greedy, None)])[0]
    early = engine.tokenizer.decode(full.token_ids[1:2]).strip()
    assert early and early in full.text[:len(full.text) // 2]
    stopped = run_requests(engine, [(prompts[0], dataclasses.replace(greedy, stop=[early]), None)])[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < MIN
    held = run_requests(engine, [(prompts[0], dataclasses.replace(greedy, stop=[early], min_tokens=MIN), None)])[0]
    assert len(held.token_ids) >= MIN and held.token_ids == full.token_ids[:len(held.token_ids)]


@pytest.mark.parametrize("kw", [{"min_tokens": -1}, {"min_tokens": 5, "max_tokens": 4}, {"min_tokens": 1.5}])
def test_bad_min_tokens_refused(kw):
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(**kw)
