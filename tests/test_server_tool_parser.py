"""tool_choice "auto" with the tool-call parsers (hermes, llama3_json): each on hand-written outputs
(whole and fed in many chunkings), then through a server started with it, the model's text held to
a tool call by a regex so that the test knows what it writes."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from server_helpers import error_of, serve, shared_engine_or_skip, sse_data

from dspark.server.tool_parsers import HermesParser, Llama3JsonParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
OUTPUTS = [
    "No tools needed: it is sunny.",
    "Let me check. " + CALL,
    CALL + "\n" + CALL.replace("Paris", "Rome"),
    CALL[:-len("</tool_call>")],  # cut by max_tokens after the JSON
    "Text <tool_call>{not json}</tool_call> more",
    "a < b and <tool but no call",
]
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}'
LLAMA_OUTPUTS = [
    "No tools needed: it is sunny.",
    LLAMA_CALL,
    "<|python_tag|>" + LLAMA_CALL + "; " + LLAMA_CALL.replace("Paris", "Rome"),
    "  \n" + LLAMA_CALL,
    LLAMA_CALL[:-1],  # cut by max_tokens: not a call
    '{"just": "json"}',
    "<|python_ta",
]
CASES = [(HermesParser, t) for t in OUTPUTS] + [(Llama3JsonParser, t) for t in LLAMA_OUTPUTS]


def _stream(parser, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    s, content, calls, at = parser.stream(), "", [], 0
    for cut in cuts + [len(text)]:
        piece, at = text[at:cut], cut
        c, k = s.feed(piece, final=cut == len(text))
        content, calls = content + c, calls + k
    return content, calls


def _fn(calls: list[dict] | None) -> list[dict] | None:
    return None if calls is None else [c["function"] for c in calls]


@pytest.mark.parametrize("kind,text", CASES)
def test_streamed_parse_equals_the_whole_one(kind, text):
    parser = kind()
    content, calls = parser.split(text)
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
        s_content, s_calls = _stream(parser, text, cuts)
        if calls is None:
            assert s_content == text and not s_calls
        else:
            assert _fn(s_calls) == _fn(calls)
            assert s_content == (content or "")


def test_parsed_calls():
    split_tool_calls = HermesParser().split
    content, calls = split_tool_calls(OUTPUTS[1])
    assert content == "Let me check. "
    assert _fn(calls) == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}]
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"
    content, calls = split_tool_calls(OUTPUTS[2])
    assert content is None and [json.loads(f["arguments"])["city"] for f in _fn(calls)] == ["Paris", "Rome"]
    content, calls = split_tool_calls(OUTPUTS[3])  # an open last block still parses, whole
    assert content is None and _fn(calls) == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}]
    assert split_tool_calls(OUTPUTS[4]) == (OUTPUTS[4], None)
    llama = Llama3JsonParser().split
    content, calls = llama(LLAMA_OUTPUTS[2])
    assert content is None and [json.loads(f["arguments"])["city"] for f in _fn(calls)] == ["Paris", "Rome"]
    assert _fn(llama(LLAMA_OUTPUTS[1])[1]) == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}]
    for text in LLAMA_OUTPUTS[4:]:
        assert llama(text) == (text, None)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", '
          r'"arguments": \{"city": "(Paris|Rome)", "unit": "C"\}\}\n</tool_call>')


LLAMA_FORCED = r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)", "unit": "C"\}\}'


@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def server(request):
    pytest.importorskip("xgrammar")
    with serve(shared_engine_or_skip("ngram"), tool_call_parser=request.param) as s:
        s.parser = request.param
        yield s


def _body(s, **kw) -> dict:
    return {"model": s.state.names[0], "messages": ASK, "temperature": 0, "max_tokens": 160, "tools": [WEATHER], **kw}


@pytest.mark.usefixtures("single_thread")
def test_auto_tool_call_whole_and_streamed(server):
    forced, said = (FORCED, "Let me check.\n") if server.parser == "hermes" else (LLAMA_FORCED, None)
    r = httpx.post(server.url + "/v1/chat/completions", json=_body(server, guided_regex=forced), timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == said
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["unit"] == "C"
    r = httpx.post(server.url + "/v1/chat/completions", json=_body(server, guided_regex=forced, stream=True),
                   timeout=120)
    chunks = [json.loads(e)["choices"][0] for e in sse_data(r.text.splitlines()) if e != "[DONE]"]
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    calls = [t for c in chunks for t in c["delta"].get("tool_calls") or []]
    assert content == (said or "") and chunks[-1]["finish_reason"] == "tool_calls"
    assert [t["function"] for t in calls] == [call["function"]] and calls[0]["index"] == 0


@pytest.mark.usefixtures("single_thread")
def test_auto_without_a_call_is_text(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=_body(server, guided_regex="It is sunny"), timeout=120)
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny"}
    assert choice["finish_reason"] == "stop"


def test_auto_is_refused_without_a_parser():
    with serve(shared_engine_or_skip("ngram")) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=_body(s, tool_choice="auto"), timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == "tool_choice"
    assert "--tool-call-parser" in error_of(r)["message"]


def test_unknown_parser_is_refused():
    from dspark.server.app import create_app

    with pytest.raises(ValueError, match="tool-call parser"):
        create_app(tool_call_parser="xml")
