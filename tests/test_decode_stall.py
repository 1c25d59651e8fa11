"""The decode-stall bound (--max-decode-stall-ms): while requests decode, a step's prefill tokens
are capped so that its target pass, as the cost model predicts it, stays under the bound; with
nothing decoding, prefill takes the whole token budget. A long prompt arriving beside decoding
requests is sliced accordingly, and the outputs equal an unsliced run's."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from spec_helpers import alphabet_prompts, make_engine, run_requests
from test_batch_planner import FakeSpec, _running, _seq

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.batch_planner import BatchPlanner
from dspark.engine.kv_cache import PagePool
from dspark.engine.policy import CostModel

PAGE = 4


def ms_per_token(n: int) -> float:
    """A fake target: 2 ms a pass plus 0.5 ms a token."""
    return 2e-3 + 0.5e-3 * n


def _planner(bound_ms: float | None, budget: int = 256, drafts: int = 3, cost=ms_per_token,
             factor: float = 2.0) -> BatchPlanner:
    cfg = EngineConfig(page_size=PAGE, max_num_batched_tokens=budget, max_num_seqs=8, max_decode_stall_ms=bound_ms,
                       decode_stall_factor=factor)
    return BatchPlanner(cfg, PagePool(256, PAGE), FakeSpec(drafts), cost)


def _prefill_steps(p: BatchPlanner, seq, allowances: list | None = None) -> list[tuple[int, int]]:
    """Plan steps until seq's prompt is cached: (decode tokens reserved, seq's chunk) per step;
    each step's draft allowance appended to `allowances`."""
    p.waiting.append(seq)
    steps = []
    while seq.num_cached < seq.prefill_target:
        decode, prefill = p.plan()
        reserved = sum(p.spec.max_tokens_for(s) for s in decode)
        chunk = sum(n for s, n in prefill if s is seq)
        seq.num_cached += chunk  # what the engine's commit does
        steps.append((reserved, chunk))
        if allowances is not None:
            allowances.append(p.draft_allowance)
        assert len(steps) < 100
    return steps


def test_long_prompt_beside_decoding_requests_is_sliced_under_the_bound():
    """The prompt comes before the drafts: the decodes are priced at their anchors, and their
    drafts may take only what the bound leaves beside the chunk (the draft allowance)."""
    p = _planner(bound_ms=20.2)
    for i in range(2):
        _running(p, _seq(i, 6, out=1))
    allowances = []
    steps = _prefill_steps(p, _seq(9, 100), allowances)
    # 2 requests x (anchor + 3 drafts) = 8 reserved slots; 2 anchors: 2 + 0.5 (2 + n) <= 20.2 -> n <= 34
    assert steps == [(8, 34), (8, 34), (8, 32)]
    assert allowances == [0, 0, 2]  # 2 + 0.5 (2 + 32 + 2) <= 20.2
    assert all(ms_per_token(2 + n + a) <= 20.2e-3 < ms_per_token(2 + n + a + 1)
               for (_, n), a in zip(steps, allowances))
    p.plan()  # a step without a prompt: the drafts are the policy's alone
    assert p.draft_allowance is None


def test_without_decoding_requests_prefill_takes_the_whole_budget():
    steps = _prefill_steps(_planner(bound_ms=20.0, budget=64), _seq(9, 100))
    assert steps == [(0, 64), (0, 36)]


def test_no_bound_keeps_the_token_budget():
    p = _planner(bound_ms=None, budget=64)
    for i in range(2):
        _running(p, _seq(i, 6, out=1))
    assert _prefill_steps(p, _seq(9, 100)) == [(8, 56), (8, 44)]


def test_decodes_past_the_bound_still_let_a_page_through():
    p = _planner(bound_ms=2.5, factor=1.0)  # 2 + 0.5 x 2 = 3 ms for the two anchors alone
    for i in range(2):
        _running(p, _seq(i, 6, out=1))
    allowances = []
    assert {n for _, n in _prefill_steps(p, _seq(9, 20), allowances)} == {PAGE}
    assert set(allowances) == {0}  # and no draft beside it


def test_decodes_near_the_bound_leave_prompts_their_factor_of_the_step():
    """The two anchors alone cost 3 ms, past the 2.5 ms bound: at factor 2 a step may take 6 ms,
    so 2 + 0.5 (2 + n) <= 6 -> n <= 6 prompt tokens a step, not a page; at factor 3, n <= 12."""
    for factor, chunks in ((2.0, [6, 6, 6, 6, 6, 6, 4]), (3.0, [12, 12, 12, 4])):
        p = _planner(bound_ms=2.5, factor=factor)
        for i in range(2):
            _running(p, _seq(i, 6, out=1))
        assert [n for _, n in _prefill_steps(p, _seq(9, 40))] == chunks
    # where the bound is the larger, it governs as before
    p = _planner(bound_ms=20.2, factor=2.0)
    for i in range(2):
        _running(p, _seq(i, 6, out=1))
    assert _prefill_steps(p, _seq(9, 40))[0] == (8, 34)


def test_the_cap_follows_a_measured_cost_model():
    """A piecewise-linear CostModel (as the engine profiles it): the largest chunk under the bound."""
    cost = CostModel([1, 16, 64, 256], [0.010, 0.012, 0.020, 0.060], frozen=True)
    p = _planner(bound_ms=30.0, cost=cost)
    _running(p, _seq(0, 6, out=1))
    cap = p.prefill_cap(4)
    assert cost(4 + cap) <= 0.030 < cost(4 + cap + 1)


def test_steps_with_prompt_tokens_that_run_slower_than_priced_shrink_the_cap():
    """Prompt rows take a path the start-up profile does not time: the steps that carry them and
    run twice as long as the cost model says scale its price, so the chunks shrink until the
    measured step fits the bound again; steps on time leave the cap as it was."""
    p = _planner(bound_ms=40.2)
    for i in range(2):
        _running(p, _seq(i, 6, out=1))
    assert p.prefill_cap(8) == 68  # 2 + 0.5 (8 + n) <= 40.2
    for _ in range(5):
        p.observe_prefill_step(40, ms_per_token(40))
    assert p.prefill_cap(8) == 68
    for _ in range(100):
        p.observe_prefill_step(40, 2 * ms_per_token(40))
    assert p.prefill_scale == pytest.approx(2.0, rel=1e-3)
    assert p.prefill_cap(8) == 28  # 2 x (2 + 0.5 (8 + n)) <= 40.2
    p.observe_prefill_step(40, 50 * ms_per_token(40))  # one step the machine stalled moves it little
    assert p.prefill_scale <= 2.0


def test_engine_reports_each_step_with_prompt_tokens_beside_decodes(folders, monkeypatch):
    """The engine reports to the planner every step that ran prompt tokens beside decoding
    requests, with all the tokens its pass ran, and no other step."""
    observed, mixed = [], []
    real_observe, real_plan = BatchPlanner.observe_prefill_step, BatchPlanner.plan

    def plan(self):
        decode, prefill = real_plan(self)
        if decode and prefill:
            mixed.append(len(decode) + sum(n for _, n in prefill))
        return decode, prefill

    monkeypatch.setattr(BatchPlanner, "plan", plan)
    monkeypatch.setattr(BatchPlanner, "observe_prefill_step",
                        lambda self, n, s: (observed.append(n), real_observe(self, n, s)))
    prompts = alphabet_prompts([20, 90], seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    engine = make_engine(folders["target"], "none", max_decode_stall_ms=1e-3, page_size=PAGE)
    assert not engine.cost.frozen  # a measured profile (a hand-given one is not scaled)
    engine.add_request("a", prompts[0], dataclasses.replace(sp))
    engine.step()
    engine.add_request("b", prompts[1], dataclasses.replace(sp))
    while engine.has_unfinished():
        engine.step()
    assert len(mixed) > 1 and observed == mixed  # the tiny bound lets a page of the prompt in a step
    assert engine.planner.prefill_scale != 1.0


@pytest.mark.usefixtures("single_thread")
def test_decodes_are_priced_at_what_their_target_pass_may_run(folders, monkeypatch):
    """The token budget and the stall bound price a drafting request at its anchor plus the
    chain it may verify (no deeper than the controller's width cap), not at the block pass's
    slots in the drafter's own cache: every step's target pass runs no more decode tokens than
    priced, and drafting steps are priced below what they reserve. Outputs are plain decoding's."""
    pytest.importorskip("transformers")
    cost = CostModel([1, 64], [1.0, 1.6], frozen=True)  # cheap rows: the drafter drafts
    monkeypatch.setattr("dspark.engine.profile.load_or_measure", lambda engine: cost)
    engine = make_engine(folders["target"], folders["dspark"], policy="load-aware", max_decode_stall_ms=2000.0)
    steps, plan, forward = [], engine.planner.plan, engine.runner.forward

    def spied_plan():
        decode, prefill = plan()
        steps.append({"priced": sum(engine.spec.priced_tokens_for(s) for s in decode),
                      "reserved": sum(engine.spec.max_tokens_for(s) for s in decode),
                      "ids": {s.seq_id for s in decode}})
        return decode, prefill

    def spied_forward(items, *args, **kwargs):
        steps[-1]["ran"] = sum(len(t) for s, t in items if s.seq_id in steps[-1]["ids"])
        return forward(items, *args, **kwargs)

    monkeypatch.setattr(engine.planner, "plan", spied_plan)
    monkeypatch.setattr(engine.runner, "forward", spied_forward)
    prompts = alphabet_prompts([15, 20, 31], seed=6)
    sp = SamplingParams(temperature=0.0, max_tokens=30)
    requests = [(p, sp, None) for p in prompts]
    plain = [o.token_ids for o in run_requests(make_engine(folders["target"], "none"), requests)]
    outs = run_requests(engine, requests)
    assert [o.token_ids for o in outs] == plain
    decoding = [st for st in steps if st["ids"]]
    assert all(st["ran"] <= st["priced"] <= st["reserved"] for st in decoding)
    assert any(st["priced"] < st["reserved"] for st in decoding) and engine.spec_stats.accepted > 0


def test_a_bound_needs_a_cost_model():
    with pytest.raises(ValueError, match="cost model"):
        _planner(bound_ms=20.0, cost=None)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "20"])
def test_bad_bounds_are_refused(value):
    with pytest.raises(ValueError, match="max_decode_stall_ms"):
        EngineConfig(max_decode_stall_ms=value).validate()


@pytest.mark.parametrize("value", [0.5, -2.0, float("nan"), float("inf"), True, "2"])
def test_bad_factors_are_refused(value):
    with pytest.raises(ValueError, match="decode_stall_factor"):
        EngineConfig(decode_stall_factor=value).validate()


def test_cli_flag():
    from dspark.cli import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).max_decode_stall_ms is None
    assert engine_config(p.parse_args(["--max-decode-stall-ms", "25"])).max_decode_stall_ms == 25.0
    config = engine_config(p.parse_args(["--max-decode-stall-ms", "None", "--decode-stall-factor", "3"]))
    assert (config.max_decode_stall_ms, config.decode_stall_factor) == (None, 3.0)
    assert engine_config(p.parse_args([])).decode_stall_factor == 2.0


def test_serve_bounds_stalls_by_default(capsys):
    """`dspark serve` bounds a step's stall by default (a server's prompts arrive beside decoding
    requests); 'none' turns the bound off; a value that is neither a number nor 'none' is refused."""
    from dspark.cli import add_engine_args, engine_config
    from dspark.config import SERVE_DECODE_STALL_MS
    from dspark.server.cli import add_serve_parser

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers(), add_engine_args)
    assert engine_config(p.parse_args(["serve"])).max_decode_stall_ms == SERVE_DECODE_STALL_MS
    assert engine_config(p.parse_args(["serve", "--max-decode-stall-ms", "none"])).max_decode_stall_ms is None
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--max-decode-stall-ms", "soon"])
    assert "expected milliseconds or 'none'" in capsys.readouterr().err


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("drafter,bound_ms", [("none", 30.0), ("dspark", 40.0)])
def test_sliced_prefill_keeps_outputs(folders, monkeypatch, drafter, bound_ms):
    """Greedy, tiny model: a 150-token prompt arrives while two requests decode; under the bound
    (a fake cost of 1 ms per token) every step's pass, drafts included, stays within it and the
    prompt goes in slices; all outputs equal those of an unbounded run."""
    pytest.importorskip("transformers")
    cost = CostModel([1, 256], [0.001, 0.256], frozen=True)  # n tokens: n ms
    monkeypatch.setattr("dspark.engine.profile.load_or_measure", lambda engine: cost)
    prompts = alphabet_prompts([20, 25, 150], seed=21)
    sp = SamplingParams(temperature=0.0, max_tokens=30)
    name = folders[drafter] if drafter != "none" else "none"
    runs = []
    for bound in (None, bound_ms):
        engine = make_engine(folders["target"], name, max_decode_stall_ms=bound, ngram_assist=0)
        assert (engine.cost is cost) == (bound is not None)
        plan, forward, steps = engine.planner.plan, engine.runner.forward, []

        def spied(plan=plan, engine=engine, steps=steps):
            decode, prefill = plan()
            steps.append([len(decode), sum(n for _, n in prefill), None, engine.planner.draft_allowance, None])
            return decode, prefill

        def ran(items, *args, forward=forward, engine=engine, steps=steps, **kwargs):
            steps[-1][2] = sum(len(t) for _, t in items)  # the pass's tokens, drafts included
            steps[-1][4] = engine.spec.passed
            return forward(items, *args, **kwargs)

        monkeypatch.setattr(engine.planner, "plan", spied)
        monkeypatch.setattr(engine.runner, "forward", ran)
        for i, p in enumerate(prompts[:2]):
            engine.add_request(f"r{i}", p, dataclasses.replace(sp))
        done, k = {}, 0
        while engine.has_unfinished() or k == 0:
            if k == 3:
                engine.add_request("long", prompts[2], dataclasses.replace(sp))
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
            k += 1
        runs.append(([done["r0"], done["r1"], done["long"]], steps))
    (plain, unbounded), (outs, bounded) = runs
    assert outs == plain
    beside = [st for st in bounded if st[0] and st[1]]  # steps that prefill beside decodes
    assert len(beside) >= 4 and all(cost(tokens) <= bound_ms / 1000 for _, _, tokens, _, _ in beside)
    assert all(allowance is not None for *_, allowance, _ in beside)
    assert not any(passed for *_, allowance, passed in beside if allowance == 0)  # no drafter pass for nothing
    assert max(st[1] for st in unbounded if st[0]) >= 140  # unbounded: the prompt in one step
