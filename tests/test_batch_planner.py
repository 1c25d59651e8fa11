"""The batch planner without a model: decoding requests reserve their anchor and drafts, fall back
to a plain step when free pages cannot hold the drafts, the newest request is preempted when even
that does not fit, and prefill chunks fill the token budget without taking the pages the decoding
requests need next step."""

from __future__ import annotations

from dspark.config import EngineConfig, SamplingParams
from dspark.engine.batch_planner import BatchPlanner
from dspark.engine.kv_cache import PagePool
from dspark.engine.sequence import Sequence, Status

PAGE = 4


class FakeSpec:
    """What the planner asks of speculation: slots a step may write (all of them in its target
    pass), and releases."""

    def __init__(self, drafts: int):
        self.drafts = drafts
        self.released: list[int] = []

    def max_tokens_for(self, seq: Sequence) -> int:
        return 1 + (0 if seq.plain_step else self.drafts)

    def priced_tokens_for(self, seq: Sequence) -> int:
        return self.max_tokens_for(seq)

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


def _seq(i: int, prompt: int, out: int = 0) -> Sequence:
    s = Sequence(seq_id=i, request_id=f"r{i}", prompt_ids=list(range(10, 10 + prompt)),
                 params=SamplingParams(temperature=0.0, max_tokens=64), generator=None, eos_ids=frozenset())
    s.output_ids = list(range(100, 100 + out))
    return s


def _planner(pages: int, drafts: int = 3, budget: int = 64, max_seqs: int = 8) -> BatchPlanner:
    cfg = EngineConfig(page_size=PAGE, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return BatchPlanner(cfg, PagePool(pages, PAGE), FakeSpec(drafts))


def _running(planner: BatchPlanner, seq: Sequence) -> None:
    """seq decoding: its prompt and all but its anchor cached."""
    seq.status = Status.RUNNING
    seq.num_cached = seq.prefill_target
    planner.pool.reserve(seq.seq_id, seq.num_cached)
    planner.running.append(seq)


def test_decoding_requests_reserve_anchor_and_drafts_and_prefill_takes_the_rest():
    p = _planner(pages=32, drafts=3, budget=20)
    a = _seq(0, 6, out=1)
    _running(p, a)
    new = _seq(1, 30)
    p.waiting.append(new)
    decode, prefill = p.plan()
    assert decode == [a] and not a.plain_step
    assert p.pool.capacity(a.seq_id) >= a.num_cached + 4  # anchor + 3 drafts
    # the chunk gets the token budget left after the decode's 4 tokens, and the request is admitted
    assert prefill == [(new, 16)] and new.status is Status.RUNNING and new in p.running


def test_drafts_that_do_not_fit_make_a_plain_step_not_a_preemption():
    p = _planner(pages=4, drafts=8)  # 16 slots
    a, b = _seq(0, 6, out=1), _seq(1, 6, out=1)
    _running(p, a)
    _running(p, b)  # 2 pages each: 8 slots left for nobody
    decode, prefill = p.plan()
    assert decode == [a, b] and a.plain_step and b.plain_step and p.num_preemptions == 0 and not prefill


def test_the_newest_request_is_preempted_when_even_a_plain_step_does_not_fit():
    p = _planner(pages=4, drafts=0)
    a, b = _seq(0, 8, out=1), _seq(1, 8, out=1)
    _running(p, a)
    _running(p, b)  # both at 8 cached tokens in 2 full pages each: their anchors need a third
    decode, _ = p.plan()
    assert decode == [a] and p.num_preemptions == 1
    assert b.status is Status.WAITING and b.num_cached == 0 and p.waiting[0] is b
    assert p.spec.released == [b.seq_id] and b.num_preemptions == 1


def test_a_prompt_is_admitted_only_with_room_for_all_of_it():
    p = _planner(pages=6, drafts=0, budget=64)
    a = _seq(0, 3, out=1)
    _running(p, a)
    big = _seq(1, 40)  # needs 10 pages: never fits beside a
    p.waiting.append(big)
    decode, prefill = p.plan()
    assert decode == [a] and prefill == [] and big.status is Status.WAITING and big.num_cached == 0
    assert not p.pool.tables.get(big.seq_id) or not p.pool.tables[big.seq_id].pages  # holds no pages


def test_max_num_seqs_bounds_admission():
    p = _planner(pages=64, drafts=0, budget=256, max_seqs=2)
    waiting = [_seq(i, 5) for i in range(4)]
    p.waiting.extend(waiting)
    _, prefill = p.plan()
    assert [s for s, _ in prefill] == waiting[:2] and len(p.running) == 2 and p.waiting == waiting[2:]
