"""The proxy's exception tree and its OpenAI-shaped error bodies.

Every failure the API can answer is a `ClawrlError` subclass carrying its HTTP status, the
OpenAI error `type` and a `code`. Foreign errors (httpx, psycopg, engine HTTP errors) are
translated into these at one boundary (proxy/upstream.py, proxy/store.py) with
`raise … from exc`.
"""

from __future__ import annotations

from typing import Any


class ClawrlError(Exception):
    status: int = 500
    type: str = "api_error"
    code: str | None = "internal_error"

    def __init__(self, message: str, *, code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.headers = headers or {}
        self.param = param  # the request field at fault, when there is one

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code,
                          "param": self.param}}


class BadRequest(ClawrlError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class Unauthorized(ClawrlError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class Forbidden(ClawrlError):
    status, type, code = 403, "permission_error", "forbidden"


class NotFound(ClawrlError):
    status, type, code = 404, "invalid_request_error", "not_found"


class PayloadTooLarge(ClawrlError):
    status, type, code = 413, "invalid_request_error", "payload_too_large"


class RateLimited(ClawrlError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, retry_after_s))})
        self.retry_after_s = retry_after_s


class UpstreamError(ClawrlError):
    """The engine answered with an error or could not be reached."""

    status, type, code = 502, "api_error", "engine_error"


class UpstreamTimeout(ClawrlError):
    status, type, code = 504, "api_error", "engine_timeout"


class Unavailable(ClawrlError):
    status, type, code = 503, "api_error", "unavailable"
