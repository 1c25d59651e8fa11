"""One streaming request to an OpenAI-compatible server, timed the way ``vllm bench serve`` times it.

* TTFT: from sending the request to the first chunk that carries text (a chat stream's leading
  role-only chunk does not count).
* ITL: the gaps between consecutive text-carrying chunks. A speculative step can deliver several
  tokens in one chunk, so (as in vLLM) ITL is per chunk, not per token; TPOT is per token.
* Latency: from sending the request to the end of the stream.
* Output tokens: ``completion_tokens`` of the usage chunk (``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import httpx

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclasses.dataclass
class RequestResult:
    """What one benchmark request measured; ``error`` is set when it failed."""

    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first, or None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def request_body(endpoint: str, model: str | None, prompt: str, max_tokens: int, temperature: float,
                 ignore_eos: bool) -> dict[str, Any]:
    """The JSON body of one streaming request to ``endpoint`` (completions or chat)."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choice = chunk["choices"][0]
    if chat:
        return choice.get("delta", {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                       headers: dict[str, str] | None = None, timeout: float | None = None) -> RequestResult:
    """POST one streaming request and time its chunks; never raises for a failed request.
    timeout: seconds the whole request may take (httpx's own timeouts only bound each read, so a
    stream that keeps trickling would never end), as vLLM's benchmark does."""
    chat = url.endswith(CHAT)
    res = RequestResult()
    start = time.perf_counter()
    last = None
    done = usage_seen = False
    try:
        async with asyncio.timeout(timeout), client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error'].get('message')}"
                    return res
                now = time.perf_counter()
                if chunk.get("choices"):
                    text = _chunk_text(chunk, chat)
                    if text:
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.text += text
                    res.finish_reason = chunk["choices"][0].get("finish_reason") or res.finish_reason
                if chunk.get("usage"):
                    usage_seen = True
                    res.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                    res.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
    except TimeoutError:
        res.error = f"Timeout: no complete response within {timeout} s"
        return res
    except (httpx.HTTPError, httpx.StreamError, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    if not done:
        res.error = "the stream ended without [DONE]"
    elif not usage_seen:
        res.error = "the stream has no usage chunk (stream_options.include_usage)"
    else:
        if last is None:  # no text at all (e.g. an immediate end of sequence): the end is the first token
            res.ttft = res.latency
        res.success = True
    return res
