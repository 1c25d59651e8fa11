"""A step that drafts nothing costs what a step without a drafter costs, and drafting resumed after
a pause reads a complete context.

While the verify-length controller pauses drafting, a step runs no drafter pass, writes nothing
into the drafter's context, reserves and is charged one slot per decoding request (the token
budget and pages go to prefill as under `--drafter none`), and looks no chain up that the policy
would not verify. Its target pass still captures the drafter's feature rows, which wait and
enter the drafter's cache in one batched write when the pause ends (measured in
dspark/engine/drafter_context.py: capturing costs far less than recomputing them). Requests
that never draft keep no context, and a pass with only such requests captures nothing.
Pauses are forced by setting the controller's skip_steps; outputs are greedy and equal plain
decoding's.
"""

from __future__ import annotations

import dataclasses

import pytest
from spec_helpers import alphabet_prompts, make_engine, run_requests
from test_spec_cache import check_caches

from dspark.config import SamplingParams
from dspark.engine.policy import CostModel

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def fresh(folders):
    return make_engine(folders["target"], "none")


def _spy(monkeypatch, obj, name: str, calls: list) -> None:
    """Record each call of obj.name (its arguments) in calls, then make it."""
    real = getattr(obj, name)

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, spy)


def _pause(engine, steps: int) -> None:
    """Pause drafting for `steps` steps, with no back-off extending the pause."""
    c = engine.spec.controller
    c.skip_steps, c.backoff = steps, c.MAX_BACKOFF


def _plain(folders, prompts, sp=GREEDY) -> list[list[int]]:
    outs = run_requests(make_engine(folders["target"], "none"), [(p, sp, None) for p in prompts])
    return [o.token_ids for o in outs]


def _run(engine, prompts, sp, arrive=None, each_step=None) -> list[list[int]]:
    """Greedy token ids per prompt; arrive[i]: the step request i is added at (default 0);
    each_step(i) runs before step i."""
    arrive = arrive or [0] * len(prompts)
    done, step = {}, 0
    while len(done) < len(prompts):
        for i, (p, at) in enumerate(zip(prompts, arrive)):
            if at == step:
                engine.add_request(f"p{i}", p, dataclasses.replace(sp))
        if each_step is not None:
            each_step(step)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        step += 1
        assert step < 2000
    return [done[f"p{i}"] for i in range(len(prompts))]


def test_paused_steps_run_no_drafter_work(folders, fresh, monkeypatch):
    """Paused steps: no drafter forward, no context write, one-token chains, one slot charged per
    decoding request (a prompt arriving meanwhile gets the rest of the budget, as without a
    drafter; the pause does not count down while it prefills); the pause's last step writes
    every queued row in one call, and the next step
    drafts from a context equal to a fresh computation."""
    budget, pause = 64, 6
    engine = make_engine(folders["target"], folders["dspark"], ngram_assist=0, max_num_batched_tokens=budget)
    drafter, forwards, writes, passes = engine.spec.proposer.drafter, [], [], []
    _spy(monkeypatch, drafter, "block_hidden", forwards)
    _spy(monkeypatch, drafter, "write_context", writes)
    _spy(monkeypatch, engine.runner, "forward", passes)
    sp = dataclasses.replace(GREEDY, max_tokens=60)
    prompts = alphabet_prompts([20, 25, 30, 150], seed=12)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"p{i}", p, dataclasses.replace(sp))
    while any(s.in_prefill for s in engine.running) or engine.waiting:
        engine.step()
    engine.step()
    assert forwards  # drafting ran before the pause
    _pause(engine, pause)
    engine.add_request("p3", prompts[3], dataclasses.replace(sp))  # prefills during the pause
    queued, left, steps = 0, len(prompts[3]), 0
    while True:  # the pause counts down on the steps without a prompt to prefill (p3's do not)
        steps += 1
        forwards.clear(), writes.clear(), passes.clear()
        decoding = [s for s in engine.running if not s.in_prefill]
        engine.step()
        (items, _), kwargs = passes[0]
        assert not forwards
        assert [len(t) for s, t in items if s in decoding] == [1] * len(decoding)  # anchors only
        chunk = sum(len(t) for s, t in items if s not in decoding)
        assert chunk == min(budget - len(decoding), left)  # one slot charged per decoding request
        left -= chunk
        # the features are captured and queued for the catch-up, not written
        assert kwargs["capture"] == engine.spec.capture_layers
        queued += sum(len(t) for _, t in items)
        if engine.spec.controller.skip_steps == 0:
            break
        assert not writes and engine.spec.proposer.context.pending_rows == queued
    assert left == 0 and steps == pause + -(-len(prompts[3]) // (budget - 3))
    assert len(writes) == 1 and writes[0][0][0].shape[0] == queued  # the catch-up: one batched write
    assert not engine.spec.proposer.context.pending

    block_pass, read = engine.spec.proposer._block_pass, []

    def checked(seqs, length):
        for s in seqs:
            check_caches(engine, fresh, s)
        read.append(len(seqs))
        return block_pass(seqs, length)

    monkeypatch.setattr(engine.spec.proposer, "_block_pass", checked)
    decoding = [s for s in engine.running if not s.in_prefill]
    engine.step()
    assert read == [len(decoding)] == [4]


def test_a_pause_ends_once_the_requests_it_was_decided_on_have_left(folders, monkeypatch):
    """The requests decoding when drafting paused are its evidence: while one of them decodes the
    pause stands; once all have left, a request's new text ends it (where text drafted well would
    pay: hopeful_gain) and drafting resumes, with output equal to plain decoding's."""
    engine = make_engine(folders["target"], folders["dspark"], ngram_assist=0)
    c = engine.spec.controller
    flags, forwards = [], []
    _spy(monkeypatch, c, "paused", flags)
    _spy(monkeypatch, engine.spec.proposer.drafter, "block_hidden", forwards)
    monkeypatch.setattr(c, "hopeful_gain", lambda R, width: 2.0)
    prompts = alphabet_prompts([20, 25, 30], seed=7)
    sp = dataclasses.replace(GREEDY, max_tokens=24)
    _pause(engine, 10**6)
    outs = _run(engine, prompts, sp, arrive=[0, 0, 6])  # p2 joins while p0 and p1 decode
    new_text = [a[3] for a, _ in flags]
    k = new_text.index(True)
    assert not any(new_text[:k]) and k >= 20  # not while p0 or p1 decodes
    assert flags[k][0][2] == 1 and forwards  # p2 alone: drafting resumes
    assert outs == _plain(folders, prompts, sp)


def _spy_plans(monkeypatch, engine) -> list[list[int]]:
    """Per planned step: the slots each decoding request reserved."""
    plan, plans = engine.planner.plan, []

    def spied():
        decode, prefill = plan()
        plans.append([engine.spec.max_tokens_for(s) for s in decode])
        return decode, prefill

    monkeypatch.setattr(engine.planner, "plan", spied)
    return plans


@pytest.mark.parametrize("cost,looks", [(CostModel([1, 64], [1.0, 1.6], frozen=True), True),
                                        (CostModel([1, 2, 256], [1.0, 3.0, 511.0], frozen=True), False)],
                         ids=["cheap", "steep"])
def test_paused_steps_look_up_only_chains_the_policy_verifies(folders, monkeypatch, cost, looks):
    """Under a cheap verification cost a paused step still verifies looked-up chains; where even
    the likeliest looked-up token is not worth its row, it looks nothing up and reserves one slot
    per request. Output is plain decoding's either way."""
    monkeypatch.setattr("dspark.engine.profile.load_or_measure", lambda engine: cost)
    engine = make_engine(folders["target"], folders["dspark"], policy="load-aware")
    spec, lookups, forwards = engine.spec, [], []
    _spy(monkeypatch, spec.assist.lookup, "propose", lookups)
    _spy(monkeypatch, spec.proposer.drafter, "block_hidden", forwards)
    plans = _spy_plans(monkeypatch, engine)
    _pause(engine, 10**6)  # from the first decoding step on
    prompts = alphabet_prompts([15, 20, 31], seed=6)
    outs = _run(engine, prompts, GREEDY)
    assert outs == _plain(folders, prompts)
    assert not forwards and engine.spec_stats.steps > 20
    if looks:
        assert lookups and engine.spec_stats.verified > 0
        assert max(n for plan in plans for n in plan) > 1  # room for the chains
    else:
        assert not lookups and engine.spec_stats.verified == 0
        assert {n for plan in plans for n in plan} == {1}  # as without a drafter


def test_paused_steps_look_nothing_up_while_prompts_wait(folders, monkeypatch):
    """While a prompt waits or prefills, a paused step reserves one slot per decoding request and
    looks no chain up (a looked-up span's reserved slots would slice the prompt thinner under the
    decode-stall bound); the other paused steps still look chains up. Output is plain decoding's."""
    monkeypatch.setattr("dspark.engine.profile.load_or_measure",
                        lambda engine: CostModel([1, 64], [1.0, 1.6], frozen=True))
    engine = make_engine(folders["target"], folders["dspark"], policy="load-aware", max_num_batched_tokens=16)
    spec, lookups, steps = engine.spec, [], []
    _spy(monkeypatch, spec.assist.lookup, "propose", lookups)
    plan = engine.planner.plan

    def spied():
        waiting = bool(engine.planner.waiting) or any(s.in_prefill for s in engine.running)
        decode, prefill = plan()
        steps.append((waiting, [spec.max_tokens_for(s) for s in decode], len(lookups)))
        return decode, prefill

    monkeypatch.setattr(engine.planner, "plan", spied)
    _pause(engine, 10**6)
    prompts = alphabet_prompts([15, 20, 31, 40], seed=6)
    outs = _run(engine, prompts, GREEDY, arrive=[0, 0, 12, 30])
    assert outs == _plain(folders, prompts)
    # a step's lookups happen after its plan: the count at the next plan holds them
    looked = [(w, res, after - before) for (w, res, before), (_, _, after) in zip(steps, steps[1:])]
    waiting = [(res, n) for w, res, n in looked if w and res]
    assert waiting and all(set(res) == {1} and n == 0 for res, n in waiting)
    assert sum(n for w, res, n in looked if not w) > 0  # lookups go on once the prompts are in


def test_a_queue_held_back_by_max_num_seqs_is_no_prompt_waiting(folders):
    """Requests queued behind max_num_seqs slice no prompt until one finishes, so the steps
    meanwhile keep what a step without prompts may do (end a pause, look chains up)."""
    engine = make_engine(folders["target"], folders["dspark"], policy="load-aware", max_num_seqs=2)
    for i, p in enumerate(alphabet_prompts([15, 20, 31], seed=6)):
        engine.add_request(f"r{i}", p, dataclasses.replace(GREEDY, max_tokens=40))
    assert engine.planner.prompts_waiting
    while any(s.in_prefill for s in engine.running) or len(engine.running) < 2:
        engine.step()
    assert engine.planner.waiting and not engine.planner.prompts_waiting
    while engine.has_unfinished():
        engine.step()


def test_requests_that_never_draft_keep_no_context(folders, monkeypatch):
    """A request with speculation off queues no drafter context; a pass holding only such requests
    captures no features. Outputs are plain decoding's."""
    engine = make_engine(folders["target"], folders["dspark"], max_num_batched_tokens=32)
    commits, passes = [], []
    _spy(monkeypatch, engine.spec.proposer, "commit", commits)
    _spy(monkeypatch, engine.runner, "forward", passes)
    prompts = alphabet_prompts([30, 40], seed=8)
    engine.add_request("off", prompts[0], dataclasses.replace(GREEDY), spec=False)
    done = {}
    for _ in range(4):
        engine.step()
    engine.add_request("on", prompts[1], dataclasses.replace(GREEDY))
    while engine.has_unfinished():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    assert [done["off"], done["on"]] == _plain(folders, prompts)
    alone = [{s.request_id for s, _ in items} == {"off"} for (items, _), _ in passes]
    assert [kw["capture"] for _, kw in passes] == [() if a else engine.spec.capture_layers for a in alone]
    assert alone[:4] == [True] * 4 and not all(alone)
    rows = [seq.request_id for (ctx_rows, *_), _ in commits for seq, _, _ in ctx_rows]
    assert rows and set(rows) == {"on"} and engine.spec_stats.accepted > 0


@pytest.mark.parametrize("assist", [0, 2])
def test_drafting_resumed_after_pauses_matches_plain_decoding(folders, fresh, monkeypatch, assist):
    """Pauses of 3 steps every 7 while prompts arrive and prefill in chunks: every drafter pass
    reads a context equal to a fresh computation, drafting resumes after each pause, and the
    output is plain greedy decoding's."""
    engine = make_engine(folders["target"], folders["dspark"], ngram_assist=assist, max_num_batched_tokens=40)
    spec = engine.spec
    block_pass, reads, paused, now = spec.proposer._block_pass, [], set(), [0]

    def checked(seqs, length):
        assert not spec.proposer.context.pending
        for s in seqs:
            check_caches(engine, fresh, s)
        reads.append(now[0])
        return block_pass(seqs, length)

    monkeypatch.setattr(spec.proposer, "_block_pass", checked)

    def each_step(i):
        now[0] = i
        if i % 7 == 3:
            _pause(engine, 3)
        if spec.controller.skip_steps:
            paused.add(i)

    prompts = alphabet_prompts([15, 33, 40, 24], seed=13)
    outs = _run(engine, prompts, GREEDY, arrive=[0, 0, 5, 12], each_step=each_step)
    assert outs == _plain(folders, prompts)
    assert not paused & set(reads) and len(paused) >= 6
    assert sum(i - 1 in paused for i in reads) >= 2  # drafting resumed right after pauses
    assert engine.spec_stats.accepted > 0


def test_deferred_context_counts_live_rows_and_prunes_rows_that_left(folders, fresh, monkeypatch):
    """While drafting pauses, the context keeps count of the queued rows of requests still
    running (what the catch-up will write); a request that finishes drops its rows from that
    count, and a queue past MAX_PENDING_ROWS drops them outright instead of writing the rest.
    The catch-up then writes the live rows alone, times them (seconds per row, which prices the
    next catch-up) and leaves a context equal to a fresh computation."""
    engine = make_engine(folders["target"], folders["dspark"], ngram_assist=0, enable_prefix_caching=False)
    ctx = engine.spec.proposer.context
    writes, done = [], {}

    def step():
        done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)

    _spy(monkeypatch, engine.spec.proposer.drafter, "write_context", writes)
    prompts = alphabet_prompts([150, 20, 25], seed=21)  # p0 leaves the most rows behind
    params = [dataclasses.replace(GREEDY, max_tokens=n) for n in (12, 40, 40)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"p{i}", p, sp)
    _pause(engine, 10**6)  # from the start: the prompts' rows wait too
    step()
    short = next(s for s in engine.running if s.request_id == "p0")
    while not short.is_finished:
        step()
    running = [s for s in engine.running if not s.is_finished]
    live = sum(n for _, entries in ctx.pending for s, _, _, n in entries if s in running)
    assert not writes and ctx.live_rows == live < ctx.pending_rows
    monkeypatch.setattr(ctx, "MAX_PENDING_ROWS", ctx.pending_rows)  # the next step overflows
    step()
    assert not writes and ctx.pending_rows == ctx.live_rows == live + len(running)  # p0's rows pruned
    monkeypatch.setattr(ctx, "TIMED_ROWS", 1)
    engine.spec.controller.skip_steps = 1  # the next step's commit writes the catch-up
    step()
    assert len(writes) == 1 and writes[0][0][0].shape[0] == live + 2 * len(running)
    assert ctx.live_rows == ctx.pending_rows == 0 and ctx.catch_up_seconds() == 0.0 and ctx.seconds_per_row > 0
    for s in running:
        check_caches(engine, fresh, s)
    while engine.has_unfinished():
        step()
    assert [done[f"p{i}"] for i in range(3)] == [_plain(folders, [p], sp)[0] for p, sp in zip(prompts, params)]


def test_a_pause_ends_only_where_the_tokens_left_repay_its_catch_up(folders, monkeypatch):
    """_catch_up_pays: drafting at gain g saves 1 - 1/g of a plain step (the cost model's) per
    token the decoding requests have left (their median); the pause may end where that exceeds
    the catch-up's expected seconds, and always where nothing waits to be written."""
    engine = make_engine(folders["target"], folders["dspark"], ngram_assist=0, policy="load-aware")
    for i, (p, n) in enumerate(zip(alphabet_prompts([20, 25, 30], seed=22), (10, 30, 50))):
        engine.add_request(f"p{i}", p, dataclasses.replace(GREEDY, max_tokens=n))
    while engine.waiting or any(s.in_prefill for s in engine.running):
        engine.step()
    seqs = list(engine.running)
    left = sorted(s.params.max_tokens - len(s.output_ids) for s in seqs)[1]
    saved = 0.5 * left * engine.spec.policy.cost(3)  # at gain 2
    spec = engine.spec
    for seconds, gain, pays in ((0.0, 1.0, True), (0.99 * saved, 2.0, True), (1.01 * saved, 2.0, False),
                                (0.01 * saved, 1.0, False)):
        monkeypatch.setattr(spec.proposer, "catch_up_seconds", lambda s=seconds: s)
        assert spec._catch_up_pays(seqs, gain) is pays, (seconds, gain)
