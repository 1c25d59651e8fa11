"""Helpers for the server tests: shared engines, a real uvicorn server in a thread, SSE and metrics parsing."""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from dspark.config import EngineConfig, SpecConfig
from dspark.engine.engine import Engine
from dspark.server.app import ServerState, create_app

MAX_TOKENS = 16


@functools.cache
def shared_engine(drafter: str) -> Engine:
    """The default model with drafter "none" (max_num_seqs 2, for the queue tests) or "ngram".

    Loaded once per test session and reused by every server the tests start (one at a time)."""
    seqs = 2 if drafter == "none" else 64
    return Engine(EngineConfig(kv_cache_tokens=4096, max_num_seqs=seqs, spec=SpecConfig(drafter=drafter)))


def shared_engine_or_skip(drafter: str) -> Engine:
    """shared_engine, or skip the test when the default model is not installed."""
    import pytest

    from dspark.models.loader import ModelLoadError

    try:
        return shared_engine(drafter)
    except ModelLoadError as e:
        pytest.skip(f"default model unavailable: {e}")


@dataclass
class Running:
    """A live server: its base URL and its state (engine, scheduler, metrics)."""

    url: str
    state: ServerState

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def openai(self, api_key: str = "none"):
        import openai

        return openai.OpenAI(base_url=self.v1, api_key=api_key, max_retries=0, timeout=120)

    def async_openai(self, api_key: str = "none"):
        import openai

        return openai.AsyncOpenAI(base_url=self.v1, api_key=api_key, max_retries=0, timeout=120)


@contextlib.contextmanager
def serve(engine: Engine, **app_kwargs) -> Iterator[Running]:
    """Run create_app(engine, **app_kwargs) under uvicorn on 127.0.0.1 (a free port) in a thread."""
    app = create_app(engine, **app_kwargs)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                          timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Running(f"http://127.0.0.1:{port}", app.state.dspark)
    finally:
        server.should_exit = True
        thread.join(60)
        assert not thread.is_alive(), "the server did not shut down"


def sse_data(lines: Iterator[str]) -> list[str]:
    """The payloads of an SSE stream's `data:` lines, checking the framing."""
    out = []
    for line in lines:
        if line:
            assert line.startswith("data: "), line
            out.append(line[len("data: "):])
    return out


def stream_raw(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, list[str]]:
    """POST a streaming request with httpx; (status, data payloads)."""
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.text]
        return r.status_code, sse_data(r.iter_lines())


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """GET /metrics, parsed by prometheus_client: {(sample name, labels): value}."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called name whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def free_port() -> int:
    """A local TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def error_of(response: httpx.Response) -> dict:
    """The `error` object of an error response, checking its shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


def loads(payload: str) -> dict:
    return json.loads(payload)
