"""The server against its own OpenAPI schema (schemathesis, in-process over ASGI: every operation,
positive and negative bodies, no 5xx, responses as documented) and against hostile input over a
real keep-alive connection: JSON nested 100,000 deep, chat_template_kwargs nested 5,000 deep, a
lone UTF-16 surrogate on every route, and a bug (a JSON 500 with a request id, logged once, the
connection still serving); the KV cache is empty afterwards."""

from __future__ import annotations

import logging
import time
from collections import Counter

import httpx
import pytest
from server_helpers import error_of, serve, wait_for
from spec_helpers import make_engine, save_tiny_target

from dspark.server.app import create_app
from dspark.server.body import MAX_JSON_DEPTH

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402 - schemathesis brings hypothesis
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode, checks  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]
CHEAP = 3  # tokens a generated request may ask for (larger sizes within the context are cut to this)
CASES: Counter = Counter()  # schemathesis cases run per operation
STATUSES: Counter = Counter()  # (POST path, status) of those cases
ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """A tiny random Llama with SmolLM2's tokenizer (see spec_helpers)."""
    return save_tiny_target(tmp_path_factory.mktemp("schema") / "target")


def _engine(target: str):  # noqa: ANN202 - an Engine
    return make_engine(target, "ngram", kv_cache_tokens=2048, max_num_seqs=4)


# the schema does not depend on the engine: an app that never starts (no lifespan, no model) gives it
schema = schemathesis.openapi.from_dict(create_app().openapi())


@pytest.fixture(scope="module")
def app(target):
    """The app the generated requests reach over ASGI (schemathesis starts its lifespan)."""
    app = create_app(_engine(target), max_queue=4)
    start = time.perf_counter()
    yield app
    print(f"\nschemathesis: {sum(CASES.values())} cases in {time.perf_counter() - start:.1f}s; "
          f"POST (path, status): {dict(sorted(STATUSES.items()))}")


def _cheap(body: object) -> None:
    """Cut what a generated body asks for to CHEAP tokens (sizes within the context, or none: up to
    the context), so every case costs a few steps of the tiny model; larger sizes stay, to be refused."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(key)
        if type(value) is int and CHEAP < value <= 4096:
            body[key] = CHEAP
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = CHEAP


# one pytest id per operation (schema.parametrize's items all share one node id, which pytest-xdist
# collapses into a single test: the other operations never ran there)
OPERATIONS = {f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in schema.get_all_operations())}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_every_operation_keeps_to_its_schema(app, operation: str) -> None:
    op = OPERATIONS[operation]
    cases = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case) -> None:  # noqa: ANN001
        _cheap(case.body)
        response = case.call_and_validate(app=app, checks=CHECKS)
        CASES[f"{case.method} {case.path}"] += 1
        if case.method == "POST":
            STATUSES[case.path, response.status_code] += 1

    run()


def test_generated_requests_reached_the_engine(app):
    """Every POST operation answered some generated bodies with 200, not only with 400s; none of
    them left pages behind in the KV cache."""
    if not CASES:
        pytest.skip("the schemathesis test did not run")
    for path in ROUTES:
        assert STATUSES[path, 200] > 0, STATUSES
    state = app.state.dspark
    pool = state.engine.pool
    assert wait_for(lambda: state.scheduler.num_active == 0 and pool.num_free == pool.num_pages), (
        pool.num_free, pool.num_pages)


# ------------------------------------------------------------------ hostile input, keep-alive


@pytest.fixture(scope="module")
def server(target):
    with serve(_engine(target), max_queue=4) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    """One keep-alive connection for every hostile request (a pool of one)."""
    with httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=1)) as c:
        yield c


def _peer(r: httpx.Response) -> object:
    """The local address of the connection that carried r."""
    return r.extensions["network_stream"].get_extra_info("client_addr")


def _post_raw(client: httpx.Client, path: str, raw: bytes, **kw) -> httpx.Response:
    return client.post(path, content=raw, headers={"content-type": "application/json"}, **kw)


@pytest.mark.parametrize("path", ROUTES)
def test_deep_array_is_a_400(client, path):
    r = _post_raw(client, path, b"[" * 100_000)
    assert r.status_code == 400, r.text
    assert f"more than {MAX_JSON_DEPTH} levels deep" in error_of(r)["message"]
    assert r.headers["x-request-id"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_deep_chat_template_kwargs_name_the_field(client, path):
    deep = '{"x": ' * 5000 + "1" + "}" * 5000
    raw = f'{{"messages": [{{"role": "user", "content": "Hi"}}], "chat_template_kwargs": {deep}}}'.encode()
    r = _post_raw(client, path, raw)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "chat_template_kwargs" and "levels deep" in err["message"]
    ok = '{"x": ' * 40 + "1" + "}" * 40  # within the limit: rendered as usual
    raw = f'{{"messages": [{{"role": "user", "content": "Hi"}}], "max_tokens": 2, "chat_template_kwargs": {ok}}}'
    assert _post_raw(client, path, raw.encode()).status_code == 200


SURROGATES = [
    ("/v1/completions", b'{"prompt": "one \\ud800 two", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["fine", "\\udfff"], "max_tokens": 2}', "prompt.1"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}',
     "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "stop": ["\\ud83d"]}', "stop.0"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages.0.content.0.text"),
    ("/detokenize", b'{"tokens": [1, 2], "model": "\\ud800"}', "model"),
]


@pytest.mark.parametrize(("path", "raw", "param"), SURROGATES)
def test_lone_surrogate_is_a_400_naming_the_field(client, path, raw, param):
    r = _post_raw(client, path, raw)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and "surrogate" in err["message"], err


def test_surrogate_pairs_are_text(client):
    r = _post_raw(client, "/tokenize", b'{"prompt": "smile \\ud83d\\ude00"}')
    assert r.status_code == 200, r.text
    assert client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"].endswith("\U0001f600")


def test_a_bug_is_a_json_500_with_a_request_id_and_the_connection_serves_on(client, monkeypatch, caplog):
    from dspark.server import choices

    def broken(*args, **kwargs):
        raise RuntimeError("induced")

    body = {"prompt": "The sky is", "max_tokens": 3}
    first = client.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text
    monkeypatch.setattr(choices.ChoiceRenderer, "body", broken)
    with caplog.at_level(logging.ERROR, logger="dspark.server"):
        r = client.post("/v1/completions", json=body, headers={"x-request-id": "client-id-42"})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    err = error_of(r)
    assert err["type"] == "internal_server_error" and "client-id-42" in err["message"] and "induced" in err["message"]
    assert r.headers["x-request-id"] == "client-id-42"
    logged = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(logged) == 1 and "client-id-42" in logged[0].getMessage(), [x.getMessage() for x in logged]
    monkeypatch.undo()
    after = client.post("/v1/completions", json=body)
    assert after.status_code == 200 and _peer(after) == _peer(r) == _peer(first)  # the same connection
    assert after.headers["x-request-id"] not in ("", r.headers["x-request-id"])  # a fresh id when none is sent


def test_a_bug_in_tokenize_is_a_json_500_too(client, monkeypatch):
    from dspark.server import tokenization

    def broken(*args, **kwargs):
        raise TypeError("induced in tokenize")

    monkeypatch.setattr(tokenization, "_tokenize", broken)
    r = client.post("/tokenize", json={"prompt": "Hi"})
    assert r.status_code == 500 and r.headers["x-request-id"] in error_of(r)["message"]
    monkeypatch.undo()
    after = client.post("/tokenize", json={"prompt": "Hi"})
    assert after.status_code == 200 and _peer(after) == _peer(r)


def test_a_bug_in_a_stream_ends_it_with_an_error_event(client, monkeypatch):
    from dspark.server import choices

    def broken(*args, **kwargs):
        raise RuntimeError("induced in a chunk")

    monkeypatch.setattr(choices.ChoiceRenderer, "chunk", broken)
    r = client.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert r.headers["x-request-id"] in r.text and "induced in a chunk" in r.text


def test_hostile_input_leaves_the_kv_cache_empty(server, client):
    pool = server.state.engine.pool
    assert client.post("/v1/completions", json={"prompt": "Again", "max_tokens": 2}).status_code == 200
    assert wait_for(lambda: server.state.scheduler.num_active == 0 and pool.num_free == pool.num_pages), (
        pool.num_free, pool.num_pages)
