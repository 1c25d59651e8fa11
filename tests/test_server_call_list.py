"""tool_choice "required" read as it grows: the streamed calls, fed in pieces of every size, add up
to what the whole response returns, whatever the strings inside the arguments hold."""

from __future__ import annotations

import json

import pytest

from dspark.server.tools import FunctionDefinition, ToolCalling

TOOLS = ToolCalling((FunctionDefinition(name="get_weather"), FunctionDefinition(name="get_time")))

LISTS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}]',
    '[{"name":"get_weather","parameters":{"city":"a \\"quoted\\" }, ] { city","unit":"F"}},'
    ' {"name": "get_time", "parameters": {"zone": "UTC", "nested": {"deep": [1, {"x": "]"}]}}}]',
    '[ {\n  "parameters" : { "zone": "CET\\\\" } ,\n  "name" : "get_time"\n } ]',  # parameters first
    '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {"zone": "\\u00e9t\\u00e9"}}]',
]


def _stream(text: str, piece: int) -> tuple[str, list[dict]]:
    s = TOOLS.stream()
    content, deltas = "", []
    for i in range(0, len(text), piece):
        c, d = s.feed(text[i:i + piece], i + piece >= len(text))
        content, deltas = content + c, deltas + d
    return content, deltas


def _joined(deltas: list[dict]) -> list[dict]:
    """The calls the deltas make, as a client would put them together."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function"
            calls[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in range(len(calls))]


@pytest.mark.parametrize("text", LISTS)
@pytest.mark.parametrize("piece", [1, 2, 7, 10_000])
def test_streamed_calls_equal_the_whole_response(text, piece):
    content, whole = TOOLS.split(text)
    assert content is None
    streamed_content, deltas = _stream(text, piece)
    assert streamed_content == ""
    got = _joined(deltas)
    assert [c["function"] for c in got] == [c["function"] for c in whole]
    for call, item in zip(got, json.loads(text)):
        assert call["function"]["name"] == item["name"]
        assert json.loads(call["function"]["arguments"]) == item["parameters"]


def test_arguments_stream_in_pieces():
    """A call is sent once its name is whole; its arguments follow as they are written."""
    _, deltas = _stream(LISTS[0], 3)
    assert "id" in deltas[0] and deltas[0]["function"]["name"] == "get_weather"
    assert len(deltas) > 5


def test_an_output_cut_before_any_name_is_content_and_after_one_is_a_partial_call():
    text = LISTS[1]
    cut = text[:8]  # '[{"name"'
    assert TOOLS.split(cut) == (cut, None)
    assert _stream(cut, 1) == (cut, [])
    cut = text[:60]  # inside the first call's arguments
    content, deltas = _stream(cut, 5)
    [call] = _joined(deltas)
    assert content == "" and call["function"]["name"] == "get_weather"
    assert text.startswith(cut) and cut.endswith(call["function"]["arguments"])
    assert TOOLS.split(cut) == (cut, None)  # whole, an incomplete list is text (the finish says "length")


def test_numbers_and_literals_as_parameters_end_where_the_item_does():
    text = '[{"name": "get_time", "parameters": 12.5}, {"parameters": null , "name": "get_weather"}]'
    _, deltas = _stream(text, 1)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in _joined(deltas)] == \
        [("get_time", "12.5"), ("get_weather", "null")]


def test_finish_reason_is_tool_calls_only_for_a_whole_list():
    """A stop string or max_tokens may cut a list a stream has partly sent: the engine's finish
    reason stays, as in the whole response (where the cut list is text)."""
    cut = LISTS[0][:40]
    assert TOOLS.finish_reason(cut, "stop") == "stop" and TOOLS.finish_reason(cut, "length") == "length"
    assert TOOLS.finish_reason(LISTS[0], "stop") == "tool_calls"
    named = ToolCalling(TOOLS.functions, named="get_time")
    assert named.finish_reason('{"zone": "UTC"}', "stop") == "stop"


def test_arguments_are_the_text_as_written():
    """Numbers JSON allows but Python reads as infinity are not refused: the arguments are text."""
    text = '[{"name": "get_time", "parameters": {"x": 1e999}}]'
    _, [call] = TOOLS.split(text)
    assert call["function"]["arguments"] == '{"x": 1e999}'
    deep = '[{"name": "get_time", "parameters": {"x": ' + "[" * 5000 + "]" * 5000 + "}}]"
    assert TOOLS.split(deep) == (deep, None)  # too deep for json.loads: text, not a 500


def test_value_keywords_are_data_not_references():
    params = {"type": "object", "properties": {"link": {"type": "object", "default": {"$ref": "#/components/x"},
                                                        "examples": [{"$ref": "#/x"}]}}}
    schema = ToolCalling((FunctionDefinition(name="f", parameters=params),)).schema()
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == params
