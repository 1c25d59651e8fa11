"""POST /tokenize and /detokenize, with vLLM's request and response shapes.

A client counts a prompt's tokens (against `max_model_len`) or sees how the model's chat
template renders messages, without generating; /detokenize turns token ids back into text.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Request
from pydantic import Field

from dspark.engine.prompts import PromptError, render_chat
from dspark.server.body import read_json
from dspark.server.openapi import DetokenizeResponse, TokenizeResponse, tokenization_docs
from dspark.server.protocol import APIError, ChatTemplateFields, StrictModel, parse_request

if TYPE_CHECKING:
    from dspark.server.app import ServerState


class TokenizeCompletionRequest(StrictModel):
    """/tokenize of a text prompt; add_special_tokens as the completions endpoint adds them."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    """/tokenize of chat messages, rendered exactly as /v1/chat/completions renders them; the
    template writes its own special tokens, so add_special_tokens (the tokenizer's, on top) is off
    by default, as in vLLM."""

    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    """/detokenize: token ids to text (special tokens kept)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def _tokenize(state: ServerState, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    engine = state.engine
    tok = engine.tokenizer
    try:
        if isinstance(req, TokenizeChatRequest) and not req.add_special_tokens:
            ids = engine.encode(req.chat_prompt())  # what chat runs
        else:
            text = render_chat(tok, req.chat_prompt()) if isinstance(req, TokenizeChatRequest) else req.prompt
            ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
    except PromptError as e:
        raise APIError(400, str(e), param=e.param) from None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}


def _detokenize(state: ServerState, req: DetokenizeRequest) -> dict[str, str]:
    try:
        ids = state.engine.encode(req.tokens)  # checked against the vocabulary as a prompt's ids are
    except ValueError as e:
        raise APIError(400, f"tokens: {e}", param="tokens") from None
    return {"prompt": state.engine.tokenizer.decode(ids)}


def add_tokenization_routes(app: FastAPI, state: ServerState) -> None:
    """Register POST /tokenize and /detokenize on app (behind the API key, like /v1/*)."""

    async def _parse(request: Request, cls: type[StrictModel]) -> Any:
        state.check_auth(request)
        body = await read_json(request)
        if cls is TokenizeCompletionRequest and isinstance(body, dict) and body.get("messages") is not None:
            cls = TokenizeChatRequest
        req = parse_request(cls, body)
        state.require_ready()
        state.check_model(req.model)
        return req

    # off the event loop: a long prompt's tokenization would hold up every open stream
    @app.post("/tokenize", **tokenization_docs(TokenizeResponse, TokenizeCompletionRequest, TokenizeChatRequest))
    async def tokenize(request: Request) -> dict:
        return await asyncio.to_thread(_tokenize, state, await _parse(request, TokenizeCompletionRequest))

    @app.post("/detokenize", **tokenization_docs(DetokenizeResponse, DetokenizeRequest))
    async def detokenize(request: Request) -> dict:
        return await asyncio.to_thread(_detokenize, state, await _parse(request, DetokenizeRequest))
