"""Verification-length policies: the load-aware rule by hand, and in the engine under a cost
model where verification is costly (fewer tokens verified than `fixed`, same greedy output) or
so costly that drafting cannot pay (the drafter pauses, output still the same)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from spec_helpers import alphabet_prompts, make_engine, run_requests

from dspark.config import SamplingParams
from dspark.engine.controller import VerifyLengthController
from dspark.engine.policy import CostModel, LoadAwarePolicy, ThresholdPolicy, make_policy
from dspark.engine.sequence import SpecStats
from dspark.engine.tree import DraftTree, build_trees
from dspark.models import cpu_ops

FLAT = CostModel([1, 256], [1.0, 1.0])  # a pass costs the same whatever it holds: verify everything
STEEP = CostModel([1, 2, 256], [1.0, 2.0, 256.0], frozen=True)  # each extra token costs a whole pass


def test_load_aware_by_hand():
    conf = torch.tensor([[0.9, 0.9, 0.1, 0.9], [0.5, 0.5, 0.5, 0.5]])
    # free verification: every budgeted token
    assert LoadAwarePolicy(FLAT).choose([4, 3], conf) == [4, 3]
    # expensive verification: nothing beats the anchors alone (tau 2 over cost 1)
    assert LoadAwarePolicy(STEEP).choose([4, 4], conf) == [0, 0]
    # moderate cost: admit in descending survival while tau(B) / cost(B) improves
    mid = CostModel([2, 3, 4, 5, 6], [1.0, 1.2, 1.4, 1.9, 2.4])
    # survivals: r0 .9, .81, .081, ...; r1 .5, .25, ... -> .9 (tau 2.9/1.2), .81 (3.71/1.4), .5 (4.21/1.9 < 2.65): stop
    assert LoadAwarePolicy(mid).choose([4, 4], conf) == [2, 0]
    policy = LoadAwarePolicy(mid)
    policy.choose([4, 4], conf)
    assert policy.last_gain == pytest.approx((3.71 / 1.4) / (2 / 1.0))
    # the drafter's own pass time is part of every step: paying 5 s for it makes longer
    # verification worth more (.5 now gets in: 4.21/6.9 > 3.71/6.4, then .25 does not:
    # 4.46/7.4), yet all of it loses to plain decoding (2/1.0)
    assert policy.choose([4, 4], conf, draft_seconds=5.0) == [2, 1]
    assert policy.last_gain == pytest.approx((4.21 / 6.9) / 2.0)
    assert policy.last_gain < 1


def test_prompt_tokens_in_the_pass_make_drafts_no_cheaper():
    """Prompt tokens riding in the pass cost the same whether drafts are verified or not: under an
    affine cost the policy admits, and expects, what it would in a decode-only step."""
    affine = CostModel([1, 512], [1.1, 1.0 + 0.1 * 512])
    conf = torch.tensor([[0.9, 0.6, 0.3], [0.7, 0.2, 0.1], [0.4, 0.4, 0.4]])
    alone, ridden = LoadAwarePolicy(affine), LoadAwarePolicy(affine)
    for seconds in (0.0, 0.25, 1.0):
        lengths = alone.choose([3, 3, 3], conf, 0, seconds)
        assert ridden.choose([3, 3, 3], conf, 300, seconds) == lengths
        assert ridden.last_gain == pytest.approx(alone.last_gain)
    assert alone.last_gain < 1  # a drafter pass of 1 s loses beside 300 prompt tokens as well


def test_every_policy_keeps_within_a_step_s_draft_allowance():
    """A step's draft allowance (what the decode-stall bound leaves beside its prompt chunk) caps
    the draft tokens or tree nodes verified in all: load-aware admits its best candidates up to
    it, fixed and threshold cut the longest chains first; None is no limit."""
    conf = torch.tensor([[0.9, 0.9, 0.1, 0.9], [0.5, 0.5, 0.5, 0.5]])
    assert LoadAwarePolicy(FLAT).choose([4, 3], conf, max_total=None) == [4, 3]
    # survivals .9, .81, .5, .25, ...: the best three
    assert LoadAwarePolicy(FLAT).choose([4, 3], conf, max_total=3) == [2, 1]
    assert LoadAwarePolicy(FLAT).choose([4, 3], conf, max_total=0) == [0, 0]
    assert make_policy("fixed", 0.5, None).choose([4, 3], conf, max_total=4) == [2, 2]
    assert ThresholdPolicy(0.4).choose([4, 4], conf, max_total=3) == [2, 1]  # from [2, 4]
    assert ThresholdPolicy(0.4).choose([4, 4], conf, max_total=0) == [0, 0]
    survival = [[0.9, 0.8, 0.3], [0.7, 0.1]]
    assert LoadAwarePolicy(FLAT).choose_nodes(survival, max_total=3) == [2, 1]
    assert make_policy("fixed", 0.5, None).choose_nodes(survival, max_total=3) == [2, 1]


def test_cost_model_prices_non_decreasing_and_learns_real_steps():
    # a profile taken on a busy machine: the 1- and 2-token passes were slowed down by a neighbour
    noisy = CostModel([1, 2, 4, 8, 16], [1.7, 1.7, 0.05, 0.09, 0.2])
    assert noisy.priced == [0.05, 0.05, 0.05, 0.09, 0.2] and noisy.seconds[0] == 1.7
    assert noisy(3) == pytest.approx(0.05) and noisy(12) == pytest.approx(0.145) and noisy(32) == pytest.approx(0.4)
    for bad in (([], []), ([1, 2], [1.0]), ([2, 1], [1.0, 2.0]), ([1, 2], [0.0, 1.0]), ([1, 2], [1.0, 2.0], [1.0])):
        with pytest.raises(ValueError, match="cost profile"):
            CostModel(*bad)
    # real steps: plain ones (16 tokens) cost 0.04, verification ones 0.04 + 0.001 per extra token,
    # steeper than the profile's slope; both the level and the slope are learned
    def real(n, level=0.04):
        return level + 0.001 * (n - 16)

    cost = CostModel([1, 16, 32, 64], [0.018, 0.03, 0.04, 0.055])
    for _ in range(300):
        for n in (16, 16, 40, 56, 24):
            cost.observe(n, real(n))
    for n in (16, 24, 40, 56):
        assert cost(n) == pytest.approx(real(n), rel=0.02), n
    # the regime changes (the machine gets twice as busy): the fixed rate floor follows it
    for _ in range(60):
        for n in (16, 32, 64):
            cost.observe(n, 2 * real(n))
    assert cost(16) == pytest.approx(2 * real(16), rel=0.02) and cost(40) == pytest.approx(2 * real(40), rel=0.02)
    cost.observe(0, 1.0), cost.observe(4, 0.0)  # nothing to learn from
    frozen = CostModel([1, 16], [0.1, 0.4], frozen=True)
    frozen.observe(8, 5.0)
    assert frozen.seconds == [0.1, 0.4]


def test_cost_model_outliers_are_bounded_and_forgotten():
    # the very first real step is a 10x hiccup (a lazy warm-up): the profile's prior weight and the
    # clamp bound the damage, and ordinary steps wash it out
    cost = CostModel([1, 16, 32], [0.02, 0.03, 0.04])
    cost.observe(24, 0.35)
    assert cost(24) <= 0.035 * (1 + (CostModel.CLAMP - 1) / (1 + CostModel.PRIOR)) + 1e-12
    for _ in range(80):
        cost.observe(24, 0.035)
    assert cost(24) == pytest.approx(0.035, rel=0.02)
    # a hiccup that pushes one entry above the next: prices stay non-decreasing, and the entry
    # comes back down once ordinary steps are seen again (nothing raised stays raised)
    cost = CostModel([1, 16, 32], [0.02, 0.03, 0.04])
    for _ in range(4):
        cost.observe(16, 0.09)
    assert cost.seconds[1] > cost.seconds[2] and cost.priced[1] <= cost.priced[2]
    assert cost(16) == pytest.approx(cost(32))
    for _ in range(60):
        cost.observe(16, 0.03)
    assert cost(16) == pytest.approx(0.03, rel=0.02) and cost(32) == pytest.approx(0.04)
    # a profile ten times too slow everywhere is corrected where steps are seen, even though the
    # entries to its left are never observed (a step between two entries teaches each half as much)
    slow = CostModel([1, 4, 8, 16], [0.2, 0.25, 0.3, 0.4])
    for _ in range(150):
        slow.observe(4, 0.025), slow.observe(12, 0.035)
    assert slow(4) == pytest.approx(0.025, rel=0.05) and slow(12) == pytest.approx(0.035, rel=0.05)
    # the policy prices with today's seconds: a drafter pass that cost half a profiled target
    # pass stops paying for itself once real steps turn out ten times cheaper than profiled
    conf = torch.tensor([[0.9, 0.9]])
    policy = LoadAwarePolicy(CostModel([1, 2, 3], [1.0, 1.1, 1.2]))
    assert policy.choose([2], conf, draft_seconds=0.5) == [2] and policy.last_gain > 1
    for _ in range(100):
        for n in (1, 2, 3):
            policy.cost.observe(n, 0.1 + 0.01 * (n - 1))
    assert policy.choose([2], conf, draft_seconds=0.5) == [2] and policy.last_gain < 1


def test_engine_reports_decode_steps_to_the_spec_runner(folders, single_thread):
    """Every decode-only step reports its target tokens and a positive time; prefill steps do not."""
    engine = make_engine(folders["target"], "none", max_num_batched_tokens=24)
    calls = []
    engine.spec.observe_step = lambda tokens, seconds: calls.append((tokens, seconds))
    for i, p in enumerate(alphabet_prompts([15, 20, 31], seed=4)):
        engine.add_request(f"o{i}", p, SamplingParams(temperature=0.0, max_tokens=6))
    expected = []
    while engine.has_unfinished():
        decode_only = all(not s.in_prefill for s in engine.running) and not engine.waiting
        n = len(engine.running)
        engine.step()
        if decode_only and n:
            expected.append(n)
    assert [t for t, _ in calls] == expected and len(expected) >= 4
    assert all(s > 0 for _, s in calls)


def test_load_aware_tree_nodes_by_hand():
    # nodes in descending survival per tree, as DraftTree.ranked() gives them
    survival = [[0.9, 0.81, 0.3], [0.5, 0.2]]
    assert LoadAwarePolicy(FLAT).choose_nodes(survival) == [3, 2]
    assert LoadAwarePolicy(STEEP).choose_nodes(survival) == [0, 0]
    mid = CostModel([2, 3, 4, 5, 6], [1.0, 1.2, 1.4, 1.9, 2.4])
    assert LoadAwarePolicy(mid).choose_nodes(survival) == [2, 0]  # same numbers as the chain case
    assert ThresholdPolicy(0.5).choose_nodes(survival) == [3, 2]  # thresholds shape chains only


def test_tree_top_is_a_subtree():
    """Every prefix of a tree's ranking is ancestor-closed, and top(n) renumbers it breadth-first."""
    # anchor -> 1 (.6) -> 3 (.5) -> 5 (.1); anchor -> 2 (.3) -> 4 (.2)
    t = DraftTree(tokens=[10, 20, 30, 40, 50], parents=[0, 0, 1, 2, 3], depths=[1, 1, 2, 2, 3],
                  scores=[0.6, 0.3, 0.5, 0.2, 0.1])
    assert t.ranked() == [0, 2, 1, 3, 4]
    sub = t.top(3)
    assert (sub.tokens, sub.parents, sub.depths) == ([10, 20, 30], [0, 0, 1], [1, 1, 2])
    sub = t.top(2)
    assert (sub.tokens, sub.parents, sub.depths) == ([10, 30], [0, 1], [1, 2])
    bad = DraftTree(tokens=[10, 30], parents=[0, 1], depths=[1, 2], scores=[0.2, 0.5])  # child likelier
    with pytest.raises(KeyError):
        bad.top(1)
    with pytest.raises(ValueError, match="no node scores"):
        DraftTree(tokens=[10], parents=[0], depths=[1]).top(1)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):  # random drafted trees: every prefix keeps each node's parent
        base = torch.randn(1, 4, 30, generator=g) * 3
        tree = build_trees(base, torch.tensor([5]), None, [12], [4], topk=3)[0]
        for n in range(len(tree) + 1):
            sub = tree.top(n)
            assert len(sub) == n and all(p < i for i, p in enumerate(sub.parents, start=1))
            assert all(sub.depths[i - 1] == (sub.depths[p - 1] + 1 if p else 1) for i, p in enumerate(sub.parents, 1))
            assert sorted(sub.scores) == sorted(tree.scores[i] for i in tree.ranked()[:n])


def test_build_trees_in_draft_vocab_equals_target_vocab():
    """Trees built over a reduced draft vocabulary (mapped back to target ids) are the trees built
    over the target vocabulary with -inf logits and a zero Markov bias outside it."""
    g = torch.Generator().manual_seed(1)
    V, Vd = 50, 20
    vocab = torch.randperm(V, generator=g)[:Vd].sort().values
    w = torch.randn(V, Vd, generator=g)

    def markov_draft(prev: torch.Tensor) -> torch.Tensor:
        return w[prev]

    def markov_target(prev: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*prev.shape, V).index_copy(-1, vocab, w[prev])

    for _ in range(20):
        base = torch.randn(2, 4, Vd, generator=g) * 3
        full = torch.full((2, 4, V), float("-inf")).index_copy(-1, vocab, base)
        anchors = torch.randint(0, V, (2,), generator=g)
        small = build_trees(base, anchors, markov_draft, [7, 5], [4, 3], topk=2, vocab=vocab)
        big = build_trees(full, anchors, markov_target, [7, 5], [4, 3], topk=2)
        for a, b in zip(small, big):
            assert (a.tokens, a.parents, a.depths) == (b.tokens, b.parents, b.depths)
            assert a.scores == pytest.approx(b.scores, rel=1e-5)
            assert all(t in vocab.tolist() for t in a.tokens)


def test_threshold_and_make_policy():
    conf = torch.tensor([[0.9, 0.4, 0.9], [0.2, 0.9, 0.9]])
    assert ThresholdPolicy(0.5).choose([3, 3], conf) == [1, 1]  # at least one token
    assert make_policy("fixed", 0.5, None).choose([3, 2], conf) == [3, 2]
    with pytest.raises(ValueError, match="cost profile"):
        make_policy("load-aware", 0.5, None)
    with pytest.raises(ValueError, match="unknown spec policy"):
        make_policy("sometimes", 0.5, None)


@pytest.mark.parametrize("drafter,tree", [("dspark", False), ("dspark_rv", False), ("dspark", True)])
def test_engine_load_aware_verifies_less_same_output(folders, single_thread, drafter, tree, monkeypatch):
    """With a cost model where each verified token costs something, load-aware verifies fewer
    draft tokens (chain) or nodes (tree) than fixed, and greedy output stays token-for-token the same."""
    sloped = CostModel([1, 64], [1.0, 4.15], frozen=True)  # +5% of a pass per token; real steps teach nothing
    monkeypatch.setattr("dspark.engine.profile.load_or_measure", lambda engine: sloped)
    prompts = alphabet_prompts([15, 20, 24, 31, 33, 40], seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    outs, stats = {}, {}
    for policy in ("fixed", "load-aware"):
        engine = make_engine(folders["target"], folders[drafter], policy=policy, tree=tree, tree_budget=12)
        outs[policy] = run_requests(engine, [(p, dataclasses.replace(sp), None) for p in prompts])
        stats[policy] = engine.spec_stats
    plain = run_requests(make_engine(folders["target"], "none"), [(p, sp, None) for p in prompts])
    for a, b, c in zip(outs["fixed"], outs["load-aware"], plain):
        assert a.token_ids == b.token_ids == c.token_ids
    assert stats["load-aware"].verified < stats["fixed"].verified, (stats["fixed"].as_dict(),
                                                                   stats["load-aware"].as_dict())
    assert stats["load-aware"].accepted > 0


def test_draft_width_is_one_past_the_longest_recently_verified_chain():
    """A drafter pass drafts one token more than the longest chain of the last WIDTH_WINDOW passes
    (the whole budget before any), so a chain that reaches the width lifts it for the next pass."""
    c = VerifyLengthController(None, SpecStats())
    assert c.draft_width(8) == 8
    c.record_width(2)
    assert (c.draft_width(8), c.draft_width(2)) == (3, 2)
    c.record_width(3)  # the policy took all three: the next pass drafts four
    assert c.draft_width(8) == 4
    for _ in range(c.WIDTH_WINDOW - 1):
        c.record_width(0)
    assert c.draft_width(8) == 4  # the 3 is still in the window
    c.record_width(0)
    assert c.draft_width(8) == 1


def test_block_pass_runs_only_the_positions_the_drafts_need(folders, single_thread, monkeypatch):
    """Where the policy verifies short chains, the eager block pass runs fewer positions than the
    drafter's block (one past the longest chain lately verified), the drafts are that long, and
    greedy output equals plain decoding's. Under a CUDA-graph pool the whole block runs; a tree's
    pass is no deeper than its node budget."""
    sloped = CostModel([1, 64], [1.0, 4.15], frozen=True)
    monkeypatch.setattr("dspark.engine.profile.load_or_measure", lambda engine: sloped)
    prompts = alphabet_prompts([15, 20, 24, 31], seed=7)
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    engine = make_engine(folders["target"], folders["dspark"], policy="load-aware", ngram_assist=0)
    proposer, lengths, drafted = engine.spec.proposer, [], []
    block = proposer.drafter.config.block_size
    real_pass, real_draft = proposer._block_pass, proposer.draft

    def counted(seqs, length):
        lengths.append(length)
        return real_pass(seqs, length)

    def recorded(seqs, budgets):
        out = real_draft(seqs, budgets)
        drafted.append((lengths[-1], [len(d.tokens) for d in out]))
        return out

    monkeypatch.setattr(proposer, "_block_pass", counted)
    monkeypatch.setattr(proposer, "draft", recorded)
    outs = run_requests(engine, [(p, dataclasses.replace(sp), None) for p in prompts])
    plain = run_requests(make_engine(folders["target"], "none"), [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert lengths[0] == block and min(lengths) < block, lengths
    assert all(set(n) == {length} for length, n in drafted)  # a dspark block drafts at every position
    assert proposer._block_length([2, 3]) == 3
    monkeypatch.setattr(proposer, "graphs", object())
    assert proposer._block_length([2, 3]) == block
    monkeypatch.setattr(proposer, "graphs", None)
    monkeypatch.setattr(proposer.cfg, "tree", True)
    monkeypatch.setattr(proposer.cfg, "tree_budget", 2)
    assert proposer._block_length([6, 5]) == 2


@pytest.mark.parametrize("cost,verifies", [(FLAT, "all"), (STEEP, "none")], ids=["flat", "steep"])
def test_prompt_lookup_is_priced_under_load_aware(folders, single_thread, monkeypatch, cost, verifies):
    """The n-gram drafter alone (deterministic, verified whole under the fixed policy) is cut by
    the load-aware policy at its running acceptance: (nearly) all of every chain where extra
    tokens cost nothing, hardly any where each costs a whole pass (a one-token probe after a
    back-off); greedy output equals plain decoding's."""
    monkeypatch.setattr("dspark.engine.profile.load_or_measure", lambda engine: cost)
    prompts = [[5 + (i % k) for i in range(30)] for k in (3, 4, 6)] + alphabet_prompts([20, 31], seed=4)
    sp = SamplingParams(temperature=0.0, max_tokens=32)
    engine = make_engine(folders["target"], "ngram", policy="load-aware")
    outs = run_requests(engine, [(p, dataclasses.replace(sp), None) for p in prompts])
    plain = run_requests(make_engine(folders["target"], "none"), [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    st = engine.spec_stats
    assert st.proposed > 0
    if verifies == "all":
        assert st.verified >= 0.9 * st.proposed and st.accepted > 0  # (a chain may end at max_tokens)
    else:  # only the probes that keep its acceptance current: a token per chain, backing off
        assert 0 < st.verified < 0.1 * st.proposed, st.as_dict()


def test_engine_pauses_drafter_when_it_cannot_pay(folders, single_thread, monkeypatch):
    """When every verified token costs a whole pass, no choice beats plain decoding once the
    drafter's pass is paid: the runner stops drafting for most steps and output is unchanged."""
    monkeypatch.setattr("dspark.engine.profile.load_or_measure", lambda engine: STEEP)
    prompts = alphabet_prompts([15, 20, 31], seed=6)
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    engine = make_engine(folders["target"], folders["dspark"], policy="load-aware")
    outs = run_requests(engine, [(p, dataclasses.replace(sp), None) for p in prompts])
    plain = run_requests(make_engine(folders["target"], "none"), [(p, sp, None) for p in prompts])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    steps = engine.spec_stats.steps
    assert engine.spec.controller.num_draft_passes < steps / 3, (engine.spec.controller.num_draft_passes, steps)
    assert engine.spec.controller.gain < 1


def test_requests_that_cannot_draft_count_as_plain_rows(folders, single_thread, monkeypatch):
    """A request without speculation still commits a token per pass: load-aware weighs it as a
    plain row (an empty candidate list), so drafts must pay against the whole pass's output."""
    monkeypatch.setattr("dspark.engine.profile.load_or_measure",
                        lambda engine: CostModel([1, 64], [1.0, 4.15], frozen=True))
    engine = make_engine(folders["target"], folders["dspark"], policy="load-aware")
    calls = []
    real = engine.spec.policy._admit

    def admit(survival, other_tokens, draft_seconds, max_total=None):
        calls.append([len(row) for row in survival])
        return real(survival, other_tokens, draft_seconds, max_total)

    monkeypatch.setattr(engine.spec.policy, "_admit", admit)
    prompts = alphabet_prompts([15, 20], seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    engine.add_request("plain", prompts[0], dataclasses.replace(sp), spec=False)
    engine.add_request("spec", prompts[1], dataclasses.replace(sp))
    while engine.has_unfinished():
        engine.step()
    both = [c for c in calls if len(c) == 2]
    assert both and all(c[0] > 0 and c[1] == 0 for c in both), calls  # the plain request: no candidates


def _run_paused(folders, monkeypatch, cost: CostModel, prompts, sp):
    """Greedy outputs of a DSpark engine whose drafting pauses for good after its first drafter
    pass, and the looked-up proposals its paused steps verified."""
    monkeypatch.setattr("dspark.engine.profile.load_or_measure", lambda engine: cost)
    engine = make_engine(folders["target"], folders["dspark"], policy="load-aware")
    spec, looked = engine.spec, []

    def lost(R, seconds, decodes=None):  # every drafter pass loses: paused from then on
        spec.controller.num_draft_passes += 1
        spec.controller.skip_steps = 10**6

    real_propose = spec.propose

    def propose(seqs, other_tokens=0, max_drafts=None):
        paused = spec.controller.skip_steps > 0
        proposals = real_propose(seqs, other_tokens, max_drafts)
        if paused:
            assert all(p.looked_up and p.tokens for p in proposals.values())  # never a drafted block
            looked.extend(proposals.values())
        return proposals

    monkeypatch.setattr(spec.controller, "record_pass", lost)
    monkeypatch.setattr(spec, "propose", propose)
    outs = run_requests(engine, [(p, dataclasses.replace(sp), None) for p in prompts])
    assert spec.controller.num_draft_passes == 1
    return outs, looked


def test_paused_drafter_still_verifies_looked_up_chains(folders, single_thread, monkeypatch):
    """While drafting pauses (a drafter pass would not pay), a request whose last tokens occurred
    earlier still verifies their continuation, which costs no drafter pass; where a verified token
    costs more than it can bring, nothing is verified while paused. Output is plain decoding's."""
    prompts = alphabet_prompts([15, 20, 31], seed=6)
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    plain = run_requests(make_engine(folders["target"], "none"), [(p, sp, None) for p in prompts])
    plain = [o.token_ids for o in plain]
    outs, looked = _run_paused(folders, monkeypatch, CostModel([1, 64], [1.0, 1.6], frozen=True), prompts, sp)
    assert [o.token_ids for o in outs] == plain and len(looked) > 5
    steeper = CostModel([1, 2, 256], [1.0, 3.0, 511.0], frozen=True)  # each extra token costs two passes
    outs, looked = _run_paused(folders, monkeypatch, steeper, prompts, sp)
    assert [o.token_ids for o in outs] == plain and not looked


@pytest.mark.parametrize("stored", ['{"tokens": [1, 2', '{"tokens": [1]}', ""])
def test_unreadable_cost_profile_is_measured_again(stored, tmp_path, monkeypatch):
    import json

    from dspark.engine import profile

    monkeypatch.setattr(profile, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(profile, "_key", lambda engine: "k")
    monkeypatch.setattr(profile, "measure", lambda engine: CostModel([1, 2], [0.01, 0.02]))
    (tmp_path / "cost-k.json").write_text(stored)
    cost = profile.load_or_measure(None)
    assert (cost.tokens, cost.seconds) == ([1, 2], [0.01, 0.02])
    assert json.loads((tmp_path / "cost-k.json").read_text()) == {"tokens": [1, 2], "seconds": [0.01, 0.02]}
    assert [p.name for p in tmp_path.iterdir()] == ["cost-k.json"]  # no temporary file left


def test_a_burst_of_other_work_during_the_profile_slows_no_token_count_alone(monkeypatch):
    """The start-up profile sweeps the ladder repeatedly: a burst of other work lasting a few
    passes (another server starting beside this one) costs one sample of several token counts,
    and every count keeps its fastest, where timing each count's repeats back to back put the
    whole burst on one count (a price the policy would then never try, so never correct)."""
    from dspark.engine import profile

    clock, calls = [0.0], [0]

    def forward(items, rows, capture):
        calls[0] += 1
        burst = 20.0 if 30 <= calls[0] < 34 else 1.0  # four passes in a row, 20 times slower
        clock[0] += burst * (0.005 + 0.001 * len(rows))

    pool = SimpleNamespace(num_free=10_000, page_size=16, reserve=lambda *a: None, free=lambda *a: None)
    engine = SimpleNamespace(pool=pool, device=torch.device("cpu"), runner=SimpleNamespace(forward=forward),
                             spec=SimpleNamespace(capture_layers=()))
    monkeypatch.setattr(profile.time, "perf_counter", lambda: clock[0])
    cost = profile.measure(engine)
    assert cost.tokens == profile.LADDER
    assert cost.seconds == pytest.approx([0.005 + 0.001 * n for n in profile.LADDER])


def test_cost_profile_fits_a_small_kv_cache(folders, tmp_path, monkeypatch):
    """A load-aware engine whose KV cache is too small for the full start-up profile (16 sequences
    of 64 cached tokens) measures what fits instead of failing to start."""
    from dspark.engine import profile

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    engine = make_engine(folders["target"], folders["dspark"], policy="load-aware", kv_cache_tokens=512,
                         max_model_len=256)
    nseq, ctx, ladder = profile._fit(engine.pool, profile.LADDER)
    assert (nseq, ladder[-1]) == (16, 256) and 1 <= ctx < 64
    assert engine.pool.num_free == engine.pool.num_pages  # the profile's pages are back
    small, pool = profile._key(engine), engine.pool  # a partial profile is stored apart
    engine.pool = SimpleNamespace(num_free=10_000, page_size=16)
    assert profile._key(engine) != small
    engine.pool = pool
    if cpu_ops.load() is not None:  # other kernel sources: another profile
        monkeypatch.setattr(cpu_ops, "sources_digest", lambda: "changed")
        assert profile._key(engine) != small
    out = run_requests(engine, [(alphabet_prompts([20])[0], SamplingParams(temperature=0, max_tokens=12), None)])[0]
    assert out.finish_reason == "length"


@pytest.mark.parametrize("probe_ms, remeasured", [((6.5, 10.0), False), ((6.0, 10.6), False),
                                                   ((6.0, 4.0), True), ((72.0, 10.0), True)])
def test_a_cached_cost_profile_a_fresh_probe_disagrees_with_is_measured_again(probe_ms, remeasured, tmp_path,
                                                                               monkeypatch):
    """A profile taken while the machine was busy (a compiler in the background) would price
    every later start's passes wrongly: a quick probe of 1 and 8 tokens checks it on each load."""
    import json

    from dspark.engine import profile

    monkeypatch.setattr(profile, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(profile, "_key", lambda engine: "k")
    calls = []

    def measure(engine, ladder=profile.LADDER, repeats=3):
        calls.append(list(ladder))
        if ladder == [1, 8]:
            return CostModel([1, 8], [ms / 1e3 for ms in probe_ms])
        return CostModel([1, 2, 8], [0.005, 0.006, 0.009])

    monkeypatch.setattr(profile, "measure", measure)
    (tmp_path / "cost-k.json").write_text(json.dumps({"tokens": [1, 2, 8], "seconds": [0.0062, 0.0063, 0.0104]}))
    cost = profile.load_or_measure(None)
    assert calls == ([[1, 8], profile.LADDER] if remeasured else [[1, 8]])
    assert cost.seconds == ([0.005, 0.006, 0.009] if remeasured else [0.0062, 0.0063, 0.0104])
    stored = json.loads((tmp_path / "cost-k.json").read_text())["seconds"]
    assert stored == cost.seconds
