"""GracefulServer: uvicorn with dspark's SIGTERM handling (imported lazily by `dspark serve`)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Generator
from types import FrameType

import uvicorn

from dspark.server.app import ServerState

logger = logging.getLogger("dspark.server")


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that, on SIGTERM/SIGINT, first stops admitting requests (503), then lets
    uvicorn wait up to timeout_graceful_shutdown for running ones before aborting the rest."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.dspark_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        sched = self.dspark_state.scheduler
        if sched is not None and sched.accepting:
            logger.info("signal %d: no longer admitting requests; finishing %d in flight (timeout %ss)",
                        sig, sched.num_active, self.config.timeout_graceful_shutdown)
            sched.accepting = False
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.dspark_state.load_error is not None or self.dspark_state.fatal:
            return True  # the engine failed to load or died: exit (status 1) rather than answer 503 forever
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # like uvicorn's, but without re-raising the signal afterwards: a drained server exits 0
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)
