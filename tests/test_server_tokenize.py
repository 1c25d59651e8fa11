"""POST /tokenize and /detokenize (vLLM's shapes): the ids are the ones generation runs, the text
comes back, and bad input is a 400 that names the field."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import error_of, serve, shared_engine_or_skip

pytestmark = pytest.mark.usefixtures("single_thread")
TEXT = "Speculative decoding keeps the target's output: déjà vu, 東京."
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server():
    with serve(shared_engine_or_skip("ngram")) as s:
        yield s


def _post(s, path: str, body: dict, status: int = 200, **kw) -> dict:
    r = httpx.post(s.url + path, json=body, timeout=60, **kw)
    assert r.status_code == status, r.text
    return r.json() if status == 200 else error_of(r)


def test_text_round_trip(server):
    tok = server.state.engine.tokenizer
    out = _post(server, "/tokenize", {"prompt": TEXT})
    assert out["tokens"] == tok.encode(TEXT) and out["count"] == len(out["tokens"]) > 5
    assert out["max_model_len"] == server.state.engine.max_model_len and out["token_strs"] is None
    strs = _post(server, "/tokenize", {"prompt": TEXT, "return_token_strs": True})["token_strs"]
    assert strs == tok.convert_ids_to_tokens(out["tokens"])
    assert _post(server, "/detokenize", {"tokens": out["tokens"]}) == {"prompt": TEXT}
    assert _post(server, "/detokenize", {"tokens": []}) == {"prompt": ""}
    assert _post(server, "/tokenize", {"prompt": TEXT, "messages": None})["tokens"] == out["tokens"]


def test_chat_counts_what_chat_completions_runs(server):
    name = server.state.names[0]
    out = _post(server, "/tokenize", {"model": name, "messages": MSGS})
    chat = _post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, "temperature": 0})
    assert out["count"] == chat["usage"]["prompt_tokens"]
    text = _post(server, "/detokenize", {"tokens": out["tokens"]})["prompt"]
    tok = server.state.engine.tokenizer
    assert text == tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    bare = _post(server, "/tokenize", {"messages": MSGS, "add_generation_prompt": False})
    assert bare["count"] < out["count"] and out["tokens"][:bare["count"]] == bare["tokens"]
    special = _post(server, "/tokenize", {"messages": MSGS, "add_special_tokens": True})
    assert special["tokens"] == tok.encode(text, add_special_tokens=True)


BAD = [
    ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 7}, "prompt"),
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, "return_token_strs"),
    ("/tokenize", {"messages": []}, "messages"), ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]},
                                                  "messages.0.role"),
    ("/tokenize", {"messages": MSGS, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": MSGS, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/detokenize", {}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"), ("/detokenize", {"tokens": ["a"]}, "tokens.0"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    err = _post(server, path, body, status=400)
    assert err["param"] == param and err["code"] == 400 and err["type"] == "invalid_request_error"


def test_not_json_unknown_model_and_api_key(server):
    r = httpx.post(server.url + "/tokenize", content=b"{oops", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in error_of(r)["message"]
    assert _post(server, "/detokenize", {"model": "gpt-5", "tokens": [1]}, status=404)["param"] == "model"
    server.state.api_key = "secret"
    try:
        assert _post(server, "/tokenize", {"prompt": "hi"}, status=401)["type"] == "authentication_error"
        assert _post(server, "/detokenize", {"tokens": [1]}, status=401)["type"] == "authentication_error"
        ok = _post(server, "/tokenize", {"prompt": "hi"}, headers={"Authorization": "Bearer secret"})
        assert ok["tokens"] == server.state.engine.tokenizer.encode("hi")
    finally:
        server.state.api_key = None
