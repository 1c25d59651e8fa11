"""logprobs over HTTP: the legacy completions shape, the chat shape, streamed in pieces that add
up to the whole, and the same values with and without speculation (the default model, bf16)."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import MAX_TOKENS, serve, shared_engine_or_skip, stream_raw

pytestmark = pytest.mark.usefixtures("single_thread")

REPEAT = "Count: one two three four five, one two three four five, one two three four five,"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def engines():
    return {"none": shared_engine_or_skip("none"), "ngram": shared_engine_or_skip("ngram")}


def _post(s, path: str, body: dict) -> dict:
    r = httpx.post(s.url + path, json={"model": s.state.names[0], **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(s, path: str, body: dict) -> list[dict]:
    status, data = stream_raw(s.url, path, {"model": s.state.names[0], "stream": True, **body})
    assert status == 200 and data[-1] == "[DONE]"
    return [json.loads(d)["choices"][0] for d in data[:-1] if json.loads(d)["choices"]]


def _completion(s, **kw) -> tuple[dict, dict]:
    body = {"prompt": REPEAT, "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": 2, **kw}
    out = _post(s, "/v1/completions", body)
    lp, n = out["choices"][0]["logprobs"], out["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert "".join(lp["tokens"]).startswith(out["choices"][0]["text"])
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    assert lp["text_offset"] == offsets
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert v <= 0 and top[tok] == v and len(top) <= 3
        assert v == max(top.values())  # greedy: the chosen token is the most likely
    # streamed: the pieces add up to the whole
    chunks = _streamed(s, "/v1/completions", body)
    parts = [c["logprobs"] for c in chunks if c["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p[key]] == lp[key], key
    return out, lp


def test_completion_logprobs_same_with_and_without_speculation(engines):
    got = {}
    for name in ("none", "ngram"):
        with serve(engines[name]) as s:
            out, got[name] = _completion(s)
            if name == "ngram":
                assert out["speculation"]["accepted"] > 0  # drafts were verified and kept
    assert got["none"] == got["ngram"]


def test_chat_logprobs_and_stream(engines):
    with serve(engines["ngram"]) as s:
        body = {"messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 2}
        out = _post(s, "/v1/chat/completions", body)
        content = out["choices"][0]["logprobs"]["content"]
        assert len(content) == out["usage"]["completion_tokens"]
        assert "".join(c["token"] for c in content).startswith(out["choices"][0]["message"]["content"])
        for c in content:
            assert c["bytes"] == list(c["token"].encode("utf-8")) and c["logprob"] <= 0
            assert len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"]
            assert c["top_logprobs"][0]["logprob"] == c["logprob"] >= c["top_logprobs"][1]["logprob"]
        streamed = [x for ch in _streamed(s, "/v1/chat/completions", body) if ch["logprobs"]
                    for x in ch["logprobs"]["content"]]
        assert streamed == content
        plain = _post(s, "/v1/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": 4})
        assert plain["choices"][0]["logprobs"] is None
        only = _post(s, "/v1/chat/completions", {**body, "top_logprobs": 0, "max_tokens": 4})
        assert all(c["top_logprobs"] == [] for c in only["choices"][0]["logprobs"]["content"])


def test_chat_logprob_bytes_are_the_tokens_own(engines):
    """A token holding part of a character decodes to U+FFFD; its `bytes` are still its own, so
    the output tokens' bytes join into the text (as OpenAI's), emoji and accents included."""
    from dspark.server.token_bytes import token_bytes

    tok = engines["none"].tokenizer
    text = "Fish 🐟 and chips 🍟, café ✓ 日本"
    ids = tok.encode(text, add_special_tokens=False)
    decoded = [tok.decode([t]) for t in ids]
    assert any("\ufffd" in d for d in decoded)  # the case this is for: a character split over tokens
    assert b"".join(token_bytes(tok, t, d) for t, d in zip(ids, decoded)) == text.encode("utf-8")
    with serve(engines["none"]) as s:
        body = _post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Write 🐟🍟 three times."}],
                                                 "max_tokens": 12, "temperature": 0, "logprobs": True,
                                                 "top_logprobs": 2})
    content = body["choices"][0]["logprobs"]["content"]
    joined = b"".join(bytes(c["bytes"]) for c in content)
    assert "\ufffd" in "".join(c["token"] for c in content)
    # the text may end inside a character (max_tokens), which the message shows as U+FFFD
    assert joined.decode("utf-8", errors="ignore") == body["choices"][0]["message"]["content"].rstrip("\ufffd")
    for c in content:
        for alt in c["top_logprobs"]:
            assert isinstance(alt["bytes"], list) and all(0 <= b < 256 for b in alt["bytes"])
