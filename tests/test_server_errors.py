"""Server error paths: invalid requests (400), unknown model (404), API key (401), a full queue
(429), not admitting (503), and a graceful SIGTERM of `dspark serve`; the server keeps serving."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from server_helpers import error_of, free_port, metric, scrape, serve, shared_engine_or_skip, stream_raw, wait_for

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
MSGS = [{"role": "user", "content": "Hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def engine():
    return shared_engine_or_skip("none")  # max_num_seqs 2


@pytest.fixture(scope="module")
def server(engine):
    with serve(engine, max_queue=1) as s:
        yield s


def _ok(server) -> None:
    out = server.openai().completions.create(model=server.state.names[0], prompt=PROMPT, max_tokens=4,
                                             temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 4


INVALID = [
    (C, b"{not json", None), (C, b"[1, 2]", None), (C, {}, "prompt"),
    (C, {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"), (C, {"prompt": PROMPT, "max_tokens": "8"}, "max_tokens"),
    (C, {"prompt": PROMPT, "temperature": -0.5}, "temperature"), (C, {"prompt": PROMPT, "temperature": 2.5},
                                                                  "temperature"),
    (C, {"prompt": PROMPT, "temperature": "hot"}, "temperature"), (C, {"prompt": PROMPT, "top_p": 1.5}, "top_p"),
    (C, {"prompt": PROMPT, "top_p": 0}, "top_p"), (C, {"prompt": PROMPT, "top_k": -2}, "top_k"),
    (C, {"prompt": PROMPT, "n": 0}, "n"), (C, {"prompt": PROMPT, "seed": 1.5}, "seed"),
    (C, {"prompt": ["one", "two", "three", "four"]}, "prompt"),  # more than the 2 running + 1 queued
    (C, {"prompt": ["one", [1, "x"]]}, "prompt"), (C, {"prompt": [[]]}, "prompt"),
    (C, {"prompt": 42}, "prompt"), (C, {"prompt": []}, "prompt"),
    (C, {"prompt": PROMPT, "stop": 5}, "stop"), (C, {"prompt": PROMPT, "stream": "yes"}, "stream"),
    (C, {"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    (C, {"prompt": PROMPT, "max_tokens": 100_000}, "max_tokens"), (C, {"prompt": "word " * 9000}, "prompt"),
    (C, {"prompt": [10**9]}, "prompt"), (C, {"prompt": ""}, "prompt"),
    (C, {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    (C, {"prompt": PROMPT, "speculation": {"enabled": "no"}}, "speculation.enabled"),
    (C, {"prompt": PROMPT, "speculation": {"block_size": 0}}, "speculation.block_size"),
    (CHAT, {"messages": []}, "messages"), (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages.0.content"),
    (CHAT, {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}]},
     "messages.1.content"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 100_000}, "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "n": 65}, "n"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, "tools.0.function"),
    (C, {"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty"),
    (CHAT, {"messages": MSGS, "frequency_penalty": "high"}, "frequency_penalty"),
    (C, {"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty"),
    (C, {"prompt": PROMPT, "logit_bias": {"fifty": 5}}, "logit_bias"),
    (C, {"prompt": PROMPT, "logit_bias": {"-5": 5}}, "logit_bias"),
    (C, {"prompt": PROMPT, "logit_bias": {"50": 101}}, "logit_bias"),
    (C, {"prompt": PROMPT, "logit_bias": {"50": "up"}}, "logit_bias.50"),
    (C, {"prompt": PROMPT, "logit_bias": {"99999999": 1}}, "logit_bias"),
    (CHAT, {"messages": MSGS, "allowed_token_ids": [-1]}, "allowed_token_ids.0"),
    (CHAT, {"messages": MSGS, "allowed_token_ids": []}, "allowed_token_ids"),
    (C, {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    (C, {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (C, {"prompt": PROMPT, "min_tokens": -1}, "min_tokens"), (C, {"prompt": PROMPT, "min_tokens": 1.5}, "min_tokens"),
    (C, {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 4}, "min_tokens"),
    (CHAT, {"messages": MSGS, "min_p": 1.5}, "min_p"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    (CHAT, {"messages": MSGS, "add_generation_prompt": False, "continue_final_message": True},
     "continue_final_message"),
    (CHAT, {"messages": MSGS, "continue_final_message": True}, "continue_final_message"),  # both true
    (C, {"prompt": PROMPT, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (C, {"prompt": PROMPT, "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    # past int64 top_k used to fail inside the batched step, failing every request in it (500)
    (C, {"prompt": PROMPT, "top_k": 2**63}, "top_k"), (CHAT, {"messages": MSGS, "top_k": 2**31}, "top_k"),
    (CHAT, {"messages": MSGS, "add_generation_prompt": "no"}, "add_generation_prompt"),
    # completions take logprobs as a count, chat as a flag (with top_logprobs for the count)
    (C, {"prompt": PROMPT, "logprobs": True}, "logprobs"), (CHAT, {"messages": MSGS, "logprobs": 1}, "logprobs"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "top_logprobs": 0}, "top_logprobs"),
    (C, {"prompt": PROMPT, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": MSGS, "echo": "yes"}, "echo"),
    (C, {"prompt": PROMPT, "echo": "yes"}, "echo"), (C, {"prompt": [10**9], "echo": True}, "prompt"),
    (C, {"prompt": PROMPT, "n": 4}, "n"),  # more than this server's 2 running + 1 queued
    (C, {"prompt": PROMPT, "best_of": True}, "best_of"),
    (C, {"prompt": PROMPT, "structured_outputs": {"regex": "(a+"}}, "structured_outputs"),
    (CHAT, {"messages": MSGS, "tool_choice": "required"}, "tool_choice"),
    (C, {"prompt": PROMPT, "stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
    (C, {"prompt": PROMPT, "stop_token_ids": [-1]}, "stop_token_ids"), (C, {"prompt": PROMPT, "stop_token_ids": 2},
                                                            "stop_token_ids"),
    # checks past the request's schema (SamplingParams, the engine) name their field too
    (CHAT, {"messages": [{"role": "user", "content": "word " * 9000}]}, "messages"),
    (C, {"prompt": PROMPT, "stop": ""}, "stop"), (C, {"prompt": PROMPT, "bad_words": [""]}, "bad_words"),
    (CHAT, {"messages": MSGS, "allowed_token_ids": [10**9]}, "allowed_token_ids"),
    (C, b'{"prompt": "Hi", "temperature": NaN}', "temperature"), (C, b'{"prompt": "Hi", "top_p": NaN}', "top_p"),
]


@pytest.mark.parametrize("path,body,param", INVALID, ids=[f"{i}" for i in range(len(INVALID))])
def test_invalid_request_gets_400(server, path, body, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(server.url + path, timeout=60, **kw)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    if param is not None:
        assert err["param"] == param, err


def test_retrieve_a_model(server):
    client, name = server.openai(), server.state.names[0]
    card = client.models.retrieve(name)
    assert card.id == name and card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no/such-model")
    assert e.value.body["type"] == "not_found_error" and e.value.body["param"] == "model"


def test_errors_then_keeps_serving(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.state.names[0], prompt=PROMPT, max_tokens=-1)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert e.value.body["type"] == "not_found_error" and e.value.body["param"] == "model"
    r = httpx.post(server.url + CHAT, json={"model": "no-such-model", "messages": MSGS})
    assert r.status_code == 404 and error_of(r)["code"] == 404
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and error_of(r)
    # a stream that fails validation is a plain HTTP error, not an SSE stream
    status, body = stream_raw(server.url, C, {"prompt": PROMPT, "stream": True, "top_p": 7})
    assert status == 400 and json.loads(body[0])["error"]["param"] == "top_p"
    _ok(server)
    models = client.models.list().data
    assert [m.id for m in models] == server.state.names


def test_version_cors_default_model_and_content_parts(server):
    from dspark import SamplingParams, __version__

    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**40).validate()
    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": __version__}
    pre = httpx.options(server.url + CHAT, headers={"Origin": "http://ui.example", "Access-Control-Request-Method":
                                                    "POST", "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    r = httpx.post(server.url + C, json={"model": "", "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == server.state.names[0]  # "" is the default model, as in vLLM

    def prompt_tokens(content) -> int:
        r = httpx.post(server.url + CHAT, json={"messages": [{"role": "user", "content": content}], "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    parts = [{"type": "text", "text": "Say A"}, {"type": "text", "text": "then B"}]
    assert prompt_tokens(parts) == prompt_tokens("Say A\nthen B") != prompt_tokens("Say Athen B")


def test_api_key(server):
    # the module's server with a key set (a second server would drive the same engine too)
    s = server
    s.state.api_key = "sekret"
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(s.url + C, json={"prompt": PROMPT, "max_tokens": 2}, headers=headers)
            assert r.status_code == 401 and error_of(r)["type"] == "authentication_error"
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            s.openai("wrong").completions.create(model=s.state.names[0], prompt=PROMPT, max_tokens=2)
        out = s.openai("sekret").completions.create(model=s.state.names[0], prompt=PROMPT, max_tokens=2)
        assert out.usage.completion_tokens == 2
    finally:
        s.state.api_key = None


def test_queue_full_gets_429(server):
    # max_num_seqs 2 + max_queue 1: three requests in flight fill the server
    url, model = server.url, server.state.names[0]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            r = stack.enter_context(httpx.stream("POST", url + C, json=body, timeout=60))
            assert r.status_code == 200
        assert wait_for(lambda: metric(scrape(url), "dspark:num_requests_waiting") == 1)
        assert metric(scrape(url), "dspark:num_requests_running") == 2
        r = httpx.post(url + C, json={**body, "stream": False})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert error_of(r)["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            server.openai().chat.completions.create(model=model, messages=MSGS, max_tokens=2)
    idle = lambda: (m := scrape(url)) and metric(m, "dspark:num_requests_running") == 0 and \
        metric(m, "dspark:num_requests_waiting") == 0 and metric(m, "dspark:kv_cache_usage_perc") == 0
    assert wait_for(idle, 10)
    _ok(server)


def test_503_when_not_admitting(server):
    sched = server.state.scheduler
    sched.accepting = False  # what SIGTERM does first
    try:
        r = httpx.post(server.url + C, json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and error_of(r)["type"] == "service_unavailable"
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        sched.accepting = True
    _ok(server)


def test_chat_template_error_gets_400(server, engine, monkeypatch):
    """A template that refuses the messages (its own raise_exception) is the client's error."""
    import jinja2

    def refuse(*args, **kwargs):
        raise jinja2.TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", refuse)
    r = httpx.post(server.url + CHAT, json={"messages": MSGS, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text
    assert "roles must alternate" in error_of(r)["message"]
    monkeypatch.undo()
    _ok(server)


def test_unexpected_error_is_a_json_500_with_cors(server, engine, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("bug")

    monkeypatch.setattr(engine, "encode", broken)
    r = httpx.post(server.url + C, json={"prompt": PROMPT, "max_tokens": 2}, headers={"Origin": "http://ui.example"})
    assert r.status_code == 500 and r.headers["access-control-allow-origin"] == "*"
    assert error_of(r)["type"] == "internal_server_error" and "KeyError" in error_of(r)["message"]
    monkeypatch.undo()
    _ok(server)


def test_engine_error_mid_stream(server, engine, monkeypatch):
    real, calls = engine.step, []

    def flaky():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(engine, "step", flaky)
    status, data = stream_raw(server.url, C, {"prompt": PROMPT, "max_tokens": 16, "stream": True})
    assert status == 200 and data[-1] == "[DONE]"
    err = json.loads(data[-2])["error"]
    assert err["code"] == 500 and "boom" in err["message"]
    calls.clear()
    r = httpx.post(server.url + C, json={"prompt": PROMPT, "max_tokens": 16}, timeout=60)
    assert r.status_code == 500 and "boom" in error_of(r)["message"]
    monkeypatch.undo()
    assert wait_for(lambda: metric(scrape(server.url), "dspark:kv_cache_usage_perc") == 0)
    _ok(server)


def test_engine_error_fails_the_running_batch_only(server, engine, monkeypatch):
    # max_num_seqs 2: two long requests run, a third waits; a step fails while it waits
    real, raised = engine.step, []

    def flaky():
        if not raised and engine.waiting and len(engine.running) == 2:
            raised.append(1)
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(engine, "step", flaky)
    url, results = server.url, {}

    def post(i: int, max_tokens: int) -> None:
        results[i] = httpx.post(url + C, json={"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True},
                                timeout=120)

    threads = [threading.Thread(target=post, args=(i, 300)) for i in range(2)]
    for t in threads:
        t.start()
    assert wait_for(lambda: len(engine.running) == 2)
    threads.append(threading.Thread(target=post, args=(2, 4)))
    threads[-1].start()
    for t in threads:
        t.join()
    assert raised
    assert [results[i].status_code for i in range(3)] == [500, 500, 200], [r.text for r in results.values()]
    assert "boom" in error_of(results[0])["message"]
    assert results[2].json()["usage"]["completion_tokens"] == 4
    monkeypatch.undo()
    assert wait_for(lambda: metric(scrape(server.url), "dspark:kv_cache_usage_perc") == 0)
    _ok(server)


def test_sigterm_finishes_running_requests(tmp_path):
    port, root = free_port(), Path(__file__).resolve().parents[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    env.pop("DSPARK_API_KEY", None)
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "dspark.cli", "serve", "--drafter", "none", "--port", str(port),
                             "--kv-cache-tokens", "4096", "--shutdown-timeout", "60"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    try:
        statuses = []

        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                r = httpx.get(url + "/health", timeout=5)
            except httpx.TransportError:
                return False
            statuses.append((r.status_code, r.json()["status"]))
            return r.status_code == 200

        assert wait_for(ready, 180, 0.1)
        assert set(statuses[:-1]) <= {(503, "loading")}  # 503 while the model loads
        result = {}
        body = {"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t = threading.Thread(target=lambda: result.update(r=stream_raw(url, C, body)))
        t.start()
        assert wait_for(lambda: metric(scrape(url), "dspark:num_requests_running") == 1, 30)
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        status, data = result["r"]
        assert status == 200 and data[-1] == "[DONE]", data[-3:]
        assert json.loads(data[-2])["usage"]["completion_tokens"] == 64
        assert proc.wait(60) == 0
        text = (tmp_path / "serve.log").read_text()
        assert "no longer admitting requests; finishing 1 in flight" in text, text
        assert "finished (length): 5 prompt + 64 output tokens" in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
