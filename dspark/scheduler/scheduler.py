"""The asyncio front of the engine: a worker thread steps it, requests stream their outputs.

The Engine is not thread-safe, so exactly one worker thread touches it. The event loop
sends it commands (add, abort, stop) through a thread-safe queue; the worker drains the
queue between steps, steps while there is work (continuous batching and chunked prefill
happen inside `Engine.step`), sleeps on the queue when idle, and hands each step's outputs
back to the loop with `call_soon_threadsafe`, where they land in each request's
asyncio.Queue. The loop side keeps admission control: at most max_num_seqs + max_queue
requests in flight (then QueueFullError), none while draining (UnavailableError).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from dspark.config import SamplingParams
from dspark.dist.group import PeerLost
from dspark.engine.engine import Engine
from dspark.engine.sequence import RequestOutput
from dspark.scheduler.errors import ContextLengthError, EngineError, QueueFullError, RequestAborted, UnavailableError
from dspark.scheduler.stats import FinishedRequest, RecentWindow, StatsListener, StepRecord

logger = logging.getLogger("dspark.scheduler")

__all__ = ["AsyncEngine", "ContextLengthError", "EngineError", "QueueFullError", "RequestAborted",
           "RequestStream", "UnavailableError"]


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    max_tokens: int | None
    spec: bool
    block_size: int | None
    arrival: float
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Track:
    arrival: float
    first: float | None = None
    last: float | None = None


class RequestStream:
    """One request's RequestOutputs, in order, as an async iterator; ends after the final one."""

    def __init__(self, scheduler: AsyncEngine, request_id: str):
        self.request_id = request_id
        self.prompt_tokens = 0
        self.finished = False
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.prefilled = asyncio.Event()  # set once its prompt is in the cache (first token) or it ended
        self._scheduler = scheduler

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    async def result(self) -> RequestOutput:
        """Wait for the final output."""
        last = None
        async for out in self:
            last = out
        assert last is not None
        return last

    def abort(self) -> None:
        """Abort the request if it is still running; its pages are freed at once."""
        self._scheduler.abort(self.request_id)


class AsyncEngine:
    """Owns an Engine and runs it on a dedicated worker thread for an asyncio server."""

    def __init__(self, engine: Engine, max_queue: int = 256, listeners: Iterable[StatsListener] = (),
                 log_interval: float = 5.0, window_s: float = 10.0):
        self.engine = engine
        self.max_queue = max_queue
        self.capacity = engine.config.max_num_seqs + max_queue
        self.listeners = list(listeners)
        self.log_interval = log_interval
        self.window = RecentWindow(window_s)
        self.accepting = False
        self._streams: dict[str, RequestStream] = {}
        self._cmds: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # worker-thread state
        self._track: dict[str, _Track] = {}
        self._dirty = False
        self._seen = (engine.spec_stats.steps, engine.spec_stats.generated)
        self._last_log = time.perf_counter()
        self._busy = False
        self.fatal: str | None = None  # why the engine can no longer run (the server then exits)

    # ------------------------------------------------------------- event loop side
    def start(self) -> None:
        """Start the worker thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()
        self.accepting = True

    @property
    def num_active(self) -> int:
        """Requests admitted and not yet finished or aborted."""
        return len(self._streams)

    async def add(self, request_id: str, prompt: str | list[int] | list[dict], params: SamplingParams,
                  max_tokens: int | None = None, spec: bool = True,
                  block_size: int | None = None) -> RequestStream:
        """Admit a request. max_tokens None: up to the context. Raises QueueFullError,
        UnavailableError, or ValueError (ContextLengthError) for an invalid request."""
        if not self.accepting:
            raise UnavailableError("the server is not accepting requests (starting or shutting down)")
        if len(self._streams) >= self.capacity:
            raise QueueFullError(f"too many requests in flight ({len(self._streams)}); retry later")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream(self, request_id)
        # a copy: the worker sets its max_tokens, and the caller may share one object between requests
        cmd = _Add(request_id, prompt, replace(params), max_tokens, spec, block_size,
                   time.perf_counter())
        self._cmds.put(("add", cmd))
        try:
            stream.prompt_tokens = await asyncio.wrap_future(cmd.future)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str, reason: str = "the request was aborted") -> None:
        """Abort a request still in flight: its stream raises RequestAborted, its pages are freed."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream.queue.put_nowait(RequestAborted(reason))
            stream.prefilled.set()
            self._cmds.put(("abort", request_id))

    async def drain(self, timeout: float) -> None:
        """Stop admitting, let requests in flight finish for up to `timeout` s, abort the rest."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.warning("shutdown timeout: aborting %d unfinished request(s)", len(self._streams))
        for rid in list(self._streams):
            self.abort(rid, "the server is shutting down")

    async def stop(self) -> None:
        """Abort everything still running and stop the worker thread."""
        self.accepting = False
        for rid in list(self._streams):
            self.abort(rid, "the server is shutting down")
        if self._thread is not None and self._thread.is_alive():
            self._cmds.put(("stop", None))
            await asyncio.to_thread(self._thread.join, 30.0)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.queue.put_nowait(out)
            if out.token_ids or out.finished:
                stream.prefilled.set()
            if out.finished:
                del self._streams[out.request_id]

    def _abort_all(self, reason: str) -> None:
        for rid in list(self._streams):
            self.abort(rid, reason)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.queue.put_nowait(EngineError(f"engine failure: {type(exc).__name__}: {exc}"))
                stream.prefilled.set()

    # ----------------------------------------------------------------- worker thread
    def _run(self) -> None:
        eng, stopping = self.engine, False
        while not stopping:
            cmds = []
            try:
                if not (eng.has_unfinished() or self._dirty):
                    cmds.append(self._cmds.get(timeout=1.0))
                while True:
                    cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                pass
            for kind, arg in cmds:
                if kind == "add":
                    self._do_add(arg)
                elif kind == "abort":
                    self._dirty |= eng.abort(arg)
                else:
                    stopping = True
            if stopping:
                for rid in list(eng.seqs):
                    self._dirty |= eng.abort(rid)
            if cmds:
                self._queue_changed()
            if eng.has_unfinished() or self._dirty:
                self._dirty = False
                try:
                    outs = eng.step()
                except PeerLost as e:  # a tensor-parallel rank died: nothing can run any more
                    logger.error("engine lost: %s; failing %d request(s) and stopping", e, len(self._streams))
                    self.fatal = str(e)
                    self.accepting = False
                    self._loop.call_soon_threadsafe(self._abort_all, f"the engine stopped: {e}")
                    return
                except Exception as e:  # keep serving: fail what was running, free its pages
                    logger.exception("engine step failed; aborting %d request(s)", len(eng.seqs))
                    self._recover(e)
                    continue
                self._dispatch(outs)
                if not outs:
                    time.sleep(0.005)  # nothing schedulable this step; do not spin
            self._maybe_log()

    def _queue_changed(self) -> None:
        """The gauges follow arrivals and aborts at once, not at the next step (which may be seconds
        away under load, or never for a request aborted while it waited)."""
        running, waiting = len(self.engine.running), len(self.engine.waiting)
        for listener in self.listeners:
            try:
                listener.on_queue(running, waiting)
            except Exception:
                logger.exception("stats listener failed")

    def _do_add(self, cmd: _Add) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        eng = self.engine
        try:
            ids = eng.prompt_ids(cmd.prompt, cmd.params)  # sized and checked as the engine will run it
            n, limit = len(ids), eng.max_model_len
            cmd.params.max_tokens = cmd.max_tokens if cmd.max_tokens is not None else max(1, limit - n)
            if 0 < n < limit and n + cmd.params.max_tokens > limit:
                raise ContextLengthError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{n + cmd.params.max_tokens} tokens ({n} in the prompt, {cmd.params.max_tokens} for "
                    "the completion). Please reduce the prompt or max_tokens.")
            eng.add_request(cmd.request_id, ids, cmd.params, spec=cmd.spec, block_size=cmd.block_size)
        except Exception as e:
            cmd.future.set_exception(e)
            return
        self._track[cmd.request_id] = _Track(cmd.arrival)
        cmd.future.set_result(n)

    def _recover(self, exc: Exception) -> None:
        # only the batch that ran can hold half-committed state; waiting (and preempted) requests
        # own no pages and start from their tokens, so they stay queued
        failed = [s.request_id for s in self.engine.running]
        self._loop.call_soon_threadsafe(self._fail, failed, exc)
        for rid in failed:
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
        try:
            outs = self.engine.step()  # drain the aborted outputs
        except Exception:
            logger.exception("engine drain failed")
            outs = []
        self._dispatch(outs)
        for rid in failed:
            self._track.pop(rid, None)

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        eng, now = self.engine, time.perf_counter()
        new_tokens, prompt_tokens, inter, finished = 0, 0, [], []
        for out in outs:
            tr = self._track.get(out.request_id)
            if tr is None:
                continue
            n = len(out.new_token_ids)
            if n:
                new_tokens += n
                if tr.first is None:
                    tr.first = now
                    prompt_tokens += len(out.prompt_token_ids)
                else:
                    inter.append(((now - tr.last) / n, n))
                tr.last = now
            if out.finished:
                del self._track[out.request_id]
                finished.append(FinishedRequest(
                    out.request_id, len(out.prompt_token_ids), len(out.token_ids), out.finish_reason or "abort",
                    out.stats, tr.first - tr.arrival if tr.first is not None else None, now - tr.arrival,
                    out.num_preemptions))
        st = eng.spec_stats
        self.window.add(now, new_tokens, st.steps - self._seen[0], st.generated - self._seen[1])
        self._seen = (st.steps, st.generated)
        self._busy = True
        record = StepRecord(now, len(eng.running), len(eng.waiting), eng.pool.usage(), eng.num_preemptions,
                            new_tokens, inter, prompt_tokens, eng.pool.prefix_queries, eng.pool.prefix_hits)
        for listener in self.listeners:
            try:
                listener.on_step(record)
                for fr in finished:
                    listener.on_finish(fr)
            except Exception:
                logger.exception("stats listener failed")
        for fr in finished:
            logger.info("request %s finished (%s): %d prompt + %d output tokens, tau %.2f, TTFT %s, "
                        "%.1f tok/s, %.2f s", fr.request_id, fr.finish_reason, fr.prompt_tokens,
                        fr.output_tokens, fr.stats.tau, "-" if fr.ttft is None else f"{fr.ttft * 1000:.0f} ms",
                        fr.decode_tokens_per_s, fr.e2e)
        if outs:
            self._loop.call_soon_threadsafe(self._deliver, outs)

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        if now - self._last_log < self.log_interval:
            return
        eng = self.engine
        if self._busy or eng.has_unfinished():
            logger.info("engine: %d running, %d waiting, KV cache %.1f%%, tau %.2f, generation %.1f tok/s, "
                        "%d preemptions", len(eng.running), len(eng.waiting), eng.pool.usage() * 100,
                        self.window.tau(now), self.window.tokens_per_s(now), eng.num_preemptions)
        self._busy = False
        self._last_log = now
