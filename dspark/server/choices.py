"""A request's choices and how their engine outputs become OpenAI bodies: whole choices, streamed
chunks, logprobs (echoed prompts included), usage and the speculation counters."""

from __future__ import annotations

from dataclasses import dataclass

from dspark.engine.sequence import RequestOutput, SpecStats
from dspark.scheduler.scheduler import RequestStream
from dspark.server.responses import (
    chat_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    cut_top,
    usage,
    vllm_prompt_logprobs,
)
from dspark.server.token_bytes import token_bytes
from dspark.server.tool_parsers import HermesParser, Llama3JsonParser
from dspark.server.tools import ToolCalling


@dataclass
class Choice:
    """One of a request's choices (n per prompt): its engine stream and what a stream has sent."""

    index: int
    stream: RequestStream
    first_of_prompt: bool = True  # the prompt's first choice: its prompt tokens count in usage
    echo: str = ""  # echo: the prompt's text (chat: the last, assistant message), sent before the output
    echo_logprobs: bool = False  # echo with logprobs: the prompt's tokens lead the first logprobs sent
    logprobs_sent: int = 0  # output tokens whose logprobs were sent
    text_offset: int = 0  # completion characters those tokens span (the next text_offset)
    final: RequestOutput | None = None
    tool_stream: object | None = None  # a streamed output read as tool calls: its reader's stream
    tool_called: bool = False  # that stream has sent a call


@dataclass
class ChoiceRenderer:
    """Builds one request's response bodies from its choices' outputs."""

    rid: str
    created: int
    model: str
    chat: bool
    tokenizer: object
    drafter: str  # the engine's drafter name, for the speculation counters
    spec_enabled: bool
    num_logprobs: int | None = None  # per output token (completions: also per echoed prompt token)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field, when asked
    # reads the output as tool calls: tool_choice "required" or named (a constrained output), or
    # "auto" (a parser of the model's own format)
    tools: ToolCalling | HermesParser | Llama3JsonParser | None = None

    def __post_init__(self) -> None:
        self._text: dict[int, str] = {}  # token id -> its text (alternatives repeat)

    def token_text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> bytes:
        return token_bytes(self.tokenizer, token_id, self.token_text(token_id))

    def speculation(self, outs: list[RequestOutput]) -> dict:
        """The speculation counters of the request: every choice's, summed."""
        total = SpecStats()
        for out in outs:
            total.add(out.stats)
        return {**total.as_dict(), "drafter": self.drafter, "enabled": self.spec_enabled}

    def usage(self, choices: list[Choice], outs: list[RequestOutput]) -> dict:
        """Each prompt's tokens once (not once per choice), every choice's output tokens."""
        prompt = sum(len(o.prompt_token_ids) for c, o in zip(choices, outs) if c.first_of_prompt)
        return usage(prompt, sum(len(o.token_ids) for o in outs))

    def logprobs(self, out: RequestOutput, c: Choice) -> dict | None:
        """The logprobs of the choice's output tokens not yet sent (all of them outside a stream),
        after the prompt's own when it is echoed with logprobs and not sent yet."""
        if out.logprobs is None:
            return None
        start, c.logprobs_sent = c.logprobs_sent, len(out.logprobs)
        entries, ids = out.logprobs[start:], out.token_ids[start:len(out.logprobs)]
        if self.chat:
            return chat_logprobs(entries, ids, self.token_text, self.token_bytes)
        if c.echo_logprobs:
            c.echo_logprobs = False
            entries = [cut_top(e, self.num_logprobs) for e in out.prompt_logprobs] + entries
            ids = out.prompt_token_ids + ids
        body = completion_logprobs(entries, ids, self.token_text, c.text_offset)
        c.text_offset += sum(len(s) for s in body["tokens"])
        return body

    def body(self, choices: list[Choice], outs: list[RequestOutput]) -> dict:
        """The whole (non-streamed) response."""
        build = chat_body if self.chat else completion_body
        bodies = []
        for c, out in zip(choices, outs):
            text, finish, calls = c.echo + out.text, out.finish_reason, None
            if self.tools is not None:
                content, calls = self.tools.split(out.text)
                if calls is not None:
                    text, finish = content, self._tool_finish(out)
            extra = {"tool_calls": calls} if calls else {}
            choice = build(self.rid, self.created, self.model, text, finish, stop_reason=out.stop_reason,
                           logprobs=self.logprobs(out, c), index=c.index, **extra)["choices"][0]
            if self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs, out.prompt_token_ids,
                                                                 self.prompt_logprobs, self.token_text)
            bodies.append(choice)
        body = build(self.rid, self.created, self.model, "", None, self.usage(choices, outs), self.speculation(outs))
        return body | {"choices": bodies}

    def opening(self, c: Choice) -> dict | None:
        """A stream's first chunk for a choice: the chat role, or the echoed prompt (unless it waits
        for the prompt's logprobs, which come with the first output)."""
        if self.chat:  # with the echoed last message, if any
            return chat_body(self.rid, self.created, self.model, c.echo, None, chunk=True, role=True, index=c.index)
        if c.echo and not c.echo_logprobs:
            return completion_body(self.rid, self.created, self.model, c.echo, None, chunk=True, index=c.index)
        return None

    def chunk(self, out: RequestOutput, c: Choice) -> dict | None:
        """The streamed chunk for a new output, or None while there is nothing to send."""
        if not (out.new_text or out.finished or (c.echo_logprobs and out.token_ids)):
            return None
        finish = out.finish_reason if out.finished else None
        spec = self.speculation([out]) if out.finished else None
        stop = out.stop_reason if out.finished else None
        text = c.echo + out.new_text if c.echo_logprobs else out.new_text
        if self.tools is not None:
            return self._tool_chunk(out, c, finish, spec, stop)
        build = chat_body if self.chat else completion_body
        return build(self.rid, self.created, self.model, text, finish, speculation=spec, chunk=True,
                     stop_reason=stop, logprobs=self.logprobs(out, c), index=c.index)

    def _tool_finish(self, out: RequestOutput) -> str | None:
        """finish_reason of an output that made tool calls (the reader's rule)."""
        return self.tools.finish_reason(out.text, out.finish_reason)

    def _tool_chunk(self, out: RequestOutput, c: Choice, finish: str | None, spec: dict | None,
                    stop: int | str | None) -> dict | None:
        """The content and call deltas the reader's stream lets out so far (it may hold text back)."""
        if c.tool_stream is None:
            c.tool_stream = self.tools.stream()
        content, calls = c.tool_stream.feed(out.new_text, out.finished)
        c.tool_called = c.tool_called or bool(calls)
        if not (content or calls or out.finished):
            return None
        if out.finished and c.tool_called:
            finish = self._tool_finish(out)
        return chat_body(self.rid, self.created, self.model, content, finish, speculation=spec, chunk=True,
                         stop_reason=stop, logprobs=self.logprobs(out, c), index=c.index, tool_calls=calls or None)
