"""The request fields that constrain the output: OpenAI's response_format and vLLM's
structured_outputs and guided_* fields (and a chat request's tool_choice, see tools.py), read
into one StructuredOutputs (one per request)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dspark.config import StructuredOutputs
from dspark.engine.structured import StructuredOutputError, schema_text

_STRICT = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: the schema (its name and strict flag are not used)."""

    model_config = _STRICT
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsOptions(BaseModel):
    """vLLM's structured_outputs object: one of json (a schema), json_object, regex, choice, grammar."""

    model_config = _STRICT
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def _tuple(x: list[str] | None) -> tuple[str, ...] | None:
    return None if x is None else tuple(x)


def requested_constraint(req: Any) -> StructuredOutputs | None:
    """The output constraint a request asks for, from whichever field gives one; two fields that
    both do are an error naming the second (a StructuredOutputError, so a 400 with its param).
    The constraint itself is checked by SamplingParams, whose errors name its field too."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(StructuredOutputs(json_object=True, field="response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise StructuredOutputError("response_format: type json_schema needs a json_schema object",
                                        "response_format")
        found.append(StructuredOutputs(json=schema_text(rf.json_schema.schema_), field="response_format"))
    so = req.structured_outputs
    if so is not None:
        found.append(StructuredOutputs(json=None if so.json_ is None else schema_text(so.json_),
                                       json_object=bool(so.json_object), regex=so.regex, choice=_tuple(so.choice),
                                       grammar=so.grammar))
    guided = {"guided_json": lambda v: {"json": schema_text(v)}, "guided_regex": lambda v: {"regex": v},
              "guided_choice": lambda v: {"choice": tuple(v)}, "guided_grammar": lambda v: {"grammar": v}}
    for name, kw in guided.items():
        value = getattr(req, name)
        if value is not None:
            found.append(StructuredOutputs(field=name, **kw(value)))
    tools = req.tool_calling() if hasattr(req, "tool_calling") else None
    if tools is not None:
        found.append(StructuredOutputs(json=schema_text(tools.schema()), field="tool_choice"))
    if len(found) > 1:
        raise StructuredOutputError(f"{found[1].field}: one output constraint per request "
                                    f"({found[0].field} gives one already)", found[1].field)
    return found[0] if found else None  # validated with the SamplingParams that carry it
