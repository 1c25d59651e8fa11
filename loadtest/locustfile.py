"""Locust load test of a dspark (or any OpenAI-compatible) server: streaming chat and completions.

Each simulated user sends streaming requests (three chat for one completion) with prompts drawn
from a jsonl file (rows with ``prompt`` or ``turns``). Besides the HTTP request itself (timed to the
response headers), every request reports two custom entries, named ``<kind> TTFT`` (time to the
first text chunk) and ``<kind> E2E`` (to the end of the stream), both with request type ``SSE``;
an E2E entry's response length is the number of output tokens (the usage chunk's
``completion_tokens``), so Locust's "average size" column is tokens per response.

Settings (environment variables):
  DSPARK_LOADTEST_PROMPTS     prompts jsonl (default ../shared/data/dev_prompts.jsonl beside the repo,
                              else a few built-in prompts)
  DSPARK_LOADTEST_MAX_TOKENS  max_tokens per request (default 64)
  DSPARK_LOADTEST_MODEL       model name to request (default: the server's)
  DSPARK_API_KEY              bearer token, when the server wants one

Run: ``locust -f loadtest/locustfile.py --host http://127.0.0.1:8000`` (or ``make loadtest``).
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import time
from collections.abc import Iterable, Iterator
from typing import Any

from locust import FastHttpUser, between, task

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO.parent / "shared" / "data" / "dev_prompts.jsonl"
BUILTIN_PROMPTS = ["Write a haiku about autumn.", "What is 17 * 23? Explain step by step.",
                   "Write a Python function that reverses a string.", "Name three primary colors.",
                   "Summarize the plot of Romeo and Juliet in two sentences."]
MAX_TOKENS = int(os.environ.get("DSPARK_LOADTEST_MAX_TOKENS", "64"))
MODEL = os.environ.get("DSPARK_LOADTEST_MODEL") or None
API_KEY = os.environ.get("DSPARK_API_KEY") or None


def load_prompts() -> list[str]:
    """Prompts from $DSPARK_LOADTEST_PROMPTS, the shared dev set, or the built-in few."""
    path = pathlib.Path(os.environ.get("DSPARK_LOADTEST_PROMPTS") or DEFAULT_PROMPTS)
    if not path.is_file():
        if os.environ.get("DSPARK_LOADTEST_PROMPTS"):
            raise FileNotFoundError(f"DSPARK_LOADTEST_PROMPTS={path} does not exist")
        return BUILTIN_PROMPTS
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            text = row.get("prompt") or (row.get("turns") or [None])[0]
            if isinstance(text, str) and text:
                prompts.append(text)
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


PROMPTS = load_prompts()


def response_lines(resp: Any) -> Iterator[bytes]:
    """The body's lines as they arrive. geventhttpclient's ``readline`` returns as soon as a line is
    complete; Locust's ``iter_content``/``iter_lines`` wait for whole 1 KiB blocks, which would
    hold back the first tokens of a short stream and spoil TTFT."""
    raw = getattr(resp, "_response", None)
    if raw is not None and hasattr(raw, "readline"):
        yield from iter(lambda: raw.readline(b"\n"), b"")
        return
    buf = b""
    for chunk in resp.iter_content(chunk_size=1024, decode_content=False):
        buf += chunk if isinstance(chunk, bytes) else chunk.encode()
        *lines, buf = buf.split(b"\n")
        yield from lines
    if buf:
        yield buf


def sse_payloads(lines: Iterable[bytes]) -> Iterator[str]:
    """The ``data:`` payloads of SSE lines, as strings."""
    for line in lines:
        if line.startswith(b"data:"):
            yield line[5:].strip().decode("utf-8")


class OpenAIStreamingUser(FastHttpUser):
    """A user that sends streaming chat and completions requests, one after another."""

    wait_time = between(0.2, 1.0)
    network_timeout = 300.0
    connection_timeout = 30.0

    @task(3)
    def chat(self) -> None:
        self._stream("chat", "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": random.choice(PROMPTS)}]})

    @task(1)
    def completions(self) -> None:
        self._stream("completions", "/v1/completions", {"prompt": random.choice(PROMPTS)})

    def _stream(self, kind: str, path: str, body: dict[str, Any]) -> None:
        body.update(max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True})
        if MODEL:
            body["model"] = MODEL
        headers = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}
        start = time.perf_counter()
        ttft = error = None
        tokens = 0
        with self.client.post(path, json=body, headers=headers, stream=True, catch_response=True,
                              name=path) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            done = False
            try:
                for payload in sse_payloads(response_lines(resp)):
                    if payload == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        error = f"stream error: {chunk['error'].get('message')}"
                        break
                    choice = (chunk.get("choices") or [{}])[0]
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text and ttft is None:
                        ttft = time.perf_counter() - start
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"].get("completion_tokens") or 0)
            except Exception as e:  # a broken connection or a malformed chunk fails this request
                error = f"{type(e).__name__}: {e}"
            if error is None and not done:
                error = "the stream ended without [DONE]"
            if error is None:
                resp.success()
            else:
                resp.failure(error)
        e2e = time.perf_counter() - start
        fire = self.environment.events.request.fire
        if ttft is not None:
            fire(request_type="SSE", name=f"{kind} TTFT", response_time=ttft * 1000, response_length=0,
                 exception=None, context={})
        fire(request_type="SSE", name=f"{kind} E2E", response_time=e2e * 1000, response_length=tokens,
             exception=RuntimeError(error) if error else None, context={})
