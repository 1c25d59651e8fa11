"""OpenAI response bodies: completions and chat objects (or streamed chunks), usage, and the
logprobs shapes (legacy completions, chat, vLLM's prompt_logprobs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _lp(x: float) -> float:
    return max(x, -9999.0)  # as vLLM: JSON has no -inf


def completion_logprobs(entries: list, token_ids: list[int], decode: Callable[[int], str],
                        text_offset: int = 0) -> dict:
    """The legacy completions `logprobs` object for these tokens (logprobs.TokenLogprob each, or
    None for an echoed prompt's first token, which nothing predicts): token strings, their
    logprobs, the top alternatives (with the token itself, as vLLM does) and each token's
    character offset into the text (from text_offset on)."""
    tokens = [decode(t) for t in token_ids]
    offsets = []
    for s in tokens:
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": [None if e is None else _lp(e.logprob) for e in entries],
            "top_logprobs": [None if e is None else {decode(t): _lp(v) for t, v in e.top} | {s: _lp(e.logprob)}
                             for e, s in zip(entries, tokens)],
            "text_offset": offsets}


def cut_top(entry, k: int):  # noqa: ANN001, ANN201 - a logprobs.TokenLogprob or None
    """The entry with at most k alternatives (the engine scores the most any field asks for)."""
    return entry if entry is None or len(entry.top) <= k else replace(entry, top=entry.top[:k])


def vllm_prompt_logprobs(entries: list, token_ids: list[int], k: int, decode: Callable[[int], str]) -> list:
    """vLLM's `prompt_logprobs` for a choice: None for the first prompt token, then for each token
    {token id: {"logprob", "rank", "decoded_token"}} over the token itself and its k alternatives."""
    out: list = []
    for e, tok in zip(entries, token_ids):
        if e is None:
            out.append(None)
            continue
        ranked = [(t, v, r) for r, (t, v) in enumerate(e.top[:k], start=1)]
        if tok not in (t for t, _, _ in ranked):
            ranked.insert(0, (tok, e.logprob, e.rank))
        out.append({str(t): {"logprob": _lp(v), "rank": r, "decoded_token": decode(t)} for t, v, r in ranked})
    return out


def chat_logprobs(entries: list, token_ids: list[int], decode: Callable[[int], str],
                  raw: Callable[[int], bytes]) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}; `bytes`
    are the token's own (raw), which for part of a character are not its text's."""
    def one(t: int, v: float) -> dict:
        return {"token": decode(t), "logprob": _lp(v), "bytes": list(raw(t))}

    return {"content": [one(t, e.logprob) | {"top_logprobs": [one(a, v) for a, v in e.top]}
                        for e, t in zip(entries, token_ids)]}


def completion_body(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                    usage_: dict | None = None, speculation: dict | None = None, chunk: bool = False,
                    stop_reason: int | str | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
    """A text_completion object, or one streamed chunk of it. stop_reason (vLLM's extension): the
    stop string or stop token id that ended the output, null for EOS and length."""
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                         "finish_reason": finish_reason, "stop_reason": stop_reason}]}
    if not chunk or usage_ is not None:
        body["usage"] = usage_
    if speculation is not None:
        body["speculation"] = speculation
    return body


def chat_body(rid: str, created: int, model: str, content: str | None, finish_reason: str | None,
              usage_: dict | None = None, speculation: dict | None = None, chunk: bool = False,
              role: bool = False, stop_reason: int | str | None = None, logprobs: dict | None = None,
              index: int = 0, tool_calls: list[dict] | None = None) -> dict:
    """A chat.completion object, or one chat.completion.chunk (a delta) when chunk; tool_calls
    go into the message (whose content is then null) or the delta."""
    if chunk:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if content:
            delta["content"] = content
        elif role:
            delta["content"] = ""
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
    else:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion",
                            "created": created, "model": model, "choices": [choice]}
    if not chunk or usage_ is not None:
        body["usage"] = usage_
    if speculation is not None:
        body["speculation"] = speculation
    return body


def usage_chunk(rid: str, created: int, model: str, chat: bool, usage_: dict) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, just usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_}
