"""The drafter's context cache: the target features of every committed position, projected into
the drafter's own paged K/V, with writes deferred while drafting pauses."""

from __future__ import annotations

import time

import torch

from dspark.engine.sequence import Sequence


class DrafterContext:
    """Collects each step's kept feature rows and writes them into the drafter's K/V.

    While drafting is paused nothing reads the drafter's context, so the K/V of the positions
    committed meanwhile wait and go in one batched write once the pause ends: a write of a few
    rows per step costs ~4% of a small CPU step, most of it per-call overhead. Every step that may
    draft next flushes, and a proposer flushes before it reads (a pause may end early), so no
    drafter pass sees a stale context. Under prefix caching prompt positions are written at once
    (add's prompts_now): a prompt page is shared as soon as it is full, and the drafter's context
    at its slots with it.

    The paused steps' target passes still capture the feature rows queued here. Leaving them out
    would make the catch-up a target pass over every skipped position, and a target row costs far
    more than its capture: on SmolLM2-135M (CPU, one thread, 8 decoding requests) capturing adds
    0.2 ms to a 23 ms step and writing a row later ~0.02 ms, while recomputing 4 skipped positions
    per request took 36 ms and 16 took 120 ms (1.5 and 5 steps); under CUDA graphs the capture is
    part of the replayed graph. A request that never drafts (SpecRunner.commit) queues nothing,
    and a pass with no such request captures nothing (SpecRunner.capture_for).

    What the next drafter pass will pay first for the deferred writes (catch_up_seconds) is the
    pending rows of requests still running, priced at the seconds per row that earlier catch-ups
    measured: a pause that ends where too few tokens are left to repay it stays on
    (SpecRunner.begin_step)."""

    MAX_PENDING_ROWS = 8192  # past this, write anyway (bounded memory under a flood of prefills)
    # only writes of at least this many rows time the seconds per row (a few rows' time is the
    # calls' overhead); the EMA weight of each new timing
    TIMED_ROWS, ROW_TIME_EMA = 64, 0.3

    def __init__(self, drafter, kv, pool, device: torch.device, next_ids: bool = False):
        # next_ids: the drafter's K/V at a position also read the token after it (EAGLE-3)
        self.drafter, self.kv, self.pool, self.device, self.next_ids = drafter, kv, pool, device, next_ids
        # one entry per step: (features of its kept rows, and for each request in row order
        # (seq, its preemption count then, first position, rows))
        self.pending: list[tuple[torch.Tensor, list[tuple[Sequence, int, int, int]]]] = []
        self.pending_rows = 0
        self._rows_of: dict[int, int] = {}  # request id -> its pending rows, while it runs (live_rows)
        self.seconds_per_row: float | None = None  # what a catch-up write costs a row (measured)

    def add(self, ctx_rows, feats: torch.Tensor, flush: bool, prompts_now: bool = False) -> None:
        """Queue the kept rows of one step ((seq, first new position, rows) per request) and write
        everything queued when flush (the next step may draft) or when too much waits.
        prompts_now: prompt positions are written at once all the same (under prefix caching a
        prompt page is shared with later requests, and with it the drafter's context there)."""
        rows, entries, now_rows, now = [], [], [], []
        for seq, start, kept in ctx_rows:
            if seq.is_finished or not kept:
                continue
            p = max(0, min(len(kept), len(seq.prompt_ids) - start)) if prompts_now and not flush else 0
            if p > 0:
                now_rows.extend(kept[:p])
                now.append((seq, seq.num_preemptions, start, p))
            if p < len(kept):
                rows.extend(kept[p:])
                entries.append((seq, seq.num_preemptions, start + p, len(kept) - p))
                self._rows_of[seq.seq_id] = self._rows_of.get(seq.seq_id, 0) + len(kept) - p
        if now:
            self._write([(self._rows(feats, now_rows), now)])
        if rows:  # a pass's features are its own (ForwardResult): kept whole, or the kept rows gathered
            self.pending.append((self._rows(feats, rows), entries))
            self.pending_rows += len(rows)
        if flush:
            self.flush()
        elif self.pending_rows > self.MAX_PENDING_ROWS:
            # mostly rows of requests that have left (a long pause under churn): drop those;
            # write only what is still too much
            self._prune()
            if self.pending_rows > self.MAX_PENDING_ROWS // 2:
                self.flush()

    @property
    def prompts_pending(self) -> bool:
        """Whether a pending entry holds prompt positions (never with add's prompts_now)."""
        return any(start < len(seq.prompt_ids) for _, entries in self.pending for seq, _, start, _ in entries)

    def _rows(self, feats: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return feats if rows == list(range(feats.shape[0])) else feats[torch.tensor(rows, device=self.device)]

    @staticmethod
    def _live(steps: list):  # noqa: ANN205 - a generator of add's (features, entries) pairs
        """Queued (features, entries) pairs without the requests that finished or were preempted
        since (their pages are gone, or their new prefill rewrites them); steps left empty go."""
        for f, entries in steps:
            keep, live, at = [], [], 0
            for entry in entries:
                seq, preemptions, _, n = entry
                if not seq.is_finished and seq.num_preemptions == preemptions:
                    keep.extend(range(at, at + n))
                    live.append(entry)
                at += n
            if live:
                yield (f if len(keep) == at else f[torch.tensor(keep, device=f.device)]), live

    def _prune(self) -> None:
        """Drop the pending rows of requests that finished or were preempted since."""
        self.pending = list(self._live(self.pending))
        self.pending_rows = sum(f.shape[0] for f, _ in self.pending)

    @property
    def live_rows(self) -> int:
        """Pending rows of requests that have neither finished nor been preempted since."""
        return sum(self._rows_of.values())

    def release(self, seq_id: int) -> None:
        """seq_id finished or was preempted: its pending rows will not be written (_write)."""
        self._rows_of.pop(seq_id, None)

    def catch_up_seconds(self) -> float:
        """Seconds the next flush is expected to take: the live pending rows at the measured
        seconds per row (0 while nothing is pending or no catch-up has been timed yet)."""
        return self.live_rows * (self.seconds_per_row or 0.0)

    def flush(self) -> None:
        """Write every pending position into the drafter's cache."""
        timed = self.live_rows >= self.TIMED_ROWS
        pending, self.pending, self.pending_rows = self.pending, [], 0
        self._rows_of.clear()
        self._sync(timed)  # a GPU's queued work is not the write's
        t0 = time.perf_counter()
        rows = self._write(pending)
        self._sync(timed)
        if timed and rows:
            per = (time.perf_counter() - t0) / rows
            old = self.seconds_per_row
            self.seconds_per_row = per if old is None else old + self.ROW_TIME_EMA * (per - old)

    def _sync(self, timed: bool) -> None:
        if timed and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _write(self, steps: list) -> int:
        """Write (features, entries) pairs as queued by add, but for requests that have left
        (_live); returns the rows written."""
        feats, slots, positions, after = [], [], [], []
        for f, entries in self._live(steps):
            feats.append(f)
            for seq, _, start, n in entries:
                slots.extend(self.pool.slots(seq.seq_id, start, start + n))
                positions.extend(range(start, start + n))
                if self.next_ids:  # committed by now: the commit appended the step's tokens
                    after.extend(seq.all_ids[start + 1:start + n + 1])
        if feats:
            dev = self.device
            extra = (torch.tensor(after, device=dev),) if self.next_ids else ()
            self.drafter.write_context(feats[0] if len(feats) == 1 else torch.cat(feats),
                                       torch.tensor(positions, device=dev), torch.tensor(slots, device=dev), self.kv,
                                       *extra)
        return len(positions)
