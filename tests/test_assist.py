"""The n-gram assist's bookkeeping: which requests look up a chain, and the running survival
rates it hands the policies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dspark.config import SpecConfig
from dspark.engine.assist import NgramAssist


def _seq(seq_id: int, ids: list[int], grammar=None) -> SimpleNamespace:
    return SimpleNamespace(seq_id=seq_id, all_ids=ids, grammar=grammar)


def test_looks_up_only_suffix_matches_of_the_minimum_length():
    assist = NgramAssist(min_match=2, max_match=4, block=8, max_len=8)
    seqs = [_seq(0, [5, 6, 7, 8, 9, 5, 6]),  # "5 6" occurred: its continuation 7 8 9 5 6
            _seq(1, [5, 6, 7, 8, 9, 1, 6]),  # only "6" occurred before: too short a match
            _seq(2, [5, 6, 7, 8, 9, 5, 6], grammar=object())]  # a grammar keeps the drafter
    got = assist.look_up(seqs, [3, 8, 8])
    assert got == {0: [7, 8, 9]} and assist.looked is got  # cut to its budget
    # "6" at 1: its continuation reaches the end and goes on copying itself (period 5)
    assert NgramAssist(1, 4, 8, 8).look_up(seqs[1:2], [8]) == {1: [7, 8, 9, 1, 6, 7, 8, 9]}


def test_prior_learns_survival_per_position():
    assist = NgramAssist(2, 4, block=4, max_len=4)
    assert assist.prior(4).tolist() == [0.5] * 4
    for accepted in (4, 4, 1):  # two chains fully accepted, one rejected at its second token
        assist.clear()
        assist.look_up([_seq(0, [1, 2, 3, 1, 2])], [4])
        assist.send(0, [1, 2, 3, 4], 4)
        assist.observe(0, accepted)
    assert assist.reached == [3, 3, 2, 2] and assist.accepted == [3, 2, 2, 2]
    assert assist.prior(4).tolist() == pytest.approx([4 / 5, 3 / 5, 3 / 4, 3 / 4])
    assist.observe(7, 3)  # a request that sent nothing this step changes nothing
    assert assist.reached == [3, 3, 2, 2]


def test_chains_grow_while_accepted_whole():
    assist = NgramAssist(2, 4, block=4, max_len=16)
    spans = []
    for accepted in (4, 8, 16, 16, 5, 3):  # whole, whole, whole, whole, cut, cut
        spans.append(assist.span(0))
        assist.clear()
        assist.send(0, list(range(spans[-1])), spans[-1])
        assist.observe(0, accepted)
    assert spans == [4, 8, 16, 16, 16, 4]  # doubles up to max_len; a rejection starts again
    assert assist.span(0) == 4 and assist.span(1) == 4
    prior = assist.prior(20)  # positions no chain reached carry the last reached one's rate
    assert len(prior) == 20 and prior[16:].tolist() == [prior[15].item()] * 4


def test_negative_setting_is_refused():
    with pytest.raises(ValueError, match="ngram_assist must be an integer >= 0"):
        SpecConfig(ngram_assist=-1).validate()
    with pytest.raises(ValueError, match=r"ngram_assist_max_len must be an integer in \[1, 32\]"):
        SpecConfig(ngram_assist_max_len=0).validate()
    with pytest.raises(ValueError, match=r"ngram_assist_max_len must be an integer in \[1, 32\]"):
        SpecConfig(ngram_assist_max_len=64).validate()  # past what bf16 CPU attention verifies exactly


def _scan(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The definition: the continuation of the latest earlier occurrence of the longest suffix,
    read on past the end as if the tokens repeated from there."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for i in range(L - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[L - n:]:
                stream = list(tokens)
                while len(stream) < i + n + k:
                    stream.append(stream[len(stream) - (L - i - n)])
                return stream[i + n:i + n + k]
    return []


@pytest.mark.parametrize("min_n,max_n", [(1, 4), (2, 4), (3, 8)])
def test_incremental_index_equals_a_scan(min_n, max_n):
    """A request's kept index, extended by 1-9 tokens a step (a verified chain's worth), proposes
    what scanning its whole token list proposes, at every length."""
    import random

    from dspark.models.drafters.ngram import NgramDrafter

    rng = random.Random(min_n * 10 + max_n)
    drafter = NgramDrafter(max_n=max_n, min_n=min_n)
    for key in range(6):
        tokens = [rng.randrange(5 + 3 * key) for _ in range(rng.randrange(1, 6))]
        while len(tokens) < 300:
            assert drafter.propose(tokens, 8, key=key) == _scan(tokens, 8, max_n, min_n), (key, len(tokens))
            tokens += [rng.randrange(5 + 3 * key) for _ in range(rng.randrange(1, 10))]
    assert drafter.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # no key: a one-off index
    assert drafter.propose([1, 2, 3, 4, 1, 2, 3], 7) == [4, 1, 2, 3, 4, 1, 2]  # a loop repeats
    drafter.forget_all_but({5})
    assert len(drafter._indexes) == 6  # few enough to keep


def test_a_released_request_keeps_no_state():
    """A request that finishes (or is preempted) mid-step drops its index and grown span, and the
    step's observe() does not grow the span again; the survival statistics still count."""
    assist = NgramAssist(2, 4, block=4, max_len=16)
    assist.look_up([_seq(0, [1, 2, 3, 1, 2])], [4])
    assist.send(0, [3, 1, 2, 3], 4)
    assist.observe(0, 4)
    assert assist.span(0) == 8 and 0 in assist.lookup._indexes
    assist.clear()
    assist.look_up([_seq(0, [1, 2, 3, 1, 2, 3, 1, 2])], [8])
    assist.send(0, [3, 1, 2, 3, 1, 2, 3, 1], 8)
    assist.forget(0)  # it finished on this step's tokens
    assist.observe(0, 8)
    assert assist.spans == {} and assist.lookup._indexes == {}
    assert assist.reached[:8] == [2] * 4 + [1] * 4
