"""End-to-end tests of the OpenAI-compatible server: a real uvicorn server on 127.0.0.1 serving the
default model (drafter "none" and drafter "ngram"), driven by the openai client and httpx."""

from __future__ import annotations

import asyncio
import json
import math
import socket
from types import SimpleNamespace

import httpx
import pytest
from server_helpers import MAX_TOKENS, metric, scrape, serve, shared_engine_or_skip, stream_raw, wait_for

pytest.importorskip("openai")

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
REPEAT = "Count: one two three four five, one two three four five, one two three four five,"
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def engines():
    return {"none": shared_engine_or_skip("none"), "ngram": shared_engine_or_skip("ngram")}


@pytest.fixture(params=["none", "ngram"])
def server(request, engines):
    with serve(engines[request.param]) as s:
        yield s


@pytest.fixture
def ngram_server(engines):
    with serve(engines["ngram"], metrics_window_s=3600) as s:
        yield s


def _spec(obj) -> dict:
    spec = obj.model_extra["speculation"]
    assert {"steps", "proposed", "verified", "accepted", "tau"} <= set(spec)
    return spec


def test_completions_stream_matches_nonstream(server):
    client, model = server.openai(), server.state.names[0]
    full = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.text
    n_prompt = len(server.state.engine.tokenizer.encode(PROMPT, add_special_tokens=False))
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.total_tokens == n_prompt + full.usage.completion_tokens
    assert 0 < full.usage.completion_tokens <= MAX_TOKENS
    if choice.finish_reason == "length":
        assert full.usage.completion_tokens == MAX_TOKENS
    spec = _spec(full)
    assert spec["steps"] >= full.usage.completion_tokens - 1 - spec["accepted"]
    chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.id == chunks[0].id and c.model == model for c in chunks)


def test_stop_string_and_seeded_sampling(server):
    client, model = server.openai(), server.state.names[0]
    full = client.completions.create(model=model, prompt=REPEAT, stop=["four"], temperature=0, max_tokens=24)
    assert full.choices[0].finish_reason == "stop" and "four" not in full.choices[0].text
    assert full.choices[0].model_extra["stop_reason"] == "four"  # vLLM's extension: which stop matched
    chunks = list(client.completions.create(model=model, prompt=REPEAT, stop=["four"], temperature=0,
                                            max_tokens=24, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].model_extra["stop_reason"] == "four"
    assert all(c.choices[0].model_extra["stop_reason"] is None for c in chunks[:-1])
    kw = {"model": model, "messages": CHAT, "temperature": 0.9, "top_p": 0.95, "max_tokens": 12,
          "extra_body": {"top_k": 50}}
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = "".join(c.choices[0].delta.content or "" for c in
                client.chat.completions.create(seed=1234, stream=True, **kw) if c.choices)
    assert a == b


def test_stop_token_ids(server):
    """vLLM's stop_token_ids: the output ends at the first listed token (counted in usage, left out
    of the text), finish_reason "stop"."""
    client, model = server.openai(), server.state.names[0]
    kw = {"model": model, "prompt": REPEAT, "temperature": 0, "max_tokens": 24}
    full = client.completions.create(**kw)
    text = full.choices[0].text
    word = server.state.engine.tokenizer.encode(" three", add_special_tokens=False)
    assert len(word) == 1 and " three" in text
    cut = client.completions.create(extra_body={"stop_token_ids": word}, **kw)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == word[0]
    assert full.choices[0].model_extra["stop_reason"] is None  # length or EOS
    assert cut.choices[0].text == text[:text.index(" three")]
    assert cut.usage.completion_tokens < full.usage.completion_tokens


def test_chat_stream_matches_nonstream(server):
    client, model = server.openai(), server.state.names[0]
    full = client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                          max_completion_tokens=MAX_TOKENS)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    n_prompt = len(server.state.engine.encode(CHAT))
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens <= MAX_TOKENS
    _spec(full)
    # raw SSE: data: {json} chunks, a usage chunk, then [DONE]
    status, data = stream_raw(server.url, "/v1/chat/completions", {
        "model": model, "messages": CHAT, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == msg.content
    last = [c for c in chunks if c["choices"]][-1]
    assert last["choices"][0]["finish_reason"] == full.choices[0].finish_reason
    assert last["speculation"] == full.model_extra["speculation"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full.usage.model_dump(exclude_none=True)
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])  # OpenAI: null until the last chunk
    # the openai client's view of the same stream
    stream = client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                            max_completion_tokens=MAX_TOKENS, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == msg.content


def test_greedy_output_same_with_and_without_speculation(engines):
    texts = {}
    for name in ("none", "ngram"):
        with serve(engines[name]) as s:
            client = s.openai()
            out = client.completions.create(model=s.state.names[0], prompt=REPEAT, temperature=0, max_tokens=24)
            texts[name] = out.choices[0].text
            spec = _spec(out)
            if name == "ngram":
                assert spec["drafter"] == "ngram" and spec["proposed"] > 0 and spec["accepted"] > 0
                assert spec["tau"] > 1
                off = client.completions.create(model=s.state.names[0], prompt=REPEAT, temperature=0,
                                                max_tokens=24, extra_body={"speculation": {"enabled": False}})
                assert off.choices[0].text == out.choices[0].text
                assert _spec(off)["proposed"] == 0 and _spec(off)["tau"] == 1
            else:
                assert spec["proposed"] == 0
    assert texts["none"] == texts["ngram"]


def test_16_concurrent_streams_match_alone(engines):
    prompts = [f"{topic} is" for topic in ("The sky", "Python", "A cat", "Music", "The ocean", "Coffee",
                                            "Winter", "My favorite book")]
    prompts = prompts + [p.replace(" is", " was") for p in prompts]
    with serve(engines["ngram"]) as s:
        client, model = s.openai(), s.state.names[0]
        batch_sizes = []
        s.state.scheduler.listeners.append(SimpleNamespace(on_step=lambda r: batch_sizes.append(r.running),
                                                           on_finish=lambda r: None))
        alone = [client.completions.create(model=model, prompt=p, temperature=0, max_tokens=12).choices[0].text
                 for p in prompts]

        async def one(aclient, prompt: str) -> tuple[str, str | None]:
            text, finish = "", None
            async for chunk in await aclient.completions.create(model=model, prompt=prompt, temperature=0,
                                                                max_tokens=12, stream=True):
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            return text, finish

        async def all_at_once() -> list[tuple[str, str | None]]:
            async with s.async_openai() as aclient:
                return await asyncio.gather(*(one(aclient, p) for p in prompts))

        batch_sizes.clear()
        results = asyncio.run(all_at_once())
    assert max(batch_sizes) >= 8, batch_sizes  # they really ran together
    assert [r[0] for r in results] == alone
    assert all(r[1] in ("stop", "length") for r in results)


def test_disconnect_frees_pages(ngram_server):
    url, model = ngram_server.url, ngram_server.state.names[0]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        got: list[str] = []
        for line in lines:
            got += [line] if line.startswith("data: ") else []
            if len(got) >= 3:
                break
        assert metric(scrape(url), "dspark:kv_cache_usage_perc") > 0
    idle = lambda: (m := scrape(url)) and metric(m, "dspark:kv_cache_usage_perc") == 0 and \
        metric(m, "dspark:num_requests_running") == 0
    assert wait_for(idle, 10), "pages not freed after the client disconnected"
    assert metric(scrape(url), "dspark:request_success_total", finished_reason="abort") == 1
    # a non-streaming request whose client gives up is aborted too (3,000 tokens: several seconds
    # even on a fast idle machine, where 400 finished inside the client's 1.5 s)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**body, "max_tokens": 3000}, timeout=1.5)
    assert wait_for(idle, 10), "pages not freed after a non-streaming client disconnected"
    assert metric(scrape(url), "dspark:request_success_total", finished_reason="abort") == 2
    assert ngram_server.state.engine.pool.num_free == ngram_server.state.engine.pool.num_pages


def test_token_counters_follow_a_stream(ngram_server):
    """Prompt and generation token counters move while a stream runs (counted as tokens are
    delivered, before the client sees them), and end equal to the response's usage."""
    url, model = ngram_server.url, ngram_server.state.names[0]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    chunks, usage = 0, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            if event["choices"] and event["choices"][0]["text"]:
                chunks += 1
                if chunks == 3:  # mid-stream: every token received so far is already counted
                    m = scrape(url)
                    assert metric(m, "dspark:generation_tokens_total") >= chunks
                    assert metric(m, "dspark:prompt_tokens_total") > 0
                    assert metric(m, "dspark:request_success_total") == 0  # still running
    m = scrape(url)
    assert usage["completion_tokens"] == 60
    assert metric(m, "dspark:generation_tokens_total") == usage["completion_tokens"]
    assert metric(m, "dspark:prompt_tokens_total") == usage["prompt_tokens"]


def test_client_gone_before_the_stream_starts(ngram_server):
    """A streaming client that hangs up right after sending its request, before any response byte,
    still has its request aborted and its pages freed."""
    url, model = ngram_server.url, ngram_server.state.names[0]
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    before = metric(scrape(url), "dspark:request_success_total", finished_reason="abort") or 0
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    idle = lambda: (m := scrape(url)) and metric(m, "dspark:num_requests_running") == 0 and \
        metric(m, "dspark:request_success_total", finished_reason="abort") == before + 1
    assert wait_for(idle, 15), "the request kept running after its client left"
    assert ngram_server.state.engine.pool.num_free == ngram_server.state.engine.pool.num_pages


def test_metrics_consistent_with_responses(ngram_server):
    client, url, model = ngram_server.openai(), ngram_server.url, ngram_server.state.names[0]
    seen = []  # (prompt tokens, completion tokens, finish reason, speculation)
    for kwargs in ({}, {"extra_body": {"speculation": {"enabled": False}}}, {"stop": [","]},
                   {"extra_body": {"speculation": {"block_size": 2}}}):
        out = client.completions.create(model=model, prompt=REPEAT, temperature=0, max_tokens=24, **kwargs)
        seen.append((out.usage.prompt_tokens, out.usage.completion_tokens, out.choices[0].finish_reason,
                     _spec(out)))
    spec = usage = finish = None
    for chunk in client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=20,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].finish_reason:
            spec, finish = _spec(chunk), chunk.choices[0].finish_reason
        usage = chunk.usage or usage
    seen.append((usage.prompt_tokens, usage.completion_tokens, finish, spec))
    assert seen[2][2] == "stop"
    assert len(seen[3][3]["verified_per_pos"]) <= 2  # block_size 2 for that request

    m = scrape(url)
    total = lambda key: sum(s[3][key] for s in seen)
    assert metric(m, "dspark:prompt_tokens_total") == sum(s[0] for s in seen)
    assert metric(m, "dspark:generation_tokens_total") == sum(s[1] for s in seen)
    for reason in ("stop", "length"):
        assert metric(m, "dspark:request_success_total", finished_reason=reason) == \
            sum(s[2] == reason for s in seen)
    assert metric(m, "dspark:spec_decode_num_drafts_total") == total("steps")
    assert metric(m, "dspark:spec_decode_num_draft_tokens_total") == total("proposed")
    assert metric(m, "dspark:spec_decode_num_verified_tokens_total") == total("verified")
    assert metric(m, "dspark:spec_decode_num_accepted_tokens_total") == total("accepted") > 0
    assert metric(m, "dspark:spec_decode_num_lookup_drafts_total") == total("lookup_steps")
    assert metric(m, "dspark:spec_decode_num_lookup_accepted_tokens_total") == total("lookup_accepted")
    for pos in range(max(len(s[3]["accepted_per_pos"]) for s in seen)):
        assert metric(m, "dspark:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == \
            sum(s[3]["accepted_per_pos"][pos] for s in seen if pos < len(s[3]["accepted_per_pos"]))
    # tau over the window = committed tokens per target pass, over all of these requests
    tau = sum(s[3]["tau"] * s[3]["steps"] for s in seen) / total("steps")
    assert math.isclose(metric(m, "dspark:spec_decode_mean_acceptance_length"), tau, rel_tol=1e-3)
    assert tau > 1
    assert metric(m, "dspark:generation_tokens_per_second") > 0
    n = len(seen)
    assert metric(m, "dspark:time_to_first_token_seconds_count") == n
    assert metric(m, "dspark:e2e_request_latency_seconds_count") == n
    # one inter-token latency per token after each request's first
    assert metric(m, "dspark:inter_token_latency_seconds_count") == sum(s[1] for s in seen) - n
    assert metric(m, "dspark:num_requests_running") == metric(m, "dspark:num_requests_waiting") == 0
    assert metric(m, "dspark:kv_cache_usage_perc") == 0
    assert metric(m, "dspark:num_preemptions_total") == 0


def test_min_tokens_hold_off_eos(server):
    """A short greedy chat answer ends with EOS; min_tokens makes it go on, and usage counts it."""
    client, model = server.openai(), server.state.names[0]
    short = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                           temperature=0, max_tokens=64)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 40
    held = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                          temperature=0, max_tokens=64, extra_body={"min_tokens": n + 8})
    assert held.usage.completion_tokens >= n + 8
    assert held.choices[0].message.content.startswith(short.choices[0].message.content)


def test_penalties_same_with_and_without_speculation(engines):
    """Greedy decoding of REPEAT repeats its pattern; penalties over HTTP break it, with the same
    text on both servers (the engine tests check verified drafts under penalties)."""
    texts = {}
    for name in ("none", "ngram"):
        with serve(engines[name]) as s:
            client, model = s.openai(), s.state.names[0]
            plain = client.completions.create(model=model, prompt=REPEAT, temperature=0, max_tokens=24)
            pen = client.completions.create(model=model, prompt=REPEAT, temperature=0, max_tokens=24,
                                            frequency_penalty=1.0, presence_penalty=0.5,
                                            extra_body={"repetition_penalty": 1.3})
            texts[name] = pen.choices[0].text
            assert plain.choices[0].text.count("one") > texts[name].count("one")
    assert texts["none"] == texts["ngram"]


def test_echo_puts_the_prompt_before_the_completion(server):
    client, model = server.openai(), server.state.names[0]
    plain = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
    echoed = client.completions.create(model=model, prompt=PROMPT, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text and echoed.usage == plain.usage
    chunks = list(client.completions.create(model=model, prompt=PROMPT, echo=True, stream=True, **GREEDY))
    assert chunks[0].choices[0].text == PROMPT  # the prompt comes first, on its own
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    ids = server.state.engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    by_ids = client.completions.create(model=model, prompt=ids, echo=True, **GREEDY)
    assert by_ids.choices[0].text == server.state.engine.tokenizer.decode(ids) + plain.choices[0].text


def test_n_choices(ngram_server):
    """n seeded samples: n choices indexed 0..n-1, each the single request seeded seed + i, usage
    and speculation counters over all of them, and a stream whose chunks per index add up to them."""
    s = ngram_server
    body = {"model": s.state.names[0], "prompt": PROMPT, "temperature": 1.0, "seed": 7, "max_tokens": 8, "n": 3}
    outs = [httpx.post(s.url + "/v1/completions", json=body, timeout=120).json() for _ in range(2)]
    choices = outs[0]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and outs[1]["choices"] == choices
    assert len({c["text"] for c in choices}) > 1  # seed, seed + 1, seed + 2
    # choice i is the single request with seed 7 + i
    singles = [httpx.post(s.url + "/v1/completions", json={**body, "n": 1, "seed": 7 + i}, timeout=120).json()
               for i in range(3)]
    assert [c["text"] for c in choices] == [one["choices"][0]["text"] for one in singles]
    assert outs[0]["usage"]["completion_tokens"] == sum(one["usage"]["completion_tokens"] for one in singles)
    assert outs[0]["speculation"]["steps"] == sum(one["speculation"]["steps"] for one in singles)
    status, data = stream_raw(s.url, "/v1/chat/completions", {
        "model": s.state.names[0], "messages": [{"role": "user", "content": "Hi"}], "temperature": 1.0, "seed": 3,
        "max_tokens": 8, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    full = httpx.post(s.url + "/v1/chat/completions", json={
        "model": s.state.names[0], "messages": [{"role": "user", "content": "Hi"}], "temperature": 1.0, "seed": 3,
        "max_tokens": 8, "n": 2}, timeout=120).json()
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in mine) == full["choices"][i]["message"]["content"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [full["choices"][i]["finish_reason"]]
    assert chunks[-1]["usage"] == full["usage"]


def test_continuous_usage_stats(ngram_server):
    s = ngram_server
    body = {"model": s.state.names[0], "messages": [{"role": "user", "content": "Hi"}], "temperature": 1.0,
            "seed": 5, "max_tokens": 8, "n": 2}
    full = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120).json()
    opts = {"include_usage": True, "continuous_usage_stats": True}
    status, data = stream_raw(s.url, "/v1/chat/completions", {**body, "stream": True, "stream_options": opts})
    assert status == 200 and data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    prompt = full["usage"]["prompt_tokens"]  # one prompt, counted once
    finals = []
    for i in (0, 1):  # each choice's chunks carry its own usage so far, from 0 at the role chunk
        counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert counts[0] == 0 and counts == sorted(counts) and counts[-1] > 0
        finals.append(counts[-1])
    assert all(c["usage"]["prompt_tokens"] == prompt and c["usage"]["total_tokens"] == prompt +
               c["usage"]["completion_tokens"] for c in chunks[:-1])
    assert sum(finals) == full["usage"]["completion_tokens"] and chunks[-1]["usage"] == full["usage"]
    # without include_usage it asks for nothing (vLLM's rule); null is false
    for opts in ({"continuous_usage_stats": True}, {"include_usage": None, "continuous_usage_stats": None}):
        status, data = stream_raw(s.url, "/v1/chat/completions", {**body, "stream": True, "stream_options": opts})
        assert status == 200 and all("usage" not in json.loads(d) for d in data[:-1])


def test_a_client_gone_while_queued_is_dropped_unprefilled(engines):
    """Both slots of the 2-sequence engine busy, a third streamed request waits; its client leaves
    before any token: the request is aborted from the queue (the gauge follows at once), never
    prefilled (the prompt-token counter does not move), and the slots' requests go on."""
    import contextlib

    with serve(engines["none"]) as s:
        url, model = s.url, s.state.names[0]
        # two requests long enough to hold both slots for the test (the pool holds 4096 tokens)
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1800, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with contextlib.ExitStack() as busy:
            readers = []  # kept: a dropped line iterator closes its connection
            for _ in range(2):
                r = busy.enter_context(httpx.stream("POST", url + "/v1/completions", json=body, timeout=60))
                readers.append(r.iter_lines())
                next(line for line in readers[-1] if line.startswith("data: "))
            waiting = lambda: metric(scrape(url), "dspark:num_requests_waiting") == 1  # noqa: E731
            third = {**body, "prompt": REPEAT, "max_tokens": 8}
            with httpx.stream("POST", url + "/v1/completions", json=third, timeout=60):
                assert wait_for(waiting, 10), "the third request is not waiting"
                prompt_tokens = metric(scrape(url), "dspark:prompt_tokens_total")
            gone = lambda: metric(scrape(url), "dspark:num_requests_waiting") == 0  # noqa: E731
            assert wait_for(gone, 3), "the queued request outlived its client"
            samples = scrape(url)
            assert metric(samples, "dspark:prompt_tokens_total") == prompt_tokens
            assert metric(samples, "dspark:request_success_total", finished_reason="abort") == 1
            assert metric(samples, "dspark:num_requests_running") == 2
        assert wait_for(lambda: s.state.engine.pool.num_free == s.state.engine.pool.num_pages, 10)
