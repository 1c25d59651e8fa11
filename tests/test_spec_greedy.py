"""Greedy speculative decoding equals plain greedy decoding, token for token.

A tiny predictable Llama target (tests/spec_helpers.py) with DSpark (Markov head that often
guesses right), DFlash (random: mostly rejected) and n-gram drafters; chains and trees; the
fixed, threshold and load-aware policies; per-request block sizes 1..8 in one batch and the
engine-wide block size; prompts of 15-40 tokens over 16-token pages; max_tokens and stop
tokens that land inside an accepted block; chunked prefill and preemption under a small pool.
"""

from __future__ import annotations

import dataclasses

import pytest
from spec_helpers import alphabet_prompts, make_engine, run_requests

from dspark.config import SamplingParams

pytest.importorskip("transformers")


LENGTHS = [15, 16, 17, 24, 31, 32, 33, 40]  # around the 16-token page boundaries
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def prompts():
    return alphabet_prompts(LENGTHS, seed=3)


@pytest.fixture(scope="module")
def plain(folders):
    """Plain greedy outputs (drafter "none"), memoized per (prompt, params)."""
    engine = make_engine(folders["target"], "none")
    memo: dict = {}

    def get(requests):
        todo = [(p, sp) for p, sp in requests if _key(p, sp) not in memo]
        if todo:
            outs = run_requests(engine, [(p, sp, None) for p, sp in todo])
            for (p, sp), o in zip(todo, outs):
                memo[_key(p, sp)] = o
        assert engine.spec_stats.verified == 0
        return [memo[_key(p, sp)] for p, sp in requests]

    return get


def _key(prompt, sp: SamplingParams):
    return tuple(prompt), sp.max_tokens, tuple(sp.stop_token_ids), tuple(sp.stop), sp.temperature


def _drafter(folders, name: str) -> str:
    return name if name in ("ngram", "none") else folders[name]


def _assert_same(spec_outs, ref_outs):
    for i, (a, b) in enumerate(zip(spec_outs, ref_outs)):
        assert a.token_ids == b.token_ids, f"request {i}: speculative {a.token_ids} != plain {b.token_ids}"
        assert a.finish_reason == b.finish_reason, f"request {i}"
        assert a.text == b.text, f"request {i}"


def _assert_counts_committed(outs) -> None:
    """A step cut short by a stop or max_tokens counts only the tokens it committed as accepted."""
    for o in outs:
        assert o.stats.generated == o.stats.steps + o.stats.accepted, o.stats.as_dict()
        assert o.stats.generated < len(o.token_ids), o.stats.as_dict()  # the first came from prefill


def _partial_steps(outs) -> int:
    """Requests whose steps include at least one partial acceptance (some, not all drafts kept)."""
    return sum(1 for o in outs if 0 < o.stats.accepted < o.stats.verified)


CHAIN = [("dspark", "fixed"), ("dspark", "threshold"), ("dspark", "load-aware"), ("dspark_rv", "fixed"),
         ("dflash", "fixed"), ("dflash", "threshold"), ("dflash", "load-aware"), ("ngram", "fixed")]


@pytest.mark.parametrize("drafter,policy", CHAIN, ids=[f"{d}-{p}" for d, p in CHAIN])
def test_chain_per_request_block_sizes(folders, prompts, plain, drafter, policy, tmp_path, monkeypatch):
    """One batch: mixed prompt lengths, block sizes 1..8 per request, plus sampled requests riding along."""
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))  # the load-aware cost profile lands here
    engine = make_engine(folders["target"], _drafter(folders, drafter), policy=policy, threshold=0.5)
    reqs = [(p, GREEDY, b) for p, b in zip(prompts, range(1, 9))]
    sampled = [(prompts[0], SamplingParams(temperature=0.8, top_k=5, seed=7, max_tokens=4), 4),
               (prompts[5], SamplingParams(temperature=1.2, top_p=0.9, seed=8, max_tokens=4), None)]
    outs = run_requests(engine, reqs + sampled)[:len(reqs)]
    _assert_same(outs, plain([(p, GREEDY) for p in prompts]))
    st = engine.spec_stats
    assert st.verified > 0, "no draft token was ever verified"
    assert engine.spec.name == {"ngram": "ngram", "dspark_rv": "dspark"}.get(drafter, drafter)
    if drafter != "dflash":  # these draft well on the predictable target
        assert st.accepted > 0 and _partial_steps(outs) >= 2, st.as_dict()
    # block size 1 never verifies more than one draft token per step
    assert outs[0].stats.verified <= outs[0].stats.steps
    if drafter == "ngram":  # finished requests leave no lookup index behind
        assert engine.spec.proposer.drafter._indexes == {}


BLOCKS = [("dspark", b) for b in range(1, 9)] + [("dflash", b) for b in (1, 4, 8)] + [("ngram", b) for b in (1, 3, 8)]


@pytest.mark.parametrize("drafter,block", BLOCKS, ids=[f"{d}-{b}" for d, b in BLOCKS])
def test_chain_engine_block_size(folders, prompts, plain, drafter, block):
    """SpecConfig.block_size (the engine-wide default): 1..8 for DSpark, a few for DFlash and n-gram."""
    engine = make_engine(folders["target"], _drafter(folders, drafter), block_size=block)
    sub = prompts[::3]
    sp = dataclasses.replace(GREEDY, max_tokens=24)
    outs = run_requests(engine, [(p, sp, None) for p in sub])
    _assert_same(outs, plain([(p, sp) for p in sub]))
    assert all(o.stats.verified <= block * o.stats.steps for o in outs)
    assert engine.spec_stats.verified > 0


@pytest.mark.parametrize("drafter", ["dspark", "dflash", "ngram"])
def test_max_tokens_inside_block(folders, prompts, plain, drafter):
    """max_tokens 1, 2, 5, 7, 9 and 17 end requests exactly where plain decoding does."""
    engine = make_engine(folders["target"], _drafter(folders, drafter))
    reqs = [(p, dataclasses.replace(GREEDY, max_tokens=m)) for p in prompts[:4] for m in (1, 2, 5, 7, 9, 17)]
    outs = run_requests(engine, [(p, sp, None) for p, sp in reqs])
    ref = plain([(p, dataclasses.replace(GREEDY, max_tokens=40)) for p, _ in reqs])
    for o, r, (_, sp) in zip(outs, ref, reqs):
        assert o.token_ids == r.token_ids[:sp.max_tokens]
        if len(o.token_ids) == sp.max_tokens:
            assert o.finish_reason == "length"
    _assert_same(outs, plain(reqs))
    _assert_counts_committed(outs)
    if drafter == "dspark":  # some request really finished inside an accepted block
        assert any(o.stats.accepted > 0 and len(o.token_ids) == sp.max_tokens and sp.max_tokens > 2
                   for o, (_, sp) in zip(outs, reqs))


@pytest.mark.parametrize("drafter", ["dspark", "dflash", "ngram"])
def test_stop_token_inside_block(folders, prompts, plain, drafter):
    """A stop token that plain decoding emits mid-generation ends the speculative request there too."""
    ref = plain([(p, GREEDY) for p in prompts])
    reqs = []
    for p, r in zip(prompts, ref):
        tok = r.token_ids[len(r.token_ids) // 2]  # a token from the middle of the plain output
        reqs.append((p, dataclasses.replace(GREEDY, stop_token_ids=[tok])))
    engine = make_engine(folders["target"], _drafter(folders, drafter))
    outs = run_requests(engine, [(p, sp, None) for p, sp in reqs])
    for o, r, (_, sp) in zip(outs, ref, reqs):
        cut = r.token_ids.index(sp.stop_token_ids[0]) + 1
        assert o.token_ids == r.token_ids[:cut]
        assert o.finish_reason == "stop"
    _assert_same(outs, plain(reqs))
    _assert_counts_committed(outs)


@pytest.mark.parametrize("drafter", ["dspark", "ngram"])
def test_chunked_prefill_and_preemption(folders, prompts, plain, drafter):
    """A small token budget (prefill chunks beside decode chains) and a small pool (preemptions;
    without the n-gram assist, whose long chains on this looping target finish the requests
    before the pool runs out)."""
    engine = make_engine(folders["target"], _drafter(folders, drafter), kv_cache_tokens=16 * 14,
                         max_num_batched_tokens=40, ngram_assist=0)
    outs = run_requests(engine, [(p, GREEDY, None) for p in prompts])
    _assert_same(outs, plain([(p, GREEDY) for p in prompts]))
    assert engine.num_preemptions > 0
    assert engine.spec_stats.accepted > 0


def test_oldest_request_keeps_its_pages(folders, plain):
    """Two requests that cannot both finish in the pool: the newer one yields its pages (first come,
    first served), and both still equal plain decoding."""
    engine = make_engine(folders["target"], folders["dspark"], kv_cache_tokens=16 * 7)
    reqs = [(p, GREEDY) for p in alphabet_prompts([40, 33], seed=3)]  # 80 and 73 tokens, 112 in the pool
    outs = run_requests(engine, [(p, sp, None) for p, sp in reqs])
    _assert_same(outs, plain(reqs))
    assert engine.num_preemptions > 0 and outs[0].num_preemptions == 0


@pytest.mark.parametrize("drafter", ["dspark", "ngram"])
def test_drafts_never_cost_a_preemption(folders, plain, drafter):
    """A 4-page pool: pages for plain steps of both requests exist for a while, but not for both
    requests' drafts. The newer request then decodes plainly instead of giving up its pages (and
    being recomputed every step), so drafting costs no more preemptions than plain decoding has."""
    reqs = [(p, dataclasses.replace(GREEDY, max_tokens=15)) for p in alphabet_prompts([30, 10], seed=5)]
    counts = []
    for name in ("none", drafter):
        engine = make_engine(folders["target"], _drafter(folders, name), kv_cache_tokens=64,
                             block_size=None if name == "none" else 8)
        outs = run_requests(engine, [(p, sp, None) for p, sp in reqs])
        _assert_same(outs, plain(reqs))
        counts.append(engine.num_preemptions)
    assert counts[1] <= counts[0], counts
    assert outs[0].stats.accepted > 0  # the older request kept drafting


def test_prefill_leaves_pages_for_running_drafts(folders, plain):
    """A request arriving while another decodes, with a prompt longer than the free pages: its
    prefill waits for pages rather than taking those the older request's drafts need (which would
    switch drafting off there, then preempt the newcomer and recompute it, step after step)."""
    engine = make_engine(folders["target"], folders["dspark"], kv_cache_tokens=16 * 6, block_size=8)
    (pa, pb), sa, sb = alphabet_prompts([20, 60], seed=7), dataclasses.replace(GREEDY, max_tokens=30), \
        dataclasses.replace(GREEDY, max_tokens=10)
    engine.add_request("a", pa, dataclasses.replace(sa))
    done, plain_steps = {}, 0
    for i in range(200):
        if i == 2:
            engine.add_request("b", pb, dataclasses.replace(sb))
        a = engine.seqs.get("a")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        plain_steps += bool(a is not None and a.plain_step)
        if not engine.has_unfinished():
            break
    _assert_same([done["a"], done["b"]], plain([(pa, sa), (pb, sb)]))
    assert engine.num_preemptions == 0 and plain_steps == 0, (engine.num_preemptions, plain_steps)


TREES = [("dspark", 16, 2), ("dspark", 5, 3), ("dflash", 8, 2), ("dspark_rv", 8, 2)]


@pytest.mark.parametrize("drafter,budget,topk", TREES, ids=[f"{d}-{b}x{k}" for d, b, k in TREES])
def test_tree_matches_plain(folders, prompts, plain, drafter, budget, topk):
    engine = make_engine(folders["target"], folders[drafter], tree=True, tree_budget=budget, tree_topk=topk)
    sp = dataclasses.replace(GREEDY, max_tokens=24)
    reqs = [(p, sp, b) for p, b in zip(prompts, range(1, 9))]
    reqs += [(p, dataclasses.replace(GREEDY, max_tokens=m), None) for p, m in zip(prompts[:3], (2, 5, 7))]
    outs = run_requests(engine, reqs)
    _assert_same(outs, plain([(p, sp) for p, sp, _ in reqs]))
    assert engine.spec_stats.verified > 0
    if drafter.startswith("dspark"):
        assert engine.spec_stats.accepted > 0


def test_tree_stop_token_and_pressure(folders, prompts, plain):
    ref = plain([(p, GREEDY) for p in prompts])
    reqs = [(p, dataclasses.replace(GREEDY, stop_token_ids=[r.token_ids[len(r.token_ids) // 2]]))
            for p, r in zip(prompts, ref)]
    engine = make_engine(folders["target"], folders["dspark"], tree=True, tree_budget=12, tree_topk=2,
                         kv_cache_tokens=16 * 16, max_num_batched_tokens=48)
    outs = run_requests(engine, [(p, sp, None) for p, sp in reqs])
    _assert_same(outs, plain(reqs))
    assert engine.spec_stats.accepted > 0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_stop_string_ends_at_the_same_token(folders, prompts, plain, tree):
    """A stop string completed inside an accepted block ends the output at the token that completes
    it, as plain decoding does: the same token ids (so the same usage), text and finish reason."""
    ref = plain([(p, GREEDY) for p in prompts])
    reqs = []
    for p, r in zip(prompts, ref):
        at = len(r.text) // 2
        reqs.append((p, dataclasses.replace(GREEDY, stop=[r.text[at:at + 2]])))
    kw = dict(tree=True, tree_budget=12, tree_topk=2) if tree else {}
    engine = make_engine(folders["target"], folders["dspark"], **kw)
    outs = run_requests(engine, [(p, sp, None) for p, sp in reqs])
    want = plain(reqs)
    _assert_same(outs, want)
    assert sum(o.finish_reason == "stop" and len(o.token_ids) < 40 for o in want) >= 6
    assert engine.spec_stats.accepted > 0
    _assert_counts_committed(outs)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_context_shrinks_to_the_pool(folders, prompts, plain, tree):
    """A pool smaller than the model's context shortens max_model_len to what one request can hold
    beside its drafts, so a request that outgrows the pool ends at "length" like plain decoding
    with that context, instead of preempting itself forever. An asked-for context that cannot fit
    is refused."""
    kw = dict(tree=True, tree_budget=12, tree_topk=2) if tree else {}
    engine = make_engine(folders["target"], folders["dspark"], kv_cache_tokens=16 * 4, **kw)
    assert engine.max_model_len == 64 - engine.spec.context_headroom()
    outs = run_requests(engine, [(p, dataclasses.replace(GREEDY, max_tokens=100), None) for p in prompts[:4]])
    want = plain([(p, dataclasses.replace(GREEDY, max_tokens=engine.max_model_len - len(p))) for p in prompts[:4]])
    _assert_same(outs, want)
    assert all(len(o.prompt_token_ids) + len(o.token_ids) == engine.max_model_len for o in outs)
    with pytest.raises(ValueError, match="max_model_len 128 needs a KV cache of at least"):
        make_engine(folders["target"], folders["dspark"], kv_cache_tokens=128, max_model_len=128, **kw)


def test_proposed_counts_only_steps_that_drafted(folders, prompts, monkeypatch):
    """A step in which a request drafts nothing (one token short of max_tokens) adds nothing to its
    proposed count, whatever it drafted the step before (looked-up chains, which propose their
    own length, are off here). A drafting step counts the tokens its block pass drafted: at most
    the drafter's block, fewer where the pass ran fewer positions."""
    engine = make_engine(folders["target"], folders["dspark"], ngram_assist=0)
    spec, drafted, proposed = engine.spec, {}, {}
    real = spec.propose

    def recording(seqs, other_tokens=0, max_drafts=None):
        out = real(seqs, other_tokens, max_drafts)
        for s in seqs:
            drafted[s.request_id] = drafted.get(s.request_id, 0) + (s.seq_id in out)
            if s.seq_id in out:
                proposed.setdefault(s.request_id, []).append(out[s.seq_id].num_proposed)
        return out

    monkeypatch.setattr(spec, "propose", recording)
    reqs = [(p, dataclasses.replace(GREEDY, max_tokens=m), None) for p, m in zip(prompts, [3, 3, 4, 4, 5, 5, 9, 9])]
    outs = run_requests(engine, reqs)
    nd = spec.proposer.drafter.config.num_drafts
    assert all(1 <= n <= nd for ns in proposed.values() for n in ns)
    assert [o.stats.proposed for o in outs] == [sum(proposed.get(o.request_id, [])) for o in outs]
    assert [len(proposed.get(o.request_id, [])) for o in outs] == [drafted.get(o.request_id, 0) for o in outs]
    assert sum(o.stats.steps > drafted.get(o.request_id, 0) for o in outs) >= 2  # steps that drafted nothing


def test_smollm2_random_drafter(tmp_path):
    """The default SmolLM2 target with a random DSpark drafter: same greedy tokens as plain decoding
    (requests with spec=False on the same engine)."""
    from spec_helpers import save_drafter_for

    from dspark.models.loader import ModelLoadError, resolve_model_folder

    try:
        folder = resolve_model_folder(None)
    except ModelLoadError as e:
        pytest.skip(str(e))
    engine = make_engine(folder, save_drafter_for(tmp_path / "rand", folder), block_size=5)
    prompts = ["def fib(n):\n    if n < 2:\n        return n\n    return", "The capital of France is"]
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    ref = run_requests(engine, [(p, sp, None) for p in prompts], spec=False)
    assert engine.spec_stats.verified == 0
    outs = run_requests(engine, [(p, sp, b) for p, b in zip(prompts, (None, 3))])
    _assert_same(outs, ref)
    assert engine.spec_stats.verified > 0


ASSIST = [("fixed", False), ("load-aware", False), ("fixed", True), ("load-aware", True)]


@pytest.mark.parametrize("policy,tree", ASSIST, ids=[f"{p}{'-tree' if t else ''}" for p, t in ASSIST])
def test_ngram_assist_matches_plain(folders, prompts, plain, policy, tree, tmp_path, monkeypatch):
    """Past one lap of the target's 24-token cycle, requests repeat themselves: their looked-up chains
    replace the drafter's blocks (the drafter pass skipped when every request has one), outputs stay
    plain decoding's, sampled requests riding along, and looked-up chains are accepted further than
    drafted ones, and chains accepted whole grow past the block to ngram_assist_max_len."""
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    engine = make_engine(folders["target"], folders["dspark"], policy=policy, tree=tree, tree_budget=6,
                         ngram_assist_max_len=20)
    spec, looked, passes, longest = engine.spec, [], [], [0]
    real = spec.propose

    def recording(seqs, other_tokens=0, max_drafts=None):
        before = spec.controller.num_draft_passes
        out = real(seqs, other_tokens, max_drafts)
        if seqs:  # steps without decodes propose nothing and skip no pass
            looked.append(len(spec.assist.looked))
            passes.append(spec.controller.num_draft_passes - before)
        longest[0] = max([longest[0]] + list(spec.assist.verified.values()))
        return out

    monkeypatch.setattr(spec, "propose", recording)
    sp = dataclasses.replace(GREEDY, max_tokens=72)
    sampled = [(prompts[2], SamplingParams(temperature=0.9, seed=5, max_tokens=30), None)]
    outs = run_requests(engine, [(p, sp, None) for p in prompts[:3]] + sampled)[:3]
    _assert_same(outs, plain([(p, sp) for p in prompts[:3]]))
    assert sum(looked) > 0 and 0 in passes  # some steps looked up every chain and skipped the pass
    st = engine.spec_stats  # every request's steps that verified a lookup, and what they kept
    assert 0 < st.lookup_steps <= sum(looked) and st.lookup_accepted <= st.accepted
    assert sum(o.stats.lookup_steps for o in outs) <= st.lookup_steps
    if policy == "fixed":  # load-aware admits what pays at this model's measured (noisy) costs
        # the prior learns from what verified chains reached (1 accepted of 2 reached is 0.5 too)
        reached, accepted = spec.assist.reached[0], spec.assist.accepted[0]
        assert reached > 0 and spec.assist.prior(4)[0].item() == pytest.approx((accepted + 1) / (reached + 2))
        assert st.lookup_accepted > 0
        assert spec.block_size < longest[0] <= 20
    # finished requests keep no lookup index and no grown span
    assert spec.assist.spans == {} and spec.assist.lookup._indexes == {}
    with pytest.raises(ValueError, match=r"block_size must be an integer in \[1, 8\]"):
        engine.add_request("too-long", prompts[0], GREEDY, block_size=64)
