"""What lm-evaluation-harness asks of a completions server, and vLLM's prompt_logprobs: batched
prompts (one choice per prompt, times n), echo with logprobs (the prompt's tokens scored before
the completion's, streamed or not), logit_bias and allowed_token_ids over HTTP."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_helpers import serve, shared_engine_or_skip, stream_raw

from dspark.config import SamplingParams
from dspark.engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("single_thread")

TEXTS = ["The capital of France is", "Two plus two equals"]


@pytest.fixture(scope="module")
def server():
    with serve(shared_engine_or_skip("ngram")) as s:
        yield s


def _post(s, body: dict) -> dict:
    r = httpx.post(s.url + "/v1/completions", json={"model": s.state.names[0], **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _direct_logprobs(engine, ids: list[int]) -> torch.Tensor:  # noqa: ANN001 - the server's Engine
    """log_softmax of the engine's model over ids, one prefill pass run here, outside the server's
    request path (row i scores token i + 1): a reference independent of how the server collects
    prompt logprobs and renders them. Run between requests, while the scheduler's thread is idle."""
    seq = Sequence(seq_id=10**9, request_id="direct-probe", prompt_ids=ids, params=SamplingParams(),
                   generator=None, eos_ids=frozenset())
    engine.pool.reserve(seq.seq_id, len(ids))
    try:
        with torch.inference_mode():
            # prompt_rows: the quantized linears take their prompt path where a prefill of this
            # prompt would (a short one takes the decode kernels: prompt_gemm_min_tokens)
            rows = 0 if engine.prompt_on_decode_kernels(len(ids)) else len(ids)
            logits = engine.runner.forward([(seq, ids)], list(range(len(ids))), prompt_rows=[rows]).logits
    finally:
        engine.pool.free(seq.seq_id)
    return torch.log_softmax(logits.float(), -1)


def test_loglikelihood_request_as_lm_eval_sends_it(server):
    """Token-id prompts in a batch, echo, logprobs 1, max_tokens 1: each choice scores its prompt's
    tokens (the first with null), then the generated one; a prompt extended by that token scores
    it as the first request's output did."""
    tok = server.state.engine.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    out = _post(server, body)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 2,
                            "total_tokens": sum(map(len, prompts)) + 2}
    for ids, choice in zip(prompts, out["choices"]):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][:len(ids)] == [tok.decode([t]) for t in ids]
        assert choice["text"] == tok.decode(ids) + lp["tokens"][-1]
        for t, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
            assert v <= 0 and top[t] == v and 1 <= len(top) <= 2  # the token and its best alternative
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())  # greedy
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids) + 1)]
    # the generated token, appended to the prompt, is scored as the output scored it
    first = out["choices"][0]["logprobs"]
    next_id = tok.encode(out["choices"][0]["text"])[len(prompts[0]):]
    again = _post(server, {**body, "prompt": [prompts[0] + next_id]})["choices"][0]["logprobs"]
    assert again["tokens"][len(prompts[0])] == first["tokens"][-1]
    assert again["token_logprobs"][len(prompts[0])] == pytest.approx(first["token_logprobs"][-1], abs=0.05)


def test_batched_prompts_with_n_equal_single_requests(server):
    body = {"max_tokens": 8, "temperature": 0, "n": 2}
    out = _post(server, {**body, "prompt": TEXTS})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    singles = [_post(server, {**body, "prompt": t, "n": 1}) for t in TEXTS]
    texts = [c["text"] for c in out["choices"]]
    assert texts == [singles[0]["choices"][0]["text"]] * 2 + [singles[1]["choices"][0]["text"]] * 2
    assert out["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert out["usage"]["completion_tokens"] == 2 * sum(s["usage"]["completion_tokens"] for s in singles)


def test_streamed_echo_with_logprobs_adds_up_to_the_whole(server):
    body = {"model": server.state.names[0], "prompt": TEXTS, "max_tokens": 6, "temperature": 0, "echo": True,
            "logprobs": 2}
    whole = _post(server, body)
    status, data = stream_raw(server.url, "/v1/completions", {**body, "stream": True})
    assert status == 200 and data[-1] == "[DONE]"
    chunks = [c for d in data[:-1] for c in json.loads(d)["choices"]]
    for choice in whole["choices"]:
        mine = [c for c in chunks if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[0]["text"].startswith(TEXTS[choice["index"]])  # the echo leads the first chunk
        parts = [c["logprobs"] for c in mine if c["logprobs"]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for p in parts for x in p[key]] == choice["logprobs"][key], key


def test_vllm_prompt_logprobs_field(server):
    out = _post(server, {"prompt": TEXTS[0], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1})
    ids = server.state.engine.tokenizer.encode(TEXTS[0])
    plp = out["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = _direct_logprobs(server.state.engine, ids)
    for row, tok, entry in zip(ref, ids[1:], plp[1:]):
        assert str(tok) in entry and 1 <= len(entry) <= 2
        assert entry[str(tok)]["logprob"] == pytest.approx(float(row[tok]), abs=2e-3)
        x = row[tok]  # its rank among the whole vocabulary, up to near ties
        assert int((row > x + 2e-3).sum()) + 1 <= entry[str(tok)]["rank"] <= int((row > x - 2e-3).sum()) + 1
        [best] = [int(t) for t, v in entry.items() if v["rank"] == 1]  # the top alternative: the argmax
        assert float(row[best]) == pytest.approx(float(row.max()), abs=2e-3)
    assert out["choices"][0]["logprobs"] is None
    echoed = _post(server, {"prompt": TEXTS[0], "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 0})
    values = echoed["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]
    assert values == [entry[str(tok)]["logprob"] for tok, entry in zip(ids[1:], plp[1:])]


def test_logit_bias_and_allowed_token_ids_over_http(server):
    tok = server.state.engine.tokenizer
    prompt = tok.encode(TEXTS[1])
    base = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    free = _post(server, {**base, "echo": True, "logprobs": 0})["choices"][0]
    first = tok.encode(free["text"])[len(prompt)]  # the token the model writes first
    banned = _post(server, {**base, "echo": True, "logit_bias": {str(first): -100}})["choices"][0]
    assert banned["text"] != free["text"] and tok.encode(banned["text"])[len(prompt)] != first
    allowed = [tok.convert_tokens_to_ids(t) for t in ("=", ">")]
    only = _post(server, {**base, "allowed_token_ids": allowed})["choices"][0]["text"]
    assert set(only) <= {"=", ">"} and len(only) == 4
