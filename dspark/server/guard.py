"""Request ids, and the last line of defence against a bug.

Every HTTP request gets an id: the client's `x-request-id` header when it sends one (as vLLM
takes it), else a fresh one; the response carries it back in `x-request-id`, and handlers read
it with request_id(request). An exception that no handler turned into a response becomes a
JSON 500 naming the id, logged once (one record, with its traceback), here inside the app:
Starlette's ServerErrorMiddleware would answer and then re-raise it to the server, which drops
the connection, keep-alive or not.
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dspark.server.protocol import APIError

logger = logging.getLogger("dspark.server")
REQUEST_ID_HEADER = "x-request-id"
_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII without spaces: safe to log and echo


def request_id(request: Request) -> str:
    """The id RequestGuard gave this request ("-" outside it)."""
    return request.scope.get("state", {}).get("request_id", "-")


def safe_text(text: str) -> str:
    """text with any lone surrogate written as its escape, so it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates as \udxxx


class RequestGuard:
    """ASGI middleware: request ids, and a JSON 500 for any exception (see the module's docstring).
    Added inside CORS, so the 500 has CORS headers too."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == REQUEST_ID_HEADER.encode()), "")
        rid = given if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        started = finished = False

        async def send_with_id(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:
            what = safe_text(f"{type(e).__name__}: {e}")
            logger.error("request %s (%s %s) failed: %s", rid, scope.get("method"), scope.get("path"), what,
                         exc_info=e)
            if finished:
                return
            if started:  # a response cut short: end it, so the connection stays usable
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            err = APIError(500, f"internal error (request id {rid}): {what}")
            await JSONResponse(err.body(), status_code=500)(scope, receive, send_with_id)
