"""Function calling: tools and tool_choice ("required", a named function, "none") on the chat API,
whole and streamed, through httpx and the openai client; the refusals name the field at fault."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import error_of, serve, shared_engine_or_skip, sse_data

pytestmark = pytest.mark.usefixtures("single_thread")
pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server():
    with serve(shared_engine_or_skip("ngram")) as s:
        yield s


def _post(s, body: dict, stream: bool = False) -> httpx.Response:
    return httpx.post(s.url + "/v1/chat/completions", json={
        "model": s.state.names[0], "messages": ASK, "temperature": 0, "max_tokens": 64, "stream": stream,
        **body}, timeout=120)


def _weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("C", "F"), args
    return args


def test_named_function_call(server):
    r = _post(server, {"tools": [WEATHER, TIME], "tool_choice": NAMED})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert msg["content"] is None and choice["finish_reason"] == "stop"
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    _weather_args(call["function"]["arguments"])
    plain = _post(server, {"tools": [WEATHER, TIME], "tool_choice": NAMED, "speculation": {"enabled": False}})
    assert plain.json()["choices"][0]["message"]["tool_calls"][0]["function"] == call["function"]


def test_named_function_call_streams_its_arguments(server):
    whole = _post(server, {"tools": [WEATHER], "tool_choice": NAMED}).json()["choices"][0]["message"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={
            "model": server.state.names[0], "messages": ASK, "temperature": 0, "max_tokens": 64, "stream": True,
            "tools": [WEATHER], "tool_choice": NAMED}, timeout=120) as r:
        assert r.status_code == 200
        events = sse_data(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert len(calls) > 1  # streamed in pieces
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in c and "name" not in c["function"] and c["index"] == 0 for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == whole["tool_calls"][0]["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any(d.get("content") for d in deltas)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_choice(server, stream):
    body = {"tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 96}
    if not stream:
        r = _post(server, body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
        assert choice["message"]["content"] is None
    else:
        r = _post(server, body, stream=True)
        assert r.status_code == 200, r.text
        events = [json.loads(e) for e in sse_data(r.text.splitlines()) if e != "[DONE]"]
        deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls") or []]
        assert len(deltas) > 2  # a call's name first, then its arguments in pieces
        calls = []
        for d in deltas:
            if "id" in d:
                assert d["index"] == len(calls)
                calls.append({"function": dict(d["function"])})
            else:
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
        finish = events[-1]["choices"][0]["finish_reason"]
        whole = _post(server, body).json()["choices"][0]["message"]["tool_calls"]
        assert [c["function"] for c in calls] == [c["function"] for c in whole]
    assert finish == "tool_calls" and calls
    for call in calls:
        assert call["function"]["name"] in ("get_weather", "get_time")
        args = json.loads(call["function"]["arguments"])
        assert set(args) == ({"city", "unit"} if call["function"]["name"] == "get_weather" else {"zone"})


def test_one_call_when_parallel_calls_are_off(server):
    r = _post(server, {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False,
                       "max_tokens": 96})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 1


def test_tool_choice_none_answers_in_text(server):
    r = _post(server, {"tools": [WEATHER], "tool_choice": "none", "max_tokens": 8})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert isinstance(msg["content"], str) and msg["content"] and "tool_calls" not in msg


def test_a_conversation_with_earlier_tool_calls(server):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = _post(server, {"messages": messages, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 8})
    assert r.status_code == 200, r.text


def test_required_with_shared_definitions(server):
    """Pydantic-made schemas keep their types under $defs; "required" nests each function's
    parameters inside a list, so the references must still resolve."""
    person = {"$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}},
                                   "required": ["name"], "additionalProperties": False}},
              "type": "object", "properties": {"who": {"$ref": "#/$defs/Person"}}, "required": ["who"],
              "additionalProperties": False}
    greet = {"type": "function", "function": {"name": "greet", "parameters": person}}
    # greet alone: "required" must call it (with get_time beside it the model could pick that and
    # skip the check); its parameters still sit in the list of calls, so the $ref still moves
    r = _post(server, {"tools": [greet], "tool_choice": "required", "max_tokens": 96})
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "greet" for c in calls), calls
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        assert set(args) == {"who"} and set(args["who"]) == {"name"} and isinstance(args["who"]["name"], str), args


def test_required_hoists_draft07_definitions(server):
    """Older generators (pydantic v1, zod-to-json-schema) keep shared types under "definitions":
    they move to the list schema's root as $defs do."""
    person = {"definitions": {"Person": {"type": "object", "properties": {"name": {"type": "string"}},
                                         "required": ["name"], "additionalProperties": False}},
              "type": "object", "properties": {"who": {"$ref": "#/definitions/Person"}}, "required": ["who"],
              "additionalProperties": False}
    greet = {"type": "function", "function": {"name": "greet", "parameters": person}}
    r = _post(server, {"tools": [greet], "tool_choice": "required", "max_tokens": 96})
    assert r.status_code == 200, r.text
    [call] = r.json()["choices"][0]["message"]["tool_calls"][:1]
    assert isinstance(json.loads(call["function"]["arguments"])["who"]["name"], str)


def test_required_refuses_references_it_cannot_keep(server):
    """A reference from the parameters' root to anywhere but its definitions would point into the
    list's schema under "required": a 400 naming the function and the reference, not a 500."""
    same = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
            "required": ["a", "b"]}
    tools = [{"type": "function", "function": {"name": "pair", "parameters": same}}]
    r = _post(server, {"tools": tools, "tool_choice": "required"})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "tools" and "'pair'" in err["message"] and "#/properties/a" in err["message"], err
    bad = {"type": "object", "$defs": ["not", "an", "object"]}
    r = _post(server, {"tools": [{"type": "function", "function": {"name": "odd", "parameters": bad}}],
                       "tool_choice": "required"})
    assert r.status_code == 400 and error_of(r)["param"] == "tools", r.text
    # a named function keeps its parameters as the root, where the same reference resolves
    r = _post(server, {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "pair"}}})
    assert r.status_code == 200, r.text


def test_a_named_call_cut_short_is_still_a_call(server):
    r = _post(server, {"tools": [WEATHER], "tool_choice": NAMED, "max_tokens": 4})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["function"]["arguments"].startswith("{")


def test_history_arguments_as_vllm_takes_them(server):
    for arguments in ("", {"city": "Paris", "unit": "C"}, None):
        messages = ASK + [{"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
        r = _post(server, {"messages": messages, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 4})
        assert r.status_code == 200, (arguments, r.text)


def test_auto_without_tools_is_off(server):
    r = _post(server, {"tool_choice": "auto", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert "tool_calls" not in r.json()["choices"][0]["message"]


def test_openai_client_reads_the_tool_call(server):
    pytest.importorskip("openai")
    out = server.openai().chat.completions.create(
        model=server.state.names[0], messages=ASK, temperature=0, max_tokens=64, tools=[WEATHER, TIME],
        tool_choice=NAMED)
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    _weather_args(call.function.arguments)


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto" by default, which needs a parser
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer"}}}],
      "tool_choice": "none"}, "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "none"},
     "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}],
      "tool_choice": "none"}, "messages.1.tool_calls.0.function.arguments"),
])
def test_bad_tool_requests_are_refused(server, body, param):
    r = _post(server, body)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param
    if body.get("tool_choice") == {"type": "function", "function": {}}:
        assert "function.name" in error_of(r)["message"]


def test_completions_take_no_tools(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": server.state.names[0], "prompt": "Hi",
                                                         "tools": [WEATHER]}, timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == "tools"


def test_the_template_sees_the_tools():
    from dspark.engine.prompts import ChatPrompt, encode_prompt
    from dspark.models.loader import ModelLoadError, load_tokenizer, resolve_model_folder

    try:
        tok = load_tokenizer(resolve_model_folder(None))
    except ModelLoadError as e:
        pytest.skip(f"default model unavailable: {e}")
    tok.chat_template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}")
    ids = encode_prompt(tok, len(tok), ChatPrompt(ASK, tools=[WEATHER, TIME]))
    assert tok.decode(ids).startswith("[get_weather][get_time]What is the weather")


def test_required_cut_short_streams_a_partial_call_and_says_length(server):
    """Streamed, a "required" call goes out as it is written, so an output cut by max_tokens has
    sent part of one: finish_reason says "length", as it does for the whole response (text)."""
    body = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 12}
    r = _post(server, body, stream=True)
    events = [json.loads(e) for e in sse_data(r.text.splitlines()) if e != "[DONE]"]
    deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas and deltas[0]["function"]["name"] == "get_weather"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    choice = _post(server, body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("[")
