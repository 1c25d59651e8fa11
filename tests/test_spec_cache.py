"""After any number of speculative steps, both caches hold exactly what a fresh computation gives.

Target: the K/V cached for a request's committed positions (engine.pool.slots(seq, 0, num_cached))
equal those of a fresh one-shot prefill of all_ids[:num_cached]. Drafter: its context K/V at the
same slots equal drafter.write_context over the target features captured by that fresh forward.
Checked after every step, while chunked prefill, chains (or trees) with many partial acceptances
and rollbacks run side by side, stopping mid-generation.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from spec_helpers import LAYER_IDS, alphabet_prompts, make_engine

from dspark.config import SamplingParams
from dspark.engine.kv_cache import KVCache
from dspark.engine.sequence import Sequence

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-4, atol=1e-4)
_fresh_ids = itertools.count(10_000)


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def fresh(folders):
    return make_engine(folders["target"], "none")


def fresh_prefill(fresh, ids: list[int]):
    """One-shot prefill of ids on a plain engine: (K [L, n, h, d], V, captured features [n, m*H])."""
    n = len(ids)
    seq = Sequence(seq_id=next(_fresh_ids), request_id="fresh", prompt_ids=list(ids), params=SamplingParams(),
                   generator=None, eos_ids=frozenset())
    fresh.pool.reserve(seq.seq_id, n)
    try:
        res = fresh.runner.forward([(seq, list(ids))], [n - 1], capture=tuple(LAYER_IDS))
        slots = fresh.pool.slots(seq.seq_id, 0, n)
        return fresh.runner.kv.k[:, slots].clone(), fresh.runner.kv.v[:, slots].clone(), res.feats.clone()
    finally:
        fresh.pool.free(seq.seq_id)


def drafter_context(drafter, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's context K/V for positions 0..n-1 computed from scratch on a fresh KVCache."""
    dc, n = drafter.config, feats.shape[0]
    kv = KVCache(dc.num_hidden_layers, 1, n, dc.num_key_value_heads, dc.head_dim, feats.dtype, feats.device)
    pos = torch.arange(n)
    with torch.inference_mode():
        drafter.write_context(feats, pos, pos, kv)
    return kv.k, kv.v


def check_caches(engine, fresh, seq) -> None:
    n = seq.num_cached
    slots = engine.pool.slots(seq.seq_id, 0, n)
    k, v, feats = fresh_prefill(fresh, seq.all_ids[:n])
    where = f"request {seq.request_id}, {n} cached tokens"
    torch.testing.assert_close(engine.runner.kv.k[:, slots], k, **TOL, msg=lambda m: f"target K, {where}: {m}")
    torch.testing.assert_close(engine.runner.kv.v[:, slots], v, **TOL, msg=lambda m: f"target V, {where}: {m}")
    spec = engine.spec
    if hasattr(spec, "kv"):  # a neural drafter with its own context cache
        dk, dv = drafter_context(spec.proposer.drafter, feats)
        torch.testing.assert_close(spec.kv.k[:, slots], dk, **TOL, msg=lambda m: f"drafter K, {where}: {m}")
        torch.testing.assert_close(spec.kv.v[:, slots], dv, **TOL, msg=lambda m: f"drafter V, {where}: {m}")


CASES = [("dspark", False, 0.0), ("dspark", True, 0.0), ("dflash", False, 0.0), ("dspark_soft", False, 1.0),
         ("ngram", False, 0.0)]


@pytest.mark.parametrize("drafter,tree,temperature", CASES,
                         ids=[f"{d}{'-tree' if t else ''}-T{temp}" for d, t, temp in CASES])
def test_caches_equal_fresh_computation(folders, fresh, drafter, tree, temperature):
    engine = make_engine(folders["target"], folders.get(drafter, drafter), tree=tree, tree_budget=10,
                         max_num_batched_tokens=40)
    prompts = alphabet_prompts([15, 17, 24, 33, 40, 16], seed=5)
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=temperature, top_k=8 if temperature else 0, seed=i, max_tokens=500)
        block = [None, 3, 8, 1, 5, None][i]  # within what the drafter emits (the engine refuses more)
        engine.add_request(f"c{i}", p, sp, block_size=block and min(block, engine.spec.block_size))
    partial = checked = 0
    for _ in range(14):
        before = {s.seq_id: (s.stats.accepted, s.stats.verified) for s in engine.running}
        engine.step()
        for s in engine.running:
            if s.num_cached == 0:
                continue
            check_caches(engine, fresh, s)
            checked += 1
            a0, v0 = before.get(s.seq_id, (0, 0))
            partial += 0 < s.stats.accepted - a0 < s.stats.verified - v0
    assert engine.has_unfinished() and all(not s.is_finished for s in engine.seqs.values())
    assert checked > 40
    assert any(s.output_ids and s.num_cached > len(s.prompt_ids) for s in engine.running)
    if drafter in ("dspark", "ngram", "dspark_soft"):
        assert partial >= 3, f"only {partial} partial acceptances"
    assert engine.spec_stats.verified > 0


def test_rollback_after_preemption(folders, fresh):
    """A preempted request recomputes its caches from its tokens; they still match a fresh prefill."""
    engine = make_engine(folders["target"], folders["dspark"], kv_cache_tokens=16 * 9, max_num_batched_tokens=40)
    prompts = alphabet_prompts([31, 33, 40], seed=9)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=60))
    released, release = [], engine.spec.release
    engine.spec.release = lambda seq_id: (released.append(seq_id), release(seq_id))
    for step in range(300):
        if not engine.has_unfinished():
            break
        engine.step()
        for s in engine.running if step < 30 else ():
            if s.num_cached:
                check_caches(engine, fresh, s)
    assert engine.num_preemptions > 0 and not engine.has_unfinished()
    # each preemption and each finish released the request's lookup state, and none is left
    assert len(released) == engine.num_preemptions + len(prompts)
    assert engine.spec.assist.spans == {} and engine.spec.assist.lookup._indexes == {}


def test_captured_features_are_hf_hidden_states(folders, fresh):
    """The features the drafter reads are HF's hidden_states[l + 1] for l in target_layer_ids."""
    ids = alphabet_prompts([37], seed=11)[0]
    _, _, feats = fresh_prefill(fresh, ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["target"], dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[layer + 1][0] for layer in LAYER_IDS], -1)
    torch.testing.assert_close(feats, want, rtol=1e-4, atol=1e-4)


def test_paused_drafter_defers_context_writes(folders, fresh, monkeypatch):
    """While the load-aware policy pauses drafting, the drafter's context writes wait; whenever the
    next step could draft, both caches again equal a fresh computation, through preemptions too."""
    from dspark.engine.policy import CostModel

    monkeypatch.setattr("dspark.engine.profile.load_or_measure", lambda engine: CostModel([1], [1.0], frozen=True))
    engine = make_engine(folders["target"], folders["dspark"], policy="load-aware", kv_cache_tokens=16 * 9,
                         max_num_batched_tokens=40)
    spec = engine.spec

    def losing(survival, other_tokens, draft_seconds, max_total=None):  # every drafting step loses to plain decoding
        spec.policy.last_gain = 0.5
        return [1] * len(survival)

    monkeypatch.setattr(spec.policy, "_admit", losing)
    spec.controller.MAX_BACKOFF = 4  # pause 4 steps after each drafting step: many pause / resume cycles
    for i, p in enumerate(alphabet_prompts([31, 33, 40], seed=9)):
        engine.add_request(f"d{i}", p, SamplingParams(temperature=0.0, max_tokens=60))
    deferred, checked = 0, 0
    for _ in range(400):
        if not engine.has_unfinished():
            break
        engine.step()
        deferred = max(deferred, spec.proposer.context.pending_rows)
        if spec.controller.skip_steps == 0:  # the next step may draft: nothing may still be pending
            assert not spec.proposer.context.pending
            for s in engine.running:
                if s.num_cached:
                    check_caches(engine, fresh, s)
                    checked += 1
    assert not engine.has_unfinished() and engine.num_preemptions > 0 and spec.controller.num_draft_passes > 5
    assert deferred >= 6 and checked > 10, (deferred, checked)


def test_pause_ended_by_a_falling_load_writes_the_context_first(folders, fresh, monkeypatch):
    """A pause that ends early (fewer requests than when drafting lost, and the policy expects a
    gain there) writes the deferred context before the drafter reads it."""
    from dspark.engine.policy import CostModel

    monkeypatch.setattr("dspark.engine.profile.load_or_measure", lambda engine: CostModel([1], [1.0], frozen=True))
    engine = make_engine(folders["target"], folders["dspark"], policy="load-aware", ngram_assist=0)
    spec = engine.spec

    def by_load(survival, other_tokens, draft_seconds, max_total=None):  # drafting loses with 2+ requests, pays alone
        spec.policy.last_gain = 1.5 if len(survival) == 1 else 0.5
        return [1] * len(survival)

    monkeypatch.setattr(spec.policy, "_admit", by_load)
    spec.controller.MIN_BACKOFF = spec.controller.backoff = 1000  # only a falling load ends a pause
    block_pass = spec.proposer._block_pass
    seen = []

    def checked_pass(seqs, length):  # whenever the drafter reads, its context is complete
        assert not spec.proposer.context.pending
        for s in seqs:
            check_caches(engine, fresh, s)
        seen.append(len(seqs))
        return block_pass(seqs, length)

    monkeypatch.setattr(spec.proposer, "_block_pass", checked_pass)
    for i, (p, n) in enumerate(zip(alphabet_prompts([31, 33], seed=5), [6, 30])):
        engine.add_request(f"f{i}", p, SamplingParams(temperature=0.0, max_tokens=n))
    while engine.has_unfinished():
        engine.step()
    # three passes with both requests (the first two are not judged), a long pause, then one
    # request left drafts again at once
    assert seen[:3] == [2, 2, 2] and seen[3:] and set(seen[3:]) == {1}, seen
