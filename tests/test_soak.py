"""Soak test: a real uvicorn server (the default model, n-gram drafter) takes a few hundred mixed requests
at once: streams and plain JSON, chat and completions (a quarter with logprobs), clients that go away
mid-answer, bad inputs that must get 400, and long prompts whose prefill is chunked. Every good
request must get its whole answer, the server must keep answering, and every KV page must be free
again at the end. Prefix caching is on for the soak: chats share their template's first page and
the long prompts share theirs, so pages are shared, released and evicted under aborts too.

Bounded: 240 requests of at most 6 tokens each (3 long prompts), under a hard time limit: about 40 s
on 2 busy cores."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from server_helpers import error_of, metric, scrape, serve, shared_engine_or_skip, wait_for
from spec_helpers import one_thread

pytestmark = pytest.mark.slow

C, CHAT = "/v1/completions", "/v1/chat/completions"
NUM_REQUESTS = 240
MIX = {"bad": 96, "abort-stream": 20, "abort-plain": 4, "long": 3}  # the rest: good streams and plain answers
KINDS = ("stream", "plain", *MIX)
CONCURRENCY = 24
TIME_LIMIT_S = 150
PROMPTS = ["The capital of France is", "Count: one two three four five, one two three four five, one two",
           "def fib(n):", "A haiku about the sea:", "1, 2, 3, 4, 5, 6,", "Roses are red,"]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens: 3 at once, chunked prefill
BAD: list[tuple[str, Any]] = [
    (C, b"{not json"), (C, {}), (C, {"prompt": "x", "max_tokens": 0}), (C, {"prompt": "x", "temperature": -1}),
    (C, {"prompt": 42}), (C, {"prompt": "x", "n": 0}), (C, {"prompt": "x", "logprobs": 21}),
    (C, {"prompt": "word " * 9000}), (C, {"prompt": "x", "max_tokens": 100_000}),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}), (CHAT, {"messages": []}),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}), (CHAT, {"messages": "hi", "stream": True}),
]


@dataclass
class Job:
    """One request of the mix and what came back."""

    kind: str  # stream | plain | abort-stream | abort-plain | bad | long
    path: str
    body: Any
    status: int | None = None
    problems: list[str] = field(default_factory=list)
    aborted: bool = False
    completion_tokens: int = 0


def _good_body(rng: random.Random, chat: bool, prompt: str, max_tokens: int) -> dict:
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": rng.choice([0, 0, 0.8]),
                            "seed": rng.randint(0, 99)}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if rng.random() < 0.4:
        body["ignore_eos"] = True
    body["speculation"] = rng.choice([{"enabled": False}, {"block_size": 2}, {"block_size": 4}, {}])
    if rng.random() < 0.25:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    return body


def _logprobs_count(job: Job, choices: list[dict]) -> int:
    """Output tokens the logprobs of these choices (one response, or a stream's chunks) cover."""
    key = "content" if job.path == CHAT else "tokens"
    return sum(len(c["logprobs"][key]) for c in choices if c.get("logprobs"))


def _check_logprobs(job: Job, choices: list[dict], usage: dict | None) -> None:
    if job.body.get("logprobs") and usage is not None and _logprobs_count(job, choices) != usage["completion_tokens"]:
        job.problems.append(f"logprobs for {_logprobs_count(job, choices)} of {usage['completion_tokens']} tokens")


def make_jobs(rng: random.Random) -> list[Job]:
    """The mix, shuffled: MIX[kind] requests of each kind, then good ones (60% streamed, 35% chat) up to
    NUM_REQUESTS. Good requests ask for 1-6 tokens, greedy or sampled, some with ignore_eos, some with
    speculation off or a smaller block."""
    kinds = [k for k, n in MIX.items() for _ in range(n)]
    kinds += ["good"] * (NUM_REQUESTS - len(kinds))
    jobs = []
    for kind in kinds:
        chat = rng.random() < 0.35
        path = CHAT if chat else C
        if kind == "bad":
            jobs.append(Job("bad", *rng.choice(BAD)))
        elif kind == "long":
            jobs.append(Job("long", path, {**_good_body(rng, chat, LONG_PROMPT, 4), "stream": rng.random() < 0.5}))
        elif kind.startswith("abort"):
            body = {**_good_body(rng, chat, rng.choice(PROMPTS), 400), "ignore_eos": True}
            jobs.append(Job(kind, path, {**body, "stream": True} if kind == "abort-stream" else body))
        else:
            stream = rng.random() < 0.6
            body = _good_body(rng, chat, rng.choice(PROMPTS), rng.randint(1, 6))
            if stream:
                body.update(stream=True, stream_options={"include_usage": rng.random() < 0.8})
            jobs.append(Job("stream" if stream else "plain", path, body))
    rng.shuffle(jobs)
    return jobs


def _check_finish(job: Job, finish: str | None, usage: dict | None) -> None:
    want = job.body["max_tokens"]
    if finish not in ("stop", "length"):
        job.problems.append(f"finish_reason {finish!r}")
    if usage is None:
        return
    n = usage["completion_tokens"]
    job.completion_tokens = n
    if usage["total_tokens"] != usage["prompt_tokens"] + n or usage["prompt_tokens"] < 1:
        job.problems.append(f"inconsistent usage {usage}")
    if finish == "length" and n != want:
        job.problems.append(f"finish length with {n} of {want} tokens")
    if finish == "stop" and not 0 <= n <= want:
        job.problems.append(f"finish stop with {n} of {want} tokens")
    if job.body.get("ignore_eos") and finish != "length":
        job.problems.append(f"ignore_eos but finish {finish!r}")


async def _stream(client: httpx.AsyncClient, job: Job) -> None:
    async with client.stream("POST", job.path, json=job.body) as r:
        job.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            job.problems.append(f"HTTP {r.status_code}: {r.text[:200]}")
            return
        payloads = []
        async for line in r.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                job.problems.append(f"bad SSE line {line[:80]!r}")
            payloads.append(line[6:])
            if job.kind == "abort-stream" and len(payloads) >= 3:
                job.aborted = True
                return  # leaving the block closes the connection mid-answer
    if payloads[-1:] != ["[DONE]"]:
        job.problems.append("no [DONE] at the end")
        return
    chunks = [json.loads(p) for p in payloads[:-1]]
    if any("error" in c for c in chunks):
        job.problems.append(f"error in stream: {chunks[-1]}")
        return
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    usage = chunks[-1].get("usage") if not chunks[-1]["choices"] else None
    if len(finishes) != 1:
        job.problems.append(f"{len(finishes)} chunks with a finish_reason")
        return
    if (job.body.get("stream_options") or {}).get("include_usage") and usage is None:
        job.problems.append("no usage chunk")
    _check_finish(job, finishes[0], usage)
    _check_logprobs(job, [c["choices"][0] for c in chunks if c["choices"]], usage)


async def _plain(client: httpx.AsyncClient, job: Job) -> None:
    try:
        r = await client.post(job.path, json=job.body, timeout=0.7 if job.kind == "abort-plain" else None)
    except httpx.ReadTimeout:
        if job.kind != "abort-plain":
            raise
        job.aborted = True
        return
    job.status = r.status_code
    if r.status_code != 200:
        job.problems.append(f"HTTP {r.status_code}: {r.text[:200]}")
        return
    out = r.json()
    choice = out["choices"][0]
    text = choice["message"]["content"] if job.path == CHAT else choice["text"]
    if not isinstance(text, str):
        job.problems.append(f"no text: {out}")
    _check_finish(job, choice["finish_reason"], out["usage"])
    _check_logprobs(job, [choice], out["usage"])


async def _bad(client: httpx.AsyncClient, job: Job) -> None:
    kw = {"content": job.body, "headers": {"content-type": "application/json"}} if isinstance(job.body, bytes) \
        else {"json": job.body}
    r = await client.post(job.path, **kw)
    job.status = r.status_code
    if r.status_code != 400:
        job.problems.append(f"bad input answered {r.status_code}: {r.text[:200]}")
    else:
        error_of(r)


async def run_jobs(url: str, jobs: list[Job]) -> None:
    limit = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY + 8, max_keepalive_connections=CONCURRENCY)

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0, connect=30.0), limits=limits) as client:
        async def one(job: Job) -> None:
            async with limit:
                try:
                    if job.kind == "bad":
                        await _bad(client, job)
                    elif job.body.get("stream"):
                        await _stream(client, job)
                    else:
                        await _plain(client, job)
                except Exception as e:  # a transport error on a request that should have worked
                    job.problems.append(f"{type(e).__name__}: {e}")

        await asyncio.wait_for(asyncio.gather(*(one(j) for j in jobs)), TIME_LIMIT_S)


@pytest.fixture(scope="module")
def engine():
    return shared_engine_or_skip("ngram")


def test_soak_mixed_requests(engine) -> None:
    jobs = make_jobs(random.Random(0))
    kinds = {k: sum(j.kind == k for j in jobs) for k in KINDS}
    assert all(kinds.values()), kinds
    t0 = time.monotonic()
    engine.pool.prefix_caching = True  # on the shared engine, for this test only
    try:
        _soak(engine, jobs, kinds, t0)
    finally:
        engine.pool.prefix_caching = False


def _soak(engine, jobs: list[Job], kinds: dict[str, int], t0: float) -> None:
    with one_thread(), serve(engine) as s:
        asyncio.run(run_jobs(s.url, jobs))
        elapsed = time.monotonic() - t0
        bad = [(j.kind, j.path, j.body if j.kind == "bad" else "", j.problems) for j in jobs
               if j.problems and not j.aborted]
        assert not bad, f"{len(bad)} of {len(jobs)} requests went wrong: {bad[:5]}"
        aborted = sum(j.aborted for j in jobs)
        good = [j for j in jobs if j.kind not in ("bad",) and not j.aborted]
        assert sum(j.aborted for j in jobs if j.kind == "abort-stream") == kinds["abort-stream"]

        # the server keeps answering, and everything it was given is finished and freed
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
        idle = lambda: (m := scrape(s.url)) and metric(m, "dspark:kv_cache_usage_perc") == 0 and \
            metric(m, "dspark:num_requests_running") == 0 and metric(m, "dspark:num_requests_waiting") == 0
        assert wait_for(idle, 30), "the KV cache is not empty after the soak"
        assert engine.pool.num_free == engine.pool.num_pages and not engine.pool.tables  # nothing held
        assert metric(scrape(s.url), "dspark:prefix_cache_hits_total") > 0
        assert s.state.scheduler.num_active == 0 and not engine.has_unfinished()
        m = scrape(s.url)
        finished = sum(metric(m, "dspark:request_success_total", finished_reason=r) for r in ("stop", "length"))
        assert finished == len(good)
        # a plain request whose client gave up before the server admitted it never reaches the engine
        assert kinds["abort-stream"] <= metric(m, "dspark:request_success_total", finished_reason="abort") <= aborted
        counted = [j.completion_tokens for j in good if j.completion_tokens]
        assert metric(m, "dspark:generation_tokens_total") >= sum(counted)
        out = httpx.post(s.url + C, json={"prompt": PROMPTS[0], "max_tokens": 3, "ignore_eos": True,
                                          "temperature": 0}, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 3 and out["choices"][0]["finish_reason"] == "length"
    print(f"soak: {len(jobs)} requests {kinds}, {aborted} aborted, {elapsed:.1f} s")
