"""OpenAI request models (as vLLM accepts them) and the API error type.

Requests are validated strictly: a wrong JSON type is an error, not coerced. Unknown fields
are ignored, like vLLM; known OpenAI and vLLM features this server does not implement (beam
search, functions, ...) are rejected when set to anything but their default.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, WithJsonSchema, field_validator

from dspark.config import MAX_LOGPROBS, MAX_TOP_K, SamplingParams
from dspark.engine.prompts import ChatPrompt
from dspark.server.constraints import ResponseFormat, StructuredOutputsOptions, requested_constraint
from dspark.server.tools import (
    NamedToolChoice,
    ToolCall,
    ToolCalling,
    ToolDefinition,
    check_tool_choice,
    check_tools,
    named_choice,
)

MAX_N = 64  # choices per request, each an engine request of its own
_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# what CompletionRequest.prompt takes (validated by its field validator; this documents it)
PROMPT_SCHEMA = {"title": "Prompt", "description": "a string, token ids, or a non-empty list of either (a batch)",
                 "anyOf": [_TEXT, _TOKEN_IDS, {"type": "array", "items": {"anyOf": [_TEXT, _TOKEN_IDS]},
                                               "minItems": 1}]}

# OpenAI fields we do not implement, with the values that mean "off" (a request model that
# declares one of them implements it: logprobs for both, top_logprobs for chat)
_UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "use_beam_search": (None, False),
    # vLLM's extra sampling and template fields
    "chat_template": (None,), "tool_choice": (None, "none", "auto"),
}


def _is_off(value: Any, off: tuple) -> bool:
    # by type as well as value: 0 == False, yet logprobs: 0 asks for the chosen token's logprob
    return any(type(value) is type(v) and value == v for v in off)


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = err_type or self.TYPES.get(status, "api_error")
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.status)


def error_body(message: str, err_type: str, param: str | None, code: int | str | None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class SpeculationOptions(StrictModel):
    """Extension: per-request control of speculative decoding."""

    enabled: bool = True
    block_size: int | None = Field(None, ge=1, le=32)


class StreamOptions(StrictModel):
    """stream_options: include_usage adds a last chunk with usage and no choices; with it,
    continuous_usage_stats (vLLM's) gives every chunk its choice's usage so far."""

    include_usage: bool | None = False  # null: false, as vLLM takes it
    continuous_usage_stats: bool | None = False


class _Common(StrictModel):
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # JSON keys are strings: token ids as text
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: a non-streamed choice's prompt_logprobs
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsOptions | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    speculation: SpeculationOptions | None = None
    user: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:  # NaN fails this too
                raise ValueError(f"biases must be in [-100, 100], got {bias!r} for token {key}")
        return v

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """Sampling settings with vLLM's defaults (temperature 1, top_p 1, top_k off)."""
        params = SamplingParams(
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k is None else self.top_k, min_p=float(self.min_p or 0.0), seed=self.seed,
            max_tokens=max_tokens or max(1, self.min_tokens),  # None: the scheduler fills in the context's room
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, logprobs=self.num_logprobs(), prompt_logprobs=self.num_prompt_logprobs(),
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=requested_constraint(self), bad_words=list(self.bad_words or []),
            presence_penalty=float(self.presence_penalty or 0.0),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            repetition_penalty=1.0 if self.repetition_penalty is None else float(self.repetition_penalty))
        params.validate()
        return params

    def num_logprobs(self) -> int | None:
        """Alternatives to return per output token (0: only its own logprob); None: no logprobs."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """Alternatives the engine should score per prompt token (None: no prompt logprobs)."""
        return self.prompt_logprobs


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: Annotated[Any, WithJsonSchema(PROMPT_SCHEMA)]  # validated into a list of strings or token ids
    max_tokens: int | None = Field(16, ge=1)  # vLLM's default; null: up to the context
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_off(cls, v: Any) -> Any:
        return None if v is False else v  # as vLLM (lax types) takes it; true is still refused

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs lists the prompt's tokens with theirs (lm-evaluation-harness scores
        text this way)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> list[str | list[int]]:
        """A string, token ids, or a list of either (a batch: one choice per prompt, times n)."""
        if _one_prompt(v):
            return [v]
        if isinstance(v, list) and v and all(_one_prompt(p) for p in v):
            return v
        raise ValueError("prompt must be a string, a non-empty list of token ids, or a non-empty list of those")


def _one_prompt(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and bool(v)
                                  and all(isinstance(t, int) and not isinstance(t, bool) for t in v))


class ContentPart(StrictModel):
    """A text part of a message's content list (the only kind this text model takes)."""

    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    """One chat message; content as a string or a list of text parts."""

    # the schema says what _content checks: only an assistant's message may leave content out
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"anyOf": [
        {"properties": {"role": {"const": "assistant"}}},
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}]})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v: str | list[ContentPart] | None, info: ValidationInfo) -> str | list[ContentPart] | None:
        # as OpenAI: only an assistant's message may leave content out (it made tool calls instead)
        if v is None and info.data.get("role") != "assistant":
            raise ValueError(f"a {info.data.get('role')} message needs content")
        return v

    def as_dict(self) -> dict:
        """{"role", "content"} for the chat template ("developer" becomes "system"), with the
        tool-call fields that are set."""
        # text parts joined by newlines, as vLLM's chat_utils does
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatTemplateFields(StrictModel):
    """The fields that render chat messages into a prompt (shared by chat completions and
    /tokenize)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True  # vLLM's template options (see engine/prompts.py)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None

    def chat_prompt(self) -> ChatPrompt:
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        return ChatPrompt([m.as_dict() for m in self.messages], self.add_generation_prompt,
                          self.continue_final_message, dict(self.chat_template_kwargs or {}), tools)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        return check_tools(v)


class ChatCompletionRequest(ChatTemplateFields, _Common):
    """POST /v1/chat/completions."""

    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # vLLM's: the reply starts with the last message when that is the assistant's
    # None: "auto" when tools are given, else "none" (OpenAI's defaults); checked even when absent
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, validate_default=True)
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _named_tool_choice(cls, v: Any) -> Any:
        return named_choice(v)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any, info: ValidationInfo) -> Any:
        return check_tool_choice(v, info.data.get("tools"))

    def tool_calling(self) -> ToolCalling | None:
        """How a constrained output becomes tool calls (tool_choice "required" or a named
        function), or None ("none", or "auto", which a tool-call parser reads)."""
        if self.tool_choice in (None, "auto"):
            return None
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        return ToolCalling(tuple(t.function for t in self.tools), named, self.parallel_tool_calls is not False)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):  # as vLLM, even for 0
            raise ValueError("logprobs must be true when top_logprobs is set")
        return v

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_request(cls: type[StrictModel], body: Any) -> StrictModel:
    """Validate a JSON body; raises APIError(400) naming the first offending field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key, off in _UNSUPPORTED.items():
        if key in body and key not in cls.model_fields and not _is_off(body[key], off):
            raise APIError(400, f"{key} is not supported by this server", param=key)
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"] if isinstance(x, int) or ("[" not in str(x) and x not in
                                                                     ("str", "int", "float", "bool", "list"))]
        param = ".".join(loc) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from None
    if getattr(req, "stream_options", None) is not None and not req.stream:
        raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")
    return req
