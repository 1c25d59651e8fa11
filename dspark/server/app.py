"""The FastAPI app: OpenAI-compatible completions and chat (REST + SSE), models, tokenization,
health, metrics.

`create_app(engine_or_config)` builds one self-contained app: its own scheduler, worker
thread and Prometheus registry. Given an EngineConfig, the engine loads in the background
after start-up and every model endpoint answers 503 until it is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark import __version__
from dspark.config import EngineConfig, SpecConfig
from dspark.engine.engine import Engine
from dspark.scheduler.scheduler import AsyncEngine
from dspark.server.guard import REQUEST_ID_HEADER, RequestGuard
from dspark.server.metrics import ServerMetrics
from dspark.server.openapi import error_responses, install_openapi
from dspark.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from dspark.server.serving import add_generation_routes
from dspark.server.tokenization import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    add_tokenization_routes,
)
from dspark.server.tool_parsers import HermesParser, Llama3JsonParser, make_parser

logger = logging.getLogger("dspark.server")


async def _in_daemon_thread(fn, *args):  # noqa: ANN202 - fn's result
    """fn(*args) in a daemon thread. asyncio.to_thread's executor threads are joined when the
    loop closes, so a SIGTERM during a long model load would wait for the load to finish; a
    daemon thread is simply dropped (what it writes to disk is written atomically)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value) -> None:  # noqa: ANN001
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def run() -> None:
        try:
            out, ok = fn(*args), True
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            out, ok = e, False
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, ok, out)

    threading.Thread(target=run, name="dspark-load", daemon=True).start()
    return await fut


class ServerState:
    """What one app owns: the engine once loaded, its scheduler and metrics, and the settings."""

    def __init__(self, served_model_name: str | list[str] | None, api_key: str | None, max_queue: int,
                 shutdown_timeout: float, log_interval: float, metrics_window_s: float,
                 tool_parser: HermesParser | Llama3JsonParser | None = None, replica_name: str | None = None):
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        self.names = names
        self.api_key = api_key or None
        self.max_queue = max_queue
        self.shutdown_timeout = shutdown_timeout
        self.log_interval = log_interval
        self.metrics_window_s = metrics_window_s
        self.tool_parser = tool_parser  # None: tool_choice "auto" is refused
        self.replica_name = replica_name  # a "replica" label on every metric (several servers, one endpoint)
        self.engine: Engine | None = None
        self.scheduler: AsyncEngine | None = None
        self.metrics: ServerMetrics | None = None
        self.load_error: str | None = None
        self.created = int(time.time())

    @property
    def fatal(self) -> str | None:
        """Why a running engine stopped for good (a tensor-parallel worker died), if it did."""
        return self.scheduler.fatal if self.scheduler is not None else None

    @property
    def status(self) -> str:
        """loading | ready | shutting down | failed."""
        if self.load_error or self.fatal:
            return "failed"
        if self.scheduler is None:
            return "loading"
        return "ready" if self.scheduler.accepting else "shutting down"

    def attach(self, engine: Engine) -> None:
        """Start serving `engine` (from the event loop)."""
        self.names = self.names or [engine.model_name]
        metrics = ServerMetrics(self.names[0], self.replica_name)
        metrics.set_baseline(engine.num_preemptions, engine.pool.prefix_queries, engine.pool.prefix_hits)
        sched = AsyncEngine(engine, self.max_queue, [metrics], self.log_interval, self.metrics_window_s)
        metrics.bind_window(sched.window)
        sched.start()
        self.engine, self.metrics, self.scheduler = engine, metrics, sched
        logger.info("serving %s (drafter %s, max_model_len %d, max_num_seqs %d, max_queue %d)", self.names[0],
                    engine.spec.name, engine.max_model_len, engine.config.max_num_seqs, self.max_queue)

    async def load(self, config: EngineConfig) -> None:
        try:
            engine = await _in_daemon_thread(Engine, config)
        except Exception as e:
            self.load_error = f"{type(e).__name__}: {e}"
            logger.exception("loading the engine failed")
            return
        self.attach(engine)

    def require_ready(self) -> AsyncEngine:
        if self.status != "ready":
            msg = {"loading": "the model is still loading; retry shortly",
                   "failed": f"the engine failed to load: {self.load_error}" if self.load_error
                   else f"the engine stopped: {self.fatal}"}.get(
                       self.status, "the server is shutting down")
            raise APIError(503, msg)
        assert self.scheduler is not None
        return self.scheduler

    def check_model(self, name: str | None) -> str:
        """The model name to answer with (an absent or empty one means the first served name, as in
        vLLM); APIError(404) for a name this server does not serve."""
        if not name or name in self.names:
            return name or self.names[0]
        raise APIError(404, f"The model `{name}` does not exist. Available: {', '.join(self.names)}",
                       param="model")

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not secrets.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           err_type="authentication_error")


def create_app(engine_or_config: Engine | EngineConfig | None = None, *,
               served_model_name: str | list[str] | None = None, api_key: str | None = None,
               max_queue: int = 256, shutdown_timeout: float = 30.0, log_interval: float = 5.0,
               metrics_window_s: float = 10.0, allowed_origins: list[str] | tuple[str, ...] = ("*",),
               tool_call_parser: str | None = None, replica_name: str | None = None) -> FastAPI:
    """An app serving a loaded Engine, or an EngineConfig loaded in the background (None: the
    defaults of `dspark serve`, the load-aware policy included).

    api_key: when set, /v1/* need `Authorization: Bearer <api_key>` (health and metrics stay open).
    allowed_origins: browser origins CORS admits (vLLM's default: any; credentials are never allowed).
    max_queue: requests allowed beyond max_num_seqs before 429. shutdown_timeout: seconds running
    requests get to finish at shutdown before they are aborted. tool_call_parser: the format
    tool_choice "auto" reads tool calls in (vLLM's --tool-call-parser; None: "auto" is refused).
    replica_name: labels every metric with replica=<name> (one of several servers behind a balancer).
    """
    parser = make_parser(tool_call_parser) if tool_call_parser is not None else None
    state = ServerState(served_model_name, api_key, max_queue, shutdown_timeout, log_interval, metrics_window_s,
                        parser, replica_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        load = None
        if isinstance(engine_or_config, Engine):
            state.attach(engine_or_config)
        else:
            config = engine_or_config or EngineConfig(spec=SpecConfig(policy="load-aware"))
            load = asyncio.create_task(state.load(config))
        yield
        if load is not None and not load.done():
            load.cancel()
        if state.scheduler is not None:
            await state.scheduler.drain(state.shutdown_timeout)
            await state.scheduler.stop()
        if state.engine is not None:
            state.engine.close()  # tensor-parallel workers

    app = FastAPI(title="dspark", version=__version__, lifespan=lifespan)
    app.state.dspark = state
    app.add_middleware(RequestGuard)  # any other exception: a JSON 500 (inside CORS: added first)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=[REQUEST_ID_HEADER])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "invalid_request_error", None, 400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        err = APIError(e.status_code, str(e.detail))
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.get("/health", responses={503: {"description": "not ready: {\"status\": loading | failed | shutting down}"}})
    async def health() -> Response:
        status = state.status
        return JSONResponse({"status": "ok" if status == "ready" else status},
                            status_code=200 if status == "ready" else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus' text format
    async def metrics() -> Response:
        body = state.metrics.render() if state.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        eng = state.engine
        spec = {"drafter": eng.spec.name, "block_size": eng.spec.block_size, "policy": eng.config.spec.policy}
        return {"id": name, "object": "model", "created": state.created, "owned_by": "dspark",
                "root": eng.model_name, "max_model_len": eng.max_model_len, "speculation": spec}

    @app.get("/v1/models", responses=error_responses(401, 500, 503))
    async def models(request: Request) -> dict:
        state.check_auth(request)
        state.require_ready()
        return {"object": "list", "data": [model_card(name) for name in state.names]}

    # OpenAI's retrieve (vLLM has none); a name may hold "/"
    @app.get("/v1/models/{name:path}", responses=error_responses(401, 404, 500, 503))
    async def model(name: str, request: Request) -> dict:
        state.check_auth(request)
        state.require_ready()
        return model_card(state.check_model(name))

    add_generation_routes(app, state)
    add_tokenization_routes(app, state)
    install_openapi(app, (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest,
                          DetokenizeRequest))
    return app
