"""Prefix caching: requests that share a prompt prefix share its full KV pages. The pool keeps
reference counts and evicts only cached pages nobody holds, oldest first; with caching on, every
request's target and drafter caches still equal a fresh computation after every step (through
shared pages, chunked prefill, speculation and preemption), and outputs equal an engine without
it."""

from __future__ import annotations

import pytest
from spec_helpers import alphabet_prompts, kernel_dtype_name, make_engine, run_requests
from test_spec_cache import check_caches, fresh  # noqa: F401 - fresh is a fixture

from dspark.config import SamplingParams
from dspark.engine.kv_cache import PagePool

pytestmark = pytest.mark.usefixtures("single_thread")
GREEDY = SamplingParams(temperature=0.0, max_tokens=30)


def test_pool_shares_registered_pages_and_evicts_the_oldest_unheld():
    pool = PagePool(6, page_size=4, prefix_caching=True)
    ids = list(range(100, 114))  # 3 full pages + 2 tokens
    pool.reserve(1, 14)
    pool.register(1, lambda a, b: ids[a:b], 14)  # pages 0-2 are full and committed
    assert pool.match_prefix(2, ids, limit=13) == 12  # all three, shared
    assert pool.tables[2].pages == pool.tables[1].pages[:3] and pool.num_free == 2
    assert pool.match_prefix(3, ids[:5] + [0] * 9, limit=13) == 4  # the first page only
    pool.free(1)
    pool.free(2)
    pool.free(3)
    assert pool.num_free == 6 and pool.usage() == 0.0  # cached pages count as free
    assert pool.match_prefix(4, ids, limit=11) == 8  # limit: at most two pages
    pool.free(4)
    pool.reserve(5, 5 * 4)  # the 3 never-registered pages, then evictions: a prefix's last page first
    assert pool.match_prefix(6, ids, limit=13) == 4
    assert pool.num_free == 0 and not pool.can_reserve(7, 1)  # the first page is held by 6 now
    pool.free(6)
    assert pool.num_free == 1 and pool.match_prefix(7, ids, limit=13) == 4
    salted = PagePool(6, page_size=4, prefix_caching=True)  # a salt keeps a cache of its own
    salted.reserve(1, 8)
    salted.register(1, lambda a, b: ids[a:b], 8, salt=b"decode-kernels")
    assert salted.match_prefix(2, ids, limit=13) == 0
    assert salted.match_prefix(3, ids, limit=13, salt=b"decode-kernels") == 8
    off = PagePool(4, page_size=4)
    off.reserve(1, 8)
    off.register(1, lambda a, b: ids[a:b], 8)
    assert off.match_prefix(2, ids, limit=13) == 0


@pytest.mark.parametrize("drafter,tree", [("none", False), ("dspark", False), ("dspark", True), ("ngram", False)])
def test_outputs_and_caches_equal_an_engine_without_it(folders, fresh, drafter, tree):  # noqa: F811
    """Prompts sharing a long prefix (one of them twice), admitted together and one after
    another, over chunked prefill: the same tokens as without prefix caching, pages found in
    the cache, and every cache entry equal to a fresh prefill."""
    base = alphabet_prompts([41], seed=3)[0]
    tails = alphabet_prompts([5, 9, 3], seed=4)
    prompts = [base + tails[0], base + tails[1], base + tails[0], base[:20] + tails[2]]
    kw = dict(tree=tree, tree_budget=8, max_num_batched_tokens=40)
    plain = make_engine(folders["target"], folders.get(drafter, drafter), **kw)
    cached = make_engine(folders["target"], folders.get(drafter, drafter), enable_prefix_caching=True, **kw)
    want = run_requests(plain, [(p, GREEDY, None) for p in prompts])
    first = run_requests(cached, [(prompts[0], GREEDY, None)])[0]
    assert cached.pool.prefix_hits == 0 and first.token_ids == want[0].token_ids
    assert plain.pool.prefix_queries == 0 < cached.pool.prefix_queries  # nothing is looked up without it
    for i, p in enumerate(prompts):
        cached.add_request(f"again-{i}", p, GREEDY)
    steps = 0
    while cached.has_unfinished():
        outs = {o.request_id: o for o in cached.step()}
        for s in cached.running:
            if s.num_cached:
                check_caches(cached, fresh, s)
        for i in range(len(prompts)):
            if f"again-{i}" in outs and outs[f"again-{i}"].finished:
                assert outs[f"again-{i}"].token_ids == want[i].token_ids
        steps += 1
        assert steps < 400
    assert cached.pool.prefix_hits >= 3 * 32 + 16  # three prompts start with the cached 41 tokens
    if drafter == "dspark":
        assert cached.spec_stats.accepted > 0


def test_preemption_and_eviction_under_a_small_pool(folders, fresh):  # noqa: F811
    """Nine pages for three requests of ~60 tokens with a shared prefix: preempted requests
    come back through the cache, evicted pages are recomputed, and output never changes."""
    base = alphabet_prompts([33], seed=8)[0]
    prompts = [base + t for t in alphabet_prompts([3, 6, 2], seed=9)]
    sp = SamplingParams(temperature=0.0, max_tokens=40)
    kw = dict(kv_cache_tokens=16 * 9, max_num_batched_tokens=40)
    want = run_requests(make_engine(folders["target"], folders["dspark"], **kw), [(p, sp, None) for p in prompts])
    engine = make_engine(folders["target"], folders["dspark"], enable_prefix_caching=True, **kw)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, sp)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        for s in engine.running:
            if s.num_cached:
                check_caches(engine, fresh, s)
    assert engine.num_preemptions > 0 and engine.pool.prefix_hits > 0
    assert [done[f"p{i}"].token_ids for i in range(3)] == [w.token_ids for w in want]


def test_prompt_logprobs_requests_compute_every_position(folders):
    engine = make_engine(folders["target"], enable_prefix_caching=True)
    prompt = alphabet_prompts([37], seed=2)[0]
    run_requests(engine, [(prompt, GREEDY, None)])
    hits = engine.pool.prefix_hits
    out = run_requests(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0), None)])[0]
    assert engine.pool.prefix_hits == hits and len(out.prompt_logprobs) == len(prompt)
    run_requests(engine, [(prompt, GREEDY, None)])
    assert engine.pool.prefix_hits == hits + 32


def test_server_counts_prefix_cache_tokens(folders):
    """Over HTTP: a repeated prompt is answered the same, and the prefix cache counters move."""
    import httpx
    from server_helpers import metric, scrape, serve

    from dspark.config import EngineConfig, SpecConfig
    from dspark.engine.engine import Engine

    engine = Engine(EngineConfig(model=folders["target"], device="cpu", dtype="float32", enable_prefix_caching=True,
                                 spec=SpecConfig(drafter="none")))
    prompt = alphabet_prompts([40], seed=12)[0]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    with serve(engine) as s:
        outs = [httpx.post(s.url + "/v1/completions", json=body, timeout=60).json() for _ in range(2)]
        m = scrape(s.url)
        assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]
        assert metric(m, "dspark:prefix_cache_queries_total") == 2 * 40
        assert metric(m, "dspark:prefix_cache_hits_total") == 32  # two full pages of 16; the rest is computed
        # n choices: the first is prefilled before the others are admitted, which find its pages
        other = alphabet_prompts([40], seed=13)[0]
        out = httpx.post(s.url + "/v1/completions", json={**body, "prompt": [other, prompt], "n": 3},
                         timeout=60).json()
        hits = metric(scrape(s.url), "dspark:prefix_cache_hits_total") - 32
    assert [c["index"] for c in out["choices"]] == list(range(6))
    texts = [c["text"] for c in out["choices"]]
    assert texts[3:] == [outs[0]["choices"][0]["text"]] * 3 and len(set(texts[:3])) == 1
    assert hits == 32 + 2 * 32 + 2 * 32  # prompt 2 from the cache at once; each prompt's 2 later choices


@pytest.mark.parametrize("drafter", ["none", "ngram"])
@pytest.mark.parametrize("gemm_min", [0, 10_000])
def test_on_by_default_where_prompt_chunks_are_exact(tmp_path, folders, drafter, gemm_min):
    """A bf16 int4 target with 64-wide heads on the CPU kernels: prompt rows get the same bits
    however a prompt is chunked, so prefix caching is on by default, and requests that find
    their prompts' pages give what an engine without caching gives with whole prompts, every
    prompt cut into chunks of 16 or not, next turns holding earlier answers too. A dense float32
    target keeps it off. gemm_min: every prompt takes the CPU's prompt path (the AMX prompt
    GEMM, where there is one), or none does."""
    from spec_helpers import save_tiny_target

    from dspark.models import cpu_ops

    ops = cpu_ops.quant()
    if ops is None or not hasattr(ops, "attend_causal"):
        pytest.skip("needs the int4 kernels and their causal attention")
    assert make_engine(folders["target"]).pool.prefix_caching is False
    target = save_tiny_target(tmp_path / "t64", predictable=False, head_dim=64)  # any changed bit shows
    base = alphabet_prompts([45], seed=7)[0]
    tails = alphabet_prompts([6, 11, 4], seed=8)
    prompts = [base + t for t in tails] + [base[:30] + tails[0]]
    kw = dict(quantization="int4", dtype=kernel_dtype_name(), prompt_gemm_min_tokens=gemm_min)
    ref = make_engine(target, drafter, enable_prefix_caching=False, max_num_batched_tokens=512, **kw)
    want = [o.token_ids for o in run_requests(ref, [(p, GREEDY, None) for p in prompts])]
    cached = make_engine(target, drafter, max_num_batched_tokens=16, **kw)
    assert cached.pool.prefix_caching is True
    for _ in range(2):  # the second round finds every prompt's full pages
        got = run_requests(cached, [(p, GREEDY, None) for p in prompts])
        assert [o.token_ids for o in got] == want
    assert cached.pool.prefix_hits >= 4 * 32
    # the next turn of a chat holds an earlier answer in its prompt: its tokens were decoded, and
    # are computed again as prompt rows (only prompt pages are shared), as without caching
    turn = [prompts[0] + want[0] + tails[1], prompts[1] + want[1]]
    want2 = [o.token_ids for o in run_requests(ref, [(p, GREEDY, None) for p in turn])]
    assert [o.token_ids for o in run_requests(cached, [(p, GREEDY, None) for p in turn])] == want2


def test_prompts_admitted_while_drafting_pauses_share_the_prefix(folders, fresh, monkeypatch):  # noqa: F811
    """A pause defers the drafter's context writes, and a page is shared only once its drafter
    context is written: prompt positions are written at once (the generated ones still wait), so
    a prompt admitted during a long pause still finds the shared prefix, its caches equal a fresh
    prefill once the pause's writes go in, and its tokens equal an engine without prefix caching."""
    from dspark.engine.policy import CostModel

    monkeypatch.setattr("dspark.engine.profile.load_or_measure", lambda engine: CostModel([1], [1.0], frozen=True))
    base = alphabet_prompts([41], seed=3)[0]
    prompts = [base + t for t in alphabet_prompts([5, 9], seed=4)]
    want = run_requests(make_engine(folders["target"], folders["dspark"]), [(p, GREEDY, None) for p in prompts])
    engine = make_engine(folders["target"], folders["dspark"], policy="load-aware", enable_prefix_caching=True)
    spec = engine.spec

    def losing(survival, other_tokens, draft_seconds, max_total=None):  # every drafting step loses to plain decoding
        spec.policy.last_gain = 0.5
        return [1] * len(survival)

    monkeypatch.setattr(spec.policy, "_admit", losing)
    spec.controller.backoff = 1000  # the first judged loss pauses drafting for the rest of the test
    run_requests(engine, [(alphabet_prompts([20], seed=6)[0], GREEDY, None)])  # drafts, loses, pauses
    assert spec.controller.skip_steps > 100
    passes, outs = spec.controller.num_draft_passes, []
    for p in prompts:  # one after the other: the second finds the first's prompt pages
        outs += run_requests(engine, [(p, GREEDY, None)])
    context = spec.proposer.context
    assert spec.controller.num_draft_passes == passes  # paused throughout
    assert context.pending and not context.prompts_pending  # generated positions wait, prompts do not
    assert engine.pool.prefix_hits >= 32  # the base's two full pages
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    engine.add_request("late", prompts[1], GREEDY)
    engine.step()  # its prefill, from the cache
    spec.proposer.context.flush()  # what the drafter's next pass would write first
    check_caches(engine, fresh, engine.running[0])


def test_short_prompts_take_the_decode_kernels_and_cache_apart(tmp_path, folders, monkeypatch):
    """Where prompt rows have a path of their own, prompts shorter than prompt_gemm_min_tokens
    pass no prompt rows to it (their rows take the decode kernels, whatever the chunking), and
    their pages sit in a cache of their own: a short and a long prompt with the same first
    pages never answer each other's prefix, and outputs equal an engine without caching. On a CPU
    with the AMX prompt GEMM the two kinds' bits differ; elsewhere the path is pretended."""
    from spec_helpers import save_tiny_target

    from dspark.engine.verify import Work
    from dspark.models import cpu_ops

    ops = cpu_ops.quant()
    if ops is None or not hasattr(ops, "attend_causal"):
        pytest.skip("needs the int4 kernels and their causal attention")
    target = save_tiny_target(tmp_path / "t64", predictable=False, head_dim=64)
    base = alphabet_prompts([40], seed=9)[0]
    tails = alphabet_prompts([12, 3], seed=10)
    long_p, short_p = base + tails[0], base[:33] + tails[1]  # 52 and 36 tokens: pages 0-1 alike
    kw = dict(quantization="int4", dtype=kernel_dtype_name(), prompt_gemm_min_tokens=48)
    ref = make_engine(target, "none", enable_prefix_caching=False, **kw)
    want = [o.token_ids for o in run_requests(ref, [(p, GREEDY, None) for p in (long_p, short_p)])]
    cached = make_engine(target, "none", max_num_batched_tokens=16, **kw)
    cached.prompt_kernel_differs = True  # as on an AMX CPU, so that the rule runs on every machine
    seen = []
    real = Work.prompt_rows.fget
    monkeypatch.setattr(Work, "prompt_rows", property(lambda w: seen.append((len(w.seq.prompt_ids), real(w)))
                                                       or real(w)))
    for order in ((long_p, short_p), (short_p, long_p)):
        for p in order:
            got = run_requests(cached, [(p, GREEDY, None)])[0].token_ids
            assert got == want[0 if p is long_p else 1]
    rows = {n: {r for m, r in seen if m == n} for n, _ in seen}
    assert rows[len(short_p)] == {0} and max(rows[len(long_p)]) > 0  # prompt rows only for the long one
    hits = cached.pool.prefix_hits
    assert hits == 48 + 32  # each prompt found only its own earlier pages: 3 long, 2 short
