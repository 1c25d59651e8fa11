"""logit_bias and allowed_token_ids: added to (or masking) every verified row, so greedy output
equals transformers' argmax of the changed logits with and without speculation, sampled output
never leaves the allowed set, and bad ids or biases are refused before the request starts."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import alphabet_prompts, make_engine, run_requests
from test_spec_lossless import SMALL_PROMPT

from dspark.config import SamplingParams
from dspark.models.loader import load_transformers_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


def _reference(folder: str, prompt: list[int], n: int, bias: dict[int, float], allowed: list[int] | None):
    hf = load_transformers_model(folder).eval()
    out: list[int] = []
    with torch.no_grad():
        while len(out) < n:
            x = hf(torch.tensor([prompt + out])).logits[0, -1].float()
            for t, b in bias.items():
                x[t] += b
            if allowed is not None:
                keep = torch.full_like(x, float("-inf"))
                keep[allowed] = x[allowed]
                x = keep
            out.append(int(x.argmax()))
    return out


@pytest.mark.parametrize("drafter,tree", [("none", False), ("dspark", False), ("dspark", True)])
def test_greedy_logit_bias_equals_a_reference(folders, drafter, tree):
    engine = make_engine(folders["target"], folders.get(drafter, drafter), tree=tree, tree_budget=8)
    prompt = alphabet_prompts([23], seed=5)[0]
    free = run_requests(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=40), None)])[0]
    # ban the first token the model would write, favour two others a little
    banned = free.token_ids[0]
    liked = [t for t in dict.fromkeys(free.token_ids + prompt) if t != banned][:2]
    bias = {banned: -100.0, liked[0]: 2.5, liked[1]: 1.5}
    out = run_requests(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=40, logit_bias=bias), None)])[0]
    assert out.token_ids == _reference(folders["target"], prompt, 40, bias, None)
    assert banned not in out.token_ids and out.token_ids != free.token_ids
    if drafter == "dspark":
        assert engine.spec_stats.accepted > 0


@pytest.mark.parametrize("drafter", ["none", "dspark"])
def test_greedy_allowed_token_ids_equal_a_reference(folders, drafter):
    engine = make_engine(folders["target"], folders.get(drafter, drafter))
    prompt = alphabet_prompts([19], seed=6)[0]
    allowed = sorted(set(prompt))[:4]
    sp = SamplingParams(temperature=0.0, max_tokens=30, allowed_token_ids=allowed, logit_bias={allowed[0]: -3.0})
    out = run_requests(engine, [(prompt, sp, None)])[0]
    assert set(out.token_ids) <= set(allowed)
    assert out.token_ids == _reference(folders["target"], prompt, 30, {allowed[0]: -3.0}, allowed)


def test_sampled_output_stays_in_the_allowed_set(folders):
    engine = make_engine(folders["small_target"], folders["small_dspark"], max_num_seqs=64)
    allowed = [3, 5, 8]
    sp = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=i, allowed_token_ids=allowed,
                         logit_bias={5: -100.0}) for i in range(64)]
    outs = run_requests(engine, [(SMALL_PROMPT, p, None) for p in sp])
    seen = {t for o in outs for t in o.token_ids}
    assert seen == {3, 8}


@pytest.mark.parametrize("kwargs,match", [
    ({"logit_bias": {1: 101.0}}, "logit_bias values"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias values"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys"),
    ({"logit_bias": {"1": 1.0}}, "logit_bias keys"),
    ({"logit_bias": [1]}, "logit_bias must map"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_bad_values_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_ids_outside_the_vocabulary_are_refused(folders):
    engine = make_engine(folders["target"])
    vocab = engine.model_config.vocab_size
    for sp in (SamplingParams(logit_bias={vocab: 1.0}), SamplingParams(allowed_token_ids=[0, vocab + 5])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request("bad", [1, 2, 3], sp)
    eos = sorted(engine.eos_ids)
    with pytest.raises(ValueError, match="only stop tokens"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(min_tokens=2, allowed_token_ids=eos))
    assert not engine.has_unfinished()


def test_bad_words_ban_the_token_that_would_complete_them():
    """A bad word's last token is banned in the rows whose context (output, then the drafts before
    the row) ends with its other tokens; a one-token bad word is banned everywhere."""
    from types import SimpleNamespace

    from dspark.engine.logits_processors import process_logits
    from dspark.engine.verify import Work

    params = SamplingParams(temperature=0.0, bad_words=["x"])  # the words themselves are tokenized by the engine
    seq = SimpleNamespace(params=params, output_ids=[1, 2], prompt_ids=[0], eos_ids=frozenset(), grammar=None,
                          early_stop_ids=frozenset(), seq_id=0, bad_word_ids=[[2, 3, 4], [7]])
    w = Work(seq, "decode", [2, 3, 5], drafts=[3, 5], samples=True)
    out = process_logits([w], torch.zeros(3, 10))
    banned = [set(torch.isinf(row).nonzero()[:, 0].tolist()) for row in out]
    assert banned == [{7}, {4, 7}, {7}]  # row 1 follows 2, 3: the word 2 3 4 would be complete
