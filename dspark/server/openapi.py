"""What /openapi.json (and /docs) say about the POST routes: their request bodies and responses.

The handlers read the raw body themselves (body.py, then protocol.parse_request), for strict
types, OpenAI-shaped 400s and the nesting and surrogate checks; FastAPI therefore sees no body
parameter, so each route declares its request models through `openapi_extra` and
install_openapi puts their JSON schemas (and the models they refer to) under components.
The response models here only document: handlers build their bodies as dicts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

_REF = "#/components/schemas/{model}"
# one event of a stream (OpenAPI 3.2's reading of an SSE schema without itemSchema)
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a chunk as JSON (a CompletionResponse of object ...chunk, or an error), "
                                     "last the text [DONE]"}}}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorInfo(BaseModel):
    """The error itself: message, type (e.g. invalid_request_error), the field at fault, the status."""

    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(BaseModel):
    """Every error's body, as OpenAI's."""

    error: ErrorInfo


class CompletionResponse(_Open):
    """A text or chat completion (object "text_completion" or "chat.completion"); a streamed one is
    text/event-stream, its chunks the same shape with object "...chunk", then `data: [DONE]`."""

    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    """POST /tokenize: the prompt's token ids (and their strings when asked for)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    """POST /detokenize: the ids' text."""

    prompt: str


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses` documenting these error statuses (ErrorResponse bodies)."""
    why = {400: "invalid request (the field at fault in error.param)", 401: "missing or wrong API key",
           404: "unknown model", 429: "too many requests in flight (see Retry-After)",
           500: "internal error (its message names the request id)", 503: "loading, failed or shutting down"}
    return {s: {"model": ErrorResponse, "description": why[s]} for s in statuses}


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is one of models (install_openapi adds them)."""
    refs = [{"$ref": _REF.format(model=m.__name__)} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def generation_docs(*models: type[BaseModel]) -> dict[str, Any]:
    """Route keyword arguments documenting a completions route (JSON, or SSE with stream true)."""
    ok = {"model": CompletionResponse, "description": "the completion (JSON), or its chunks (SSE) with stream",
          "content": {"text/event-stream": {"schema": _SSE_EVENT}}}
    return {"openapi_extra": request_body(*models),
            "responses": {200: ok, **error_responses(400, 401, 404, 429, 500, 503)}}


def tokenization_docs(response: type[BaseModel], *models: type[BaseModel]) -> dict[str, Any]:
    """Route keyword arguments documenting /tokenize or /detokenize."""
    return {"openapi_extra": request_body(*models), "response_model": None,
            "responses": {200: {"model": response, "description": "OK"}, **error_responses(400, 401, 404, 500, 503)}}


def install_openapi(app: FastAPI, models: Iterable[type[BaseModel]]) -> None:
    """Add the request models' JSON schemas (and those they refer to) to app's OpenAPI components."""
    build = app.openapi
    models = list(models)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()  # FastAPI's, cached in app.openapi_schema
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in models:
                js = m.model_json_schema(ref_template=_REF)
                components.update(js.pop("$defs", {}))
                components[m.__name__] = js
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
