"""Function calling (OpenAI's tools and tool_choice) as vLLM serves it: tool_choice "required" or
a named function constrains the output to JSON (a structured output), which the response returns
as the message's tool_calls; "none" only shows the tools to the chat template; "auto" lets the
model write calls in its own format, read by a tool-call parser (tool_parsers.py) when the server
has one, and is refused otherwise (as vLLM does without --tool-call-parser)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dspark.engine.structured import StructuredOutputError
from dspark.server.call_list import CallListScanner

_STRICT = ConfigDict(strict=True, extra="ignore")
# a function without parameters still takes a JSON object, as OpenAI treats it
_NO_PARAMETERS = {"type": "object", "properties": {}}
# where JSON schemas keep shared subschemas (2020-12, draft-07): hoisted to the root for "required"
_DEFINITIONS = ("$defs", "definitions")
# keywords whose values are JSON data, not schemas: a "$ref" inside them is only data
_VALUE_KEYWORDS = frozenset({"default", "const", "enum", "examples"})


def _misplaced_ref(node: Any) -> str | None:
    """The first local "$ref" under node that does not point into a definitions folder."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(("#/$defs/", "#/definitions/")):
            return ref
        children = [v for k, v in node.items() if k not in _VALUE_KEYWORDS]
    elif isinstance(node, list):
        children = node
    else:
        return None
    return next((r for child in children if (r := _misplaced_ref(child)) is not None), None)


class FunctionDefinition(BaseModel):
    """A function the model may call: its name, description and JSON-schema parameters."""

    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":  # as OpenAI: arguments are an object
            raise ValueError("must be the JSON schema of an object")
        return v


class ToolDefinition(BaseModel):
    """One entry of `tools`."""

    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    """tool_choice.function: the function the model must call."""

    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming one function: {"type": "function", "function": {"name": ...}}."""

    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    """An earlier call's function and its arguments (JSON text), in an assistant message."""

    model_config = _STRICT
    name: str
    arguments: str | dict[str, Any] | None = None  # JSON text; an object or nothing taken too, as vLLM

    @field_validator("arguments")
    @classmethod
    def _json(cls, v: str | dict[str, Any] | None) -> dict[str, Any]:
        if v is None or v == "":
            return {}
        if isinstance(v, dict):
            return v
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            raise ValueError("arguments must be JSON text") from None


class ToolCall(BaseModel):
    """An earlier tool call in the conversation (an assistant message's tool_calls)."""

    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """As chat templates take it: arguments as an object (vLLM's convention), not JSON text."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


AUTO_NEEDS_PARSER = ('"auto" (the default when tools are given) needs a parser for the model\'s own tool-call '
                     'format, which this server was not started with (--enable-auto-tool-choice '
                     '--tool-call-parser): set tool_choice to "required", a named function or "none"')


def named_choice(v: Any) -> Any:
    """A tool_choice object read as a named function, its faults told in the error (a union's
    error would only say that it is not one of the strings)."""
    if not isinstance(v, dict):
        return v
    try:
        return NamedToolChoice.model_validate(v)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}: '
                         f'{where}: {err["msg"]}') from None


def check_tool_choice(choice: Any, tools: list[ToolDefinition] | None) -> Any:
    """tool_choice as given ("auto" by default when tools are given), or None where it means
    "none" ("auto" without tools, too); a ValueError for a choice that needs tools and has none,
    or names no tool."""
    if choice is None or (choice == "auto" and not tools):
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise ValueError("tool_choice needs tools")
    names = [t.function.name for t in tools]
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"function {choice.function.name!r} is not among the tools")
    return choice


def check_tools(tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
    names = [t.function.name for t in tools or []]
    repeated = next((n for n in names if names.count(n) > 1), None)
    if repeated is not None:
        raise ValueError(f"two tools are named {repeated!r}")
    return tools


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str) -> dict:
    """One OpenAI tool call (a fresh id), its arguments as JSON text."""
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def indexed(calls: list[dict], first: int = 0) -> list[dict]:
    """Calls as stream deltas: each with its index among the choice's calls."""
    return [{"index": first + i} | call for i, call in enumerate(calls)]


class BufferedCalls:
    """Streams an output that is read only whole: nothing until it ends, then its calls (or its
    text, when it makes none)."""

    def __init__(self, reader) -> None:  # noqa: ANN001 - anything with split(text)
        self.reader, self.buf = reader, ""

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content to send, call deltas to send) after the output's next text."""
        self.buf += text
        if not final:
            return "", []
        content, calls = self.reader.split(self.buf)
        return content or "", indexed(calls or [])


class NamedCallArguments:
    """Streams a named function's arguments as they come: the first delta with the call's id and
    name, the later ones with more of its arguments."""

    def __init__(self, name: str) -> None:
        self.name, self.started = name, False

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        if not text:
            return "", []
        if self.started:
            return "", [{"index": 0, "function": {"arguments": text}}]
        self.started = True
        return "", indexed([tool_call(self.name, text)])


class RequiredCalls:
    """Streams tool_choice "required" output call by call: a call's id and name once its name is
    whole, then its arguments as they come. An output that ends before any name (cut short) is
    sent as content, as the whole response would return it."""

    def __init__(self) -> None:
        self.scan, self.text = CallListScanner(), ""
        self.sent: dict[int, int] = {}  # call index -> characters of its arguments sent

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        self.text += text
        self.scan.feed(text)
        deltas = []
        for i, call in enumerate(self.scan.calls):
            if call.name is None:
                continue
            if i not in self.sent:
                deltas.append({"index": i} | tool_call(call.name, call.text))
            elif len(call.chars) > self.sent[i]:
                deltas.append({"index": i, "function": {"arguments": "".join(call.chars[self.sent[i]:])}})
            self.sent[i] = len(call.chars)
        if final and not self.sent:
            return self.text, []
        return "", deltas


@dataclass(frozen=True)
class ToolCalling:
    """How a request's output becomes tool calls: the arguments of one named function, or
    ("required", named is None) a JSON list of {"name", "parameters"} calls, at most one when
    parallel calls are off."""

    functions: tuple[FunctionDefinition, ...]
    named: str | None = None
    parallel: bool = True

    def finish_reason(self, text: str, engine_finish: str | None) -> str | None:
        """finish_reason of an output that made calls: a named function's is the engine's, as
        OpenAI answers it; a "required" list's is "tool_calls" when the list is whole, else the
        engine's (a stream may have sent part of a call before max_tokens or a stop string)."""
        if self.named is not None or self.split(text)[1] is None:
            return engine_finish
        return "tool_calls"

    def schema(self) -> dict:
        """The JSON schema the output is held to. For "required" each function's parameters sit
        inside the list's schema, so their $defs (and draft-07 definitions) move to its root,
        where "#/$defs/..." points; other references from the root ("#/properties/...") would
        point elsewhere there, and are refused."""
        if self.named is not None:
            f = next(f for f in self.functions if f.name == self.named)
            return f.parameters or _NO_PARAMETERS
        hoisted: dict[str, dict[str, Any]] = {key: {} for key in _DEFINITIONS}
        calls = []
        for f in self.functions:
            params = dict(f.parameters or _NO_PARAMETERS)
            for folder in _DEFINITIONS:
                defs = params.pop(folder, None) or {}
                if not isinstance(defs, dict):
                    raise StructuredOutputError(f"tools: function {f.name!r}: {folder} must be an object", "tools")
                for key, value in defs.items():
                    if hoisted[folder].setdefault(key, value) != value:
                        raise StructuredOutputError(f"tools: two functions define {folder}/{key} differently", "tools")
            if (ref := _misplaced_ref(params)) is not None:
                raise StructuredOutputError(
                    f"tools: function {f.name!r} refers to {ref!r}, which tool_choice \"required\" cannot keep "
                    "(its parameters are nested in a list of calls): put shared schemas under $defs", "tools")
            calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [f.name]},
                                                           "parameters": params},
                          "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        schema.update({folder: defs for folder, defs in hoisted.items() if defs})
        if (ref := _misplaced_ref(schema)) is not None:  # inside a hoisted definition
            raise StructuredOutputError(f"tools: a shared definition refers to {ref!r}, which tool_choice "
                                        "\"required\" cannot keep: refer to $defs only", "tools")
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def split(self, text: str) -> tuple[str | None, list[dict] | None]:
        """A whole output as (content, tool calls). A named function's arguments are the text as
        it came, complete or not (the finish_reason tells which, as in vLLM); "required" calls
        are (text, None) unless the text is a complete list (an output cut by max_tokens is not)."""
        if self.named is not None:
            return None, [tool_call(self.named, text)]
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):  # ValueError covers json.JSONDecodeError
            return text, None
        if not isinstance(items, list) or not all(isinstance(c, dict) and {"name", "parameters"} <= c.keys()
                                                  for c in items):
            return text, None
        # each call's arguments are its parameters' text as written, as a stream sends them (the
        # scanner finds one call per item: every item is an object)
        scan = CallListScanner()
        scan.feed(text)
        return None, [tool_call(str(c["name"]), read.text) for c, read in zip(items, scan.calls)]

    def stream(self) -> NamedCallArguments | RequiredCalls:
        """A streamed output's reader: a named function's arguments as they come, "required"
        calls one by one, each one's arguments as they come."""
        return NamedCallArguments(self.named) if self.named is not None else RequiredCalls()
