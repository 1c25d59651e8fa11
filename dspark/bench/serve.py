"""`dspark bench serve`: drive a running OpenAI-compatible server over HTTP and report what
``vllm bench serve`` reports, for one or several load levels (concurrencies or request rates).

Each load level sends ``num_prompts`` streaming requests; the server's speculative-decoding
counters are scraped from ``/metrics`` just before and just after, so tau covers exactly that
level's requests (assuming nothing else uses the server meanwhile). Each level takes the next
``num_prompts`` prompts of the file (wrapping around when it has too few), so a server's prompt
cache never answers a level's prefills from an earlier level's identical requests; prefixes that
prompts really share (a chat template's system prompt) still count.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import math
import sys
from typing import Any

import httpx

from dspark.bench.client import CHAT, RequestResult, request_body, send_request
from dspark.bench.load import run_load
from dspark.bench.server_metrics import scrape_counters, spec_delta
from dspark.bench.summary import summarize_run


@dataclasses.dataclass
class ServeBenchConfig:
    """Everything one `dspark bench serve` call measures.

    concurrencies: one run per entry (None: no cap); rates: requests/s (math.inf: all at once).
    The runs are every (concurrency, rate) pair, concurrencies outermost. prompts: the pool the
    levels draw from, num_prompts (default: all of them) per level, level k from prompt
    k * num_prompts on; same_prompts: every level sends the first num_prompts. first_level: the
    first run sends level first_level's prompts (one call per level, as several servers measured
    in alternation are, sends what one call over every level would).
    """

    base_url: str
    prompts: list[str]
    concurrencies: list[int | None]
    num_prompts: int | None = None
    same_prompts: bool = False
    first_level: int = 0
    rates: list[float] = dataclasses.field(default_factory=lambda: [math.inf])
    endpoint: str = CHAT
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    warmup: int = 1
    model: str | None = None
    api_key: str | None = None
    timeout: float = 600.0
    seed: int = 0
    label: str | None = None
    prompt_order: str = "file"  # how prompts was drawn from its file (the report says so)

    @property
    def per_level(self) -> int:
        return self.num_prompts or len(self.prompts)

    def level_prompts(self, level: int) -> list[str]:
        """The prompts load level ``level`` (0, 1, ...) sends."""
        start = 0 if self.same_prompts else (self.first_level + level) * self.per_level
        return [self.prompts[(start + i) % len(self.prompts)] for i in range(self.per_level)]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def _server_info(client: httpx.AsyncClient, cfg: ServeBenchConfig) -> dict[str, Any]:
    """The served model (the first of /v1/models unless cfg.model is set) and its speculation settings."""
    url = cfg.base_url + "/v1/models"
    try:
        resp = await client.get(url, headers=cfg.headers)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {cfg.base_url}: {type(e).__name__}: {e}") from None
    if resp.status_code != 200:
        raise ValueError(f"GET {url} answered {resp.status_code}: {resp.text[:300]}")
    models = resp.json().get("data") or []
    if cfg.model is None:
        chosen = models[0] if models else {}
    else:  # a name the server does not list still gets sent (its requests then fail and are counted)
        chosen = next((m for m in models if m.get("id") == cfg.model), {})
    return {"model": cfg.model or chosen.get("id"), "speculation": chosen.get("speculation"),
            "max_model_len": chosen.get("max_model_len")}


def default_label(info: dict[str, Any]) -> str:
    """A run's name when --label is not given: the drafter and policy the server reports, or the model."""
    spec = info.get("speculation") or {}
    if spec.get("drafter"):
        return "/".join(str(spec[k]) for k in ("drafter", "policy") if spec.get(k))
    return str(info.get("model") or "server")


async def _run_level(client: httpx.AsyncClient, cfg: ServeBenchConfig, model: str | None,
                     concurrency: int | None, rate: float, level: int) -> dict[str, Any]:
    url = cfg.base_url + cfg.endpoint
    prompts = cfg.level_prompts(level)

    async def send(i: int) -> RequestResult:
        body = request_body(cfg.endpoint, model, prompts[i], cfg.max_tokens, cfg.temperature, cfg.ignore_eos)
        return await send_request(client, url, body, cfg.headers, cfg.timeout)

    before = await scrape_counters(client, cfg.base_url)
    results, duration = await run_load(send, len(prompts), concurrency, rate, cfg.seed)
    after = await scrape_counters(client, cfg.base_url)
    run: dict[str, Any] = {"concurrency": concurrency, "request_rate": None if math.isinf(rate) else rate,
                           "num_prompts": len(results)}
    run.update(summarize_run(results, duration))
    run.update(spec_delta(before, after))
    return run


async def _warm_up(client: httpx.AsyncClient, cfg: ServeBenchConfig, model: str | None) -> None:
    """Send cfg.warmup requests at once (not measured); fail early when the server cannot answer them.
    They take the pool's last prompts, which the levels reach last if at all."""
    url = cfg.base_url + cfg.endpoint
    bodies = [request_body(cfg.endpoint, model, cfg.prompts[-1 - i % len(cfg.prompts)], cfg.max_tokens,
                           cfg.temperature, cfg.ignore_eos) for i in range(cfg.warmup)]
    results = await asyncio.gather(*(send_request(client, url, b, cfg.headers, cfg.timeout) for b in bodies))
    failed = [r.error for r in results if not r.success]
    if failed:
        raise ValueError(f"{len(failed)} of {len(results)} warm-up request(s) failed: {failed[0]}")


async def run_serve_bench_async(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Warm up, then measure every load level; returns the JSON-able report."""
    if not cfg.prompts:
        raise ValueError("no prompts to send")
    widest = max((c or cfg.per_level for c in cfg.concurrencies), default=1)
    limits = httpx.Limits(max_connections=max(widest, cfg.warmup) + 4, max_keepalive_connections=widest + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout, connect=30.0), limits=limits) as client:
        info = await _server_info(client, cfg)
        if cfg.warmup > 0:
            print(f"[bench serve] warming up with {cfg.warmup} request(s) ...", file=sys.stderr, flush=True)
            await _warm_up(client, cfg, info["model"])
        runs = []
        for concurrency in cfg.concurrencies:
            for rate in cfg.rates:
                print(f"[bench serve] {cfg.per_level} requests, concurrency {concurrency or 'unbounded'}, "
                      f"rate {rate} req/s ...", file=sys.stderr, flush=True)
                runs.append(await _run_level(client, cfg, info["model"], concurrency, rate, len(runs)))
    date = datetime.datetime.now().isoformat(timespec="seconds")
    return {"mode": "serve", "label": cfg.label or default_label(info), "date": date,
            "base_url": cfg.base_url, "endpoint": cfg.endpoint, **info, "num_prompts": cfg.per_level,
            "prompts_per_level": "same" if cfg.same_prompts else "distinct", "prompt_pool": len(cfg.prompts),
            "first_level": cfg.first_level,
            "prompt_order": cfg.prompt_order,
            "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos,
            "warmup": cfg.warmup, "seed": cfg.seed, "runs": runs}


def run_serve_bench(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Synchronous wrapper of :func:`run_serve_bench_async` (runs its own event loop)."""
    return asyncio.run(run_serve_bench_async(cfg))
