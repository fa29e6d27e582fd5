"""OpenAI's error JSON for every failure of the HTTP endpoint: `{"error": {"message", "type", "param", "code"}}`.

`ApiError` is what handlers raise; `error_middleware` turns it, a gRPC error from the router, aiohttp's own errors
(404 unknown route, 405 method, 413 body too large) and any unexpected exception (a logged 500) into that body, so
no client ever gets aiohttp's plain-text pages.
"""

from __future__ import annotations

import logging
import math

import grpc
from aiohttp import web

log = logging.getLogger(__name__)

# gRPC status -> (HTTP status, OpenAI error type). 5xx only where the server is at fault or cannot serve now:
# FAILED_PRECONDITION reaches HTTP clients only from the servers' own state (a lease used twice, say), so it is a
# retryable 503, not the client's 400.
GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error"),  # nginx's "client closed request"
    grpc.StatusCode.INTERNAL: (500, "server_error"),
    grpc.StatusCode.UNKNOWN: (500, "server_error"),
    grpc.StatusCode.DATA_LOSS: (500, "server_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (503, "service_unavailable_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
RETRY_AFTER_DEFAULT = 1.0  # seconds: the hint on a 429 / 503 that came without one


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after  # seconds, sent as `Retry-After`
        self.headers: dict[str, str] = {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return web.json_response(self.body(), status=self.status, headers=headers or None)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, None)


def from_grpc(e: grpc.aio.AioRpcError) -> ApiError:
    status, type_ = GRPC_TO_HTTP.get(e.code(), (500, "server_error"))
    err = ApiError(status, e.details() or e.code().name, type_, None, e.code().name.lower())
    try:
        hint = dict(e.trailing_metadata() or ()).get("retry-after-ms")
    except Exception:  # no trailing metadata on this error
        hint = None
    if isinstance(hint, str) and hint.isdigit():
        err.retry_after = int(hint) / 1000
    elif status in (429, 503):
        err.retry_after = RETRY_AFTER_DEFAULT
    return err


def from_http_exception(request: web.Request, e: web.HTTPException) -> ApiError:
    """aiohttp's own 4xx/5xx (routing, body size) in OpenAI's shape; its headers (e.g. `Allow` on a 405) kept."""
    if e.status == 404:
        message = f"Invalid URL ({request.method} {request.path})"
    elif e.status == 405:
        message = f"Method {request.method} is not allowed on {request.path}"
    else:
        message = e.text or e.reason
    err = ApiError(e.status, message, "invalid_request_error" if e.status < 500 else "server_error")
    err.headers = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type", "content-length")}
    return err


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except grpc.aio.AioRpcError as e:
        return from_grpc(e).response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return from_http_exception(request, e).response()
    except Exception:  # a bug: logged with its traceback, answered as OpenAI's 500 without internals
        log.exception("unexpected error on %s %s", request.method, request.path)
        return internal_error().response()


def internal_error() -> ApiError:
    return ApiError(500, "internal server error (logged on the router)", "server_error", code="internal_error")
