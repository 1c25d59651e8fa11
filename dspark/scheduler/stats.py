"""What the scheduler reports about its work, free of any metrics library.

The scheduler's worker thread hands a `StepRecord` to its listeners after every engine step
and a `FinishedRequest` when a request ends; the server turns them into Prometheus metrics,
and the scheduler itself into log lines. `RecentWindow` keeps the rolling tau and tokens/s.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from dspark.engine.sequence import SpecStats


@dataclass
class StepRecord:
    """The engine's state right after one step (or after a batch of commands)."""

    time: float
    running: int
    waiting: int
    kv_usage: float  # 0..1
    num_preemptions: int  # engine total so far
    new_tokens: int  # tokens delivered to clients by this step
    # per generated token: (seconds between two deliveries / tokens delivered, token count)
    inter_token: list[tuple[float, int]] = field(default_factory=list)
    prompt_tokens: int = 0  # prompt tokens of the requests whose first token this step delivered
    prefix_queries: int = 0  # engine totals: tokens looked up in the prefix cache, and found there
    prefix_hits: int = 0


@dataclass
class FinishedRequest:
    """One request at its end, with the timings the server saw."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    stats: SpecStats
    ttft: float | None  # seconds from submission to the first token; None if none came
    e2e: float  # seconds from submission to the end
    num_preemptions: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first per second of decoding."""
        if self.ttft is None or self.output_tokens < 2 or self.e2e <= self.ttft:
            return 0.0
        return (self.output_tokens - 1) / (self.e2e - self.ttft)


class StatsListener(Protocol):
    """Receives the worker thread's records; must be cheap and thread-safe."""

    def on_step(self, record: StepRecord) -> None: ...

    def on_finish(self, request: FinishedRequest) -> None: ...

    def on_queue(self, running: int, waiting: int) -> None:
        """Requests arrived or left between steps (the counts as they are now)."""


class RecentWindow:
    """Rolling mean acceptance length (tau) and generated tokens/s over the last `seconds`.

    tau here is committed tokens per target pass of decoding requests (the same quantity as
    each response's `speculation.tau`), summed over the window's steps. When the window holds
    no decoding step, tau keeps its last value (an idle server's drafter did not get worse).
    """

    def __init__(self, seconds: float = 10.0):
        self.seconds = seconds
        self._start = time.perf_counter()
        self._items: collections.deque[tuple[float, int, int, int]] = collections.deque()
        self._lock = threading.Lock()
        self._last_tau = 0.0

    def add(self, now: float, new_tokens: int, spec_steps: int, spec_generated: int) -> None:
        """Record one step: tokens delivered, and decode target passes / tokens they committed."""
        with self._lock:
            self._items.append((now, new_tokens, spec_steps, spec_generated))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._items and self._items[0][0] < now - self.seconds:
            self._items.popleft()

    def tau(self, now: float | None = None) -> float:
        with self._lock:
            self._trim(now or time.perf_counter())
            steps = sum(i[2] for i in self._items)
            if steps:
                self._last_tau = sum(i[3] for i in self._items) / steps
            return self._last_tau

    def tokens_per_s(self, now: float | None = None) -> float:
        now = now or time.perf_counter()
        with self._lock:
            self._trim(now)
            span = min(self.seconds, now - self._start)
            return sum(i[1] for i in self._items) / span if span > 0 else 0.0
