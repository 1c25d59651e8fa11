"""Send a list of requests at a fixed concurrency, or at a Poisson rate with a concurrency cap."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable

from dspark.bench.client import RequestResult


def arrival_gaps(num: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before each of ``num`` requests: exponential gaps (a Poisson process of
    ``rate`` requests/s), or all zero when ``rate`` is infinite (everything at once)."""
    if rate <= 0:
        raise ValueError(f"the request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(num - 1)] if num else []


async def run_load(send: Callable[[int], Awaitable[RequestResult]], num: int, concurrency: int | None,
                   rate: float = math.inf, seed: int = 0) -> tuple[list[RequestResult], float]:
    """Call ``send(i)`` for i in range(num), at most ``concurrency`` at a time (None: no cap), issued at
    ``rate`` requests/s; returns the results in request order and the wall duration in seconds."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"the concurrency must be >= 1, got {concurrency}")
    limit = asyncio.Semaphore(concurrency if concurrency is not None else max(num, 1))
    gaps = arrival_gaps(num, rate, seed)

    async def one(i: int) -> RequestResult:
        async with limit:
            return await send(i)

    start = time.perf_counter()
    tasks = []
    for i, gap in enumerate(gaps):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(i)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start
