"""vLLM's request options over HTTP: include_stop_str_in_output, skip_special_tokens,
truncate_prompt_tokens, and the chat template's add_generation_prompt, continue_final_message and
chat_template_kwargs (the default model, n-gram drafter)."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import serve, shared_engine_or_skip, sse_data

pytestmark = pytest.mark.usefixtures("single_thread")
COUNT = "Count: one two three four five, one two three four five, one two three"


@pytest.fixture(scope="module")
def server():
    with serve(shared_engine_or_skip("ngram")) as s:
        yield s


def _post(s, path: str, body: dict) -> dict:
    r = httpx.post(s.url + path, json={"model": s.state.names[0], "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_string_kept_when_asked(server):
    free = _post(server, "/v1/completions", {"prompt": COUNT, "max_tokens": 12})["choices"][0]["text"]
    stop = free.split()[2]  # a word the output reaches
    cut = _post(server, "/v1/completions", {"prompt": COUNT, "max_tokens": 12, "stop": [stop]})["choices"][0]
    kept = _post(server, "/v1/completions", {"prompt": COUNT, "max_tokens": 12, "stop": [stop],
                                             "include_stop_str_in_output": True})["choices"][0]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop" and kept["stop_reason"] == stop
    assert kept["text"] == cut["text"] + stop and free.startswith(kept["text"])


def test_special_tokens_shown_when_asked(server):
    tok = server.state.engine.tokenizer
    special = tok.convert_tokens_to_ids("<|im_start|>")
    body = {"prompt": COUNT, "max_tokens": 2, "allowed_token_ids": [special], "ignore_eos": True}
    hidden = _post(server, "/v1/completions", body)["choices"][0]["text"]
    shown = _post(server, "/v1/completions", {**body, "skip_special_tokens": False})["choices"][0]["text"]
    assert hidden == "" and shown == "<|im_start|>" * 2


def test_truncated_prompt_keeps_its_last_tokens(server):
    ids = server.state.engine.tokenizer.encode(COUNT)
    whole = _post(server, "/v1/completions", {"prompt": COUNT, "max_tokens": 6, "truncate_prompt_tokens": 9})
    last = _post(server, "/v1/completions", {"prompt": ids[-9:], "max_tokens": 6})
    assert whole["usage"]["prompt_tokens"] == 9 and whole["choices"][0]["text"] == last["choices"][0]["text"]


def test_chat_template_options(server):
    tok = server.state.engine.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    cont = _post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5,
                                                  "add_generation_prompt": False, "continue_final_message": True})
    ids = tok.apply_chat_template(msgs, continue_final_message=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert cont["usage"]["prompt_tokens"] == len(ids)
    same = _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 5})
    assert cont["choices"][0]["message"]["content"] == same["choices"][0]["text"]
    plain = _post(server, "/v1/chat/completions", {"messages": msgs[:1], "max_tokens": 2})
    bare = _post(server, "/v1/chat/completions", {"messages": msgs[:1], "max_tokens": 2,
                                                  "add_generation_prompt": False, "chat_template_kwargs": {"x": 1}})
    opened = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True)
    closed = tok.apply_chat_template(msgs[:1], add_generation_prompt=False, tokenize=True)
    n = [len(x["input_ids"] if hasattr(x, "keys") else x) for x in (opened, closed)]
    assert (plain["usage"]["prompt_tokens"], bare["usage"]["prompt_tokens"]) == tuple(n) and n[0] > n[1]


def test_chat_echo_starts_with_the_assistant_message(server):
    """vLLM's chat echo: with continue_final_message the reply repeats the message it continues,
    whole and streamed; after a user message there is nothing to echo."""
    msgs = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A ripe"}]
    body = {"messages": msgs, "max_tokens": 5, "add_generation_prompt": False, "continue_final_message": True}
    plain = _post(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    echoed = _post(server, "/v1/chat/completions", body | {"echo": True})["choices"][0]["message"]["content"]
    assert echoed == "A ripe" + plain
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": server.state.names[0], "temperature": 0, **body, "echo": True, "stream": True},
                   timeout=120)
    deltas = [json.loads(e)["choices"][0]["delta"] for e in sse_data(r.text.splitlines()) if e != "[DONE]"]
    assert deltas[0] == {"role": "assistant", "content": "A ripe"}
    assert "".join(d.get("content") or "" for d in deltas) == echoed
    asked = _post(server, "/v1/chat/completions", {"messages": msgs[:1], "max_tokens": 3, "echo": True})
    assert asked["choices"][0]["message"]["content"] == _post(
        server, "/v1/chat/completions", {"messages": msgs[:1], "max_tokens": 3})["choices"][0]["message"]["content"]


def test_truncation_counts_before_the_context_check(server):
    """A prompt that only fits with its max_tokens once truncated is admitted, and echoes what
    the model saw."""
    tok, limit = server.state.engine.tokenizer, server.state.engine.max_model_len
    ids = tok.encode("one two three " * limit)[:limit - 10]
    body = {"prompt": ids, "max_tokens": 50, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json={"model": server.state.names[0], **body}, timeout=60)
    assert r.status_code == 400  # 50 more tokens do not fit after limit - 10
    out = _post(server, "/v1/completions", {**body, "max_tokens": 5, "truncate_prompt_tokens": 40, "echo": True})
    assert out["usage"]["prompt_tokens"] == 40 and out["usage"]["completion_tokens"] == 5
    assert out["choices"][0]["text"].startswith(tok.decode(ids[-40:]))
    fits = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 40})
    assert fits["usage"] == {"prompt_tokens": 40, "completion_tokens": 50, "total_tokens": 90}


def test_stop_token_text_kept_when_asked(server):
    comma = server.state.engine.tokenizer.convert_tokens_to_ids(",")
    body = {"prompt": COUNT, "max_tokens": 12, "stop_token_ids": [comma]}
    cut = _post(server, "/v1/completions", body)["choices"][0]
    kept = _post(server, "/v1/completions", {**body, "include_stop_str_in_output": True})["choices"][0]
    assert cut["stop_reason"] == kept["stop_reason"] == comma
    assert kept["text"] == cut["text"] + "," and "," not in cut["text"]


def test_bad_words_never_written(server):
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    free = _post(server, "/v1/chat/completions", {"messages": prompt, "max_tokens": 12})
    word = next(w.strip(".,") for w in free["choices"][0]["message"]["content"].split() if len(w) > 3)
    body = {"messages": prompt, "max_tokens": 12, "bad_words": [word]}
    out = _post(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    plain = _post(server, "/v1/chat/completions", {**body, "speculation": {"enabled": False}})
    assert word not in out and out == plain["choices"][0]["message"]["content"]
