"""CUDA-graph padding, checked on CPU: the engine's graph pools without capture pad every
uniform forward (decode, chain verification, the drafter's block) to a ladder size exactly as
captured graphs would, so greedy output must equal the eager engine's token for token. The
captured replay itself is checked in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import alphabet_prompts, make_engine, run_requests

from dspark.config import SamplingParams
from dspark.engine.attention import AttnBatch
from dspark.engine.cuda_graphs import GraphPool, default_ladder

pytestmark = pytest.mark.usefixtures("single_thread")


def test_default_ladder():
    assert default_ladder(1) == [1]
    assert default_ladder(6) == [1, 2, 4, 6]
    assert default_ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_ladder(100)[-3:] == [64, 96, 100]


def test_pad_layout_and_fallbacks():
    pool = GraphPool(lambda ids, pos, attn: (ids,), lambda n: None, [2, 4], tokens=3, mask="causal",
                     scratch_pages=[9], page_size=4, device=torch.device("cpu"), capture=False)
    batch = AttnBatch(q_lens=[1, 3, 2], kv_lens=[5, 9, 3], page_tables=[[0, 1], [2, 3, 4], [5]], page_size=4)
    ids = torch.tensor([11, 21, 22, 23, 31, 32])  # at positions 4 | 6, 7, 8 | 1, 2
    padded, pids, ppos, rows = pool.pad(batch, ids)
    assert padded.q_lens == [3, 3, 3, 3] and padded.kv_lens == [7, 9, 4, 3]
    assert padded.page_tables[3] == [9]  # the padding request lives on the scratch page
    assert pids.tolist() == [11, 0, 0, 21, 22, 23, 31, 32, 0, 0, 0, 0]
    assert ppos.tolist() == [4, 5, 6, 6, 7, 8, 1, 2, 3, 0, 1, 2]
    assert rows.tolist() == [0, 3, 4, 5, 6, 7]
    # more requests than the ladder or a request longer than the pool's tokens: these run eagerly
    assert pool.pad(AttnBatch([1] * 5, [1] * 5, [[0]] * 5, 4), torch.zeros(5)) is None
    assert pool.pad(AttnBatch([4], [4], [[0]], 4), torch.zeros(4)) is None
    # padding past the reserved pages goes to the scratch page (positions 4-5 of a 1-page table)
    padded, _, ppos, rows = pool.pad(AttnBatch([1], [4], [[0]], 4), torch.zeros(1))
    assert padded.page_tables[0] == [0, 9] and ppos.tolist()[:3] == [3, 4, 5] and rows.tolist() == [0]


@pytest.mark.parametrize("drafter,policy", [("dspark", "fixed"), ("dspark", "load-aware"), ("none", "fixed"),
                                            ("ngram", "fixed")])
def test_padded_graph_forwards_keep_greedy_output(folders, drafter, policy):
    prompts = alphabet_prompts([15, 16, 17, 24, 31, 33, 40], seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reqs = [(p, sp, None) for p in prompts]
    d = folders.get(drafter, drafter)
    eager = run_requests(make_engine(folders["target"], d, policy=policy, max_num_seqs=6), reqs)
    eng = make_engine(folders["target"], d, policy=policy, max_num_seqs=6)
    eng.enable_graphs(capture=False)
    padded = run_requests(eng, reqs)
    assert [o.token_ids for o in padded] == [o.token_ids for o in eager]
    served = sum(p.num_served for p in eng.runner.graphs.values())
    assert served > 10  # most steps really went through the padded path
    if drafter == "dspark":
        # every drafter pass (load-aware pauses some) ran padded
        assert eng.spec.graphs.num_served == eng.spec.controller.num_draft_passes > 0


def test_long_looked_up_chains_run_padded(folders):
    """Looked-up chains that grow past a block (the predictable target loops through its alphabet,
    so the n-gram assist copies the last lap) go through the pool for the longest chain, padded to
    its 33 tokens, with the eager engine's greedy output."""
    prompts = alphabet_prompts([30, 31, 33], seed=5)
    sp = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    reqs = [(p, sp, None) for p in prompts]
    eager = run_requests(make_engine(folders["target"], folders["dspark"], max_num_seqs=6), reqs)
    eng = make_engine(folders["target"], folders["dspark"], max_num_seqs=6)
    eng.enable_graphs(capture=False)
    assert sorted(eng.runner.graphs) == [1, 9, 33] and eng.runner.graphs[33].ladder == [1, 2, 4, 6]
    padded = run_requests(eng, reqs)
    assert [o.token_ids for o in padded] == [o.token_ids for o in eager]
    assert eng.runner.graphs[33].num_served > 0
    assert len(eng.spec_stats.accepted_per_pos) > 8 and eng.spec_stats.accepted_per_pos[8] > 0  # past a block
