"""POST /v1/completions and /v1/chat/completions: admission, streaming (SSE) and plain JSON."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from dspark.engine.sequence import RequestOutput
from dspark.scheduler.scheduler import EngineError, QueueFullError, RequestAborted, RequestStream, UnavailableError
from dspark.server.body import read_json
from dspark.server.choices import Choice, ChoiceRenderer
from dspark.server.guard import request_id, safe_text
from dspark.server.openapi import generation_docs
from dspark.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SpeculationOptions,
    parse_request,
)
from dspark.server.responses import usage, usage_chunk
from dspark.server.tools import AUTO_NEEDS_PARSER

if TYPE_CHECKING:
    from dspark.server.app import ServerState

logger = logging.getLogger("dspark.server")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Generation:
    """One completion or chat request from admission to its response (n choices)."""

    def __init__(self, state: ServerState, request: Request, chat: bool):
        self.state, self.request, self.chat = state, request, chat
        self.rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.spec = SpeculationOptions()
        self.choices: list[Choice] = []
        self.render: ChoiceRenderer | None = None

    async def run(self) -> Response:
        st = self.state
        st.check_auth(self.request)
        cls = ChatCompletionRequest if self.chat else CompletionRequest
        req = parse_request(cls, await read_json(self.request))
        sched = st.require_ready()
        model = st.check_model(req.model)
        if self.chat:
            prompts: list[Any] = [req.chat_prompt()]
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        else:
            prompts, max_tokens = req.prompt, req.max_tokens
        self.spec = req.speculation or SpeculationOptions()
        self._check_block_size()
        auto_tools = self.chat and req.tool_choice == "auto"
        if auto_tools and st.tool_parser is None:
            raise APIError(400, f"tool_choice: {AUTO_NEEDS_PARSER}", param="tool_choice")
        if req.stream and req.prompt_logprobs is not None:  # as vLLM
            raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        n = req.n or 1
        total = n * len(prompts)
        if total > sched.capacity:
            what = f"n={n}" if len(prompts) == 1 else f"{len(prompts)} prompts x n={n}"
            raise APIError(400, f"{what} is more than this server ever holds at once ({sched.capacity} requests)",
                           param="n" if len(prompts) == 1 else "prompt")
        echo = not self.chat and bool(req.echo)
        self.render = ChoiceRenderer(self.rid, int(time.time()), model, self.chat, st.engine.tokenizer,
                                     st.engine.spec.name, self.spec.enabled, req.num_logprobs(), req.prompt_logprobs,
                                     (req.tool_calling() or (st.tool_parser if auto_tools else None))
                                     if self.chat else None)
        try:
            params = req.sampling_params(max_tokens)
            if auto_tools:  # a model's tool-call markers may be special tokens: keep them in the text
                params = replace(params, skip_special_tokens=False)
            if params.structured_outputs is not None:  # compiled off the engine's thread
                await asyncio.to_thread(lambda: st.engine.grammars().compile(params.structured_outputs))
            if sched.num_active + total > sched.capacity:  # all or none: no choice admitted to be aborted
                raise QueueFullError(f"too many requests in flight ({sched.num_active}) for {total} more; "
                                     "retry later")
            # with prefix caching, each prompt's first choice is prefilled before its others are
            # admitted, so they find its pages in the cache instead of computing them again
            staged = st.engine.pool.prefix_caching and n > 1
            order = sorted(range(total), key=lambda k: k % n) if staged else range(total)
            for i, k in enumerate(order):
                prompt, j = prompts[k // n], k % n
                if staged and i == len(prompts):  # every prompt's first choice is in: wait for their prefills
                    for c in self.choices:
                        await c.stream.prefilled.wait()
                stream = await sched.add(self.rid if k == 0 else f"{self.rid}-{k}", prompt,
                                         params.choice(j), max_tokens=max_tokens,
                                         spec=self.spec.enabled, block_size=self.spec.block_size)
                self.choices.append(Choice(k, stream, first_of_prompt=j == 0,
                                           echo_logprobs=echo and req.num_logprobs() is not None))
            self.choices.sort(key=lambda c: c.index)
        except BaseException as e:
            self._abort()  # the choices admitted before one was refused (or the handler cancelled)
            if isinstance(e, QueueFullError):
                raise APIError(429, str(e), headers={"Retry-After": "1"}) from None
            if isinstance(e, UnavailableError):
                raise APIError(503, str(e)) from None
            param = getattr(e, "param", None)
            if param == "max_tokens" and self.chat and req.max_completion_tokens is not None:
                param = "max_completion_tokens"  # name the field the client sent
            elif param == "prompt" and self.chat:
                param = "messages"
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param=param) from None
            raise
        if self.chat and req.echo and req.messages[-1].role == "assistant":  # vLLM's chat echo
            for c in self.choices:
                c.echo = req.messages[-1].as_dict()["content"]
        if echo:  # each prompt as text (token ids decoded once the engine took them), as truncated
            tok = st.engine.tokenizer
            for c in self.choices:
                prompt = prompts[c.index // n]
                if req.truncate_prompt_tokens is not None:
                    c.echo = tok.decode(st.engine.prompt_ids(prompt, params))
                else:
                    c.echo = prompt if isinstance(prompt, str) else tok.decode(prompt)
        if req.stream:
            opts = req.stream_options
            include_usage = bool(opts and opts.include_usage)
            continuous = include_usage and bool(opts.continuous_usage_stats)  # as vLLM: only with include_usage
            # the background abort covers a client gone before the generator's first step (Starlette
            # may then cancel it unstarted, and its finally never runs); after a finished stream it is a no-op
            return StreamingResponse(self._stream(include_usage, continuous), media_type="text/event-stream",
                                     headers=SSE_HEADERS, background=BackgroundTask(self._abort))
        tasks = [asyncio.create_task(self._collect(c.stream)) for c in self.choices]
        try:  # one choice failing (or the client leaving) ends them all
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        finally:
            self._abort()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        # the error that ended the request, not the aborts it caused in the other choices
        first = next((t.exception() for t in tasks if t in done and t.exception() is not None), None)
        if first is not None:
            raise first
        outs = []
        for result in results:
            if isinstance(result, BaseException):
                raise result
            outs.append(result)
        return JSONResponse(self.render.body(self.choices, outs))

    def _abort(self) -> None:
        for c in self.choices:
            c.stream.abort()

    def _check_block_size(self) -> None:
        error = self.state.engine.spec.block_size_error(self.spec.block_size)
        if error is not None:
            raise APIError(400, f"speculation.{error}", param="speculation.block_size")

    async def _abort_on_disconnect(self, abort: Callable[[], None]) -> None:
        """Poll the connection and abort once the client is gone: a request still queued or
        prefilling produces nothing to send, so a failed send would notice it only at its first token."""
        while not await self.request.is_disconnected():
            await asyncio.sleep(0.25)
        abort()

    async def _collect(self, stream: RequestStream) -> RequestOutput:
        watcher = asyncio.create_task(self._abort_on_disconnect(stream.abort))
        try:
            out = await stream.result()
        except RequestAborted as e:
            raise APIError(503, str(e)) from None
        except EngineError as e:
            raise APIError(500, str(e)) from None
        finally:
            watcher.cancel()
            stream.abort()
        if out.finish_reason == "abort":
            raise APIError(503, "the request was aborted")
        return out

    async def _outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every choice's outputs as they come, interleaved; an error in any choice is raised."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async for out in c.stream:
                    await queue.put((c, out))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # handed to the consumer, which raises it
                await queue.put((c, e))
            await queue.put((c, None))

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            open_ = len(tasks)
            while open_:
                c, item = await queue.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield c, item
        finally:
            for t in tasks:
                t.cancel()

    async def _stream(self, include_usage: bool, continuous: bool) -> AsyncIterator[str]:
        """SSE chunks; a client that disconnects cancels this generator, which aborts the request.
        continuous: every chunk carries its choice's usage so far."""

        def chunk(body: dict, c: Choice, completion_tokens: int) -> str:
            if continuous:
                body["usage"] = usage(c.stream.prompt_tokens, completion_tokens)
            elif include_usage:  # every chunk but the last says "usage": null
                body.setdefault("usage", None)
            return _sse(body)

        watcher = asyncio.create_task(self._abort_on_disconnect(self._abort))
        try:
            for c in self.choices:
                opening = self.render.opening(c)
                if opening is not None:
                    yield chunk(opening, c, 0)
            async with contextlib.aclosing(self._outputs()) as outputs:
                async for c, out in outputs:
                    if out.finished and out.finish_reason == "abort":
                        raise RequestAborted("the request was aborted")
                    body = self.render.chunk(out, c)
                    if body is not None:
                        yield chunk(body, c, len(out.token_ids))
                    c.final = out
            finals = [c.final for c in self.choices]
            if include_usage and all(f is not None for f in finals):
                r = self.render
                yield _sse(usage_chunk(r.rid, r.created, r.model, self.chat, r.usage(self.choices, finals)))
        except RequestAborted as e:
            yield _sse(APIError(503, str(e)).body())
        except Exception as e:  # EngineError, or a bug: tell the client inside the stream
            if isinstance(e, EngineError):
                yield _sse(APIError(500, safe_text(str(e))).body())
            else:
                rid = request_id(self.request)
                logger.exception("request %s (stream %s) failed", rid, self.rid)
                yield _sse(APIError(500, safe_text(f"internal error (request id {rid}): {type(e).__name__}: {e}"))
                           .body())
        finally:
            watcher.cancel()
            self._abort()
        yield "data: [DONE]\n\n"


def add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """Register POST /v1/completions and /v1/chat/completions on app. An exception other than an
    APIError becomes a JSON 500 in guard.RequestGuard (inside CORS, logged once)."""

    @app.post("/v1/completions", **generation_docs(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _Generation(state, request, chat=False).run()

    @app.post("/v1/chat/completions", **generation_docs(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await _Generation(state, request, chat=True).run()
