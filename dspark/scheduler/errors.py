"""Why the scheduler refused or ended a request; the server maps each to an HTTP status."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """Too many requests in flight: the client should retry later (HTTP 429)."""


class UnavailableError(RuntimeError):
    """The scheduler is not admitting requests: draining or stopped (HTTP 503)."""


class RequestAborted(RuntimeError):
    """The request was aborted before it finished (client gone or server shutting down)."""


class EngineError(RuntimeError):
    """The engine failed while running the request (HTTP 500)."""


class ContextLengthError(ValueError):
    """Prompt plus max_tokens do not fit the model's context."""

    param = "max_tokens"
