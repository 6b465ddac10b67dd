"""OpenAI's error shape, and the handlers that answer every failure in it.

Contract:
    * Every error the API answers has the body
      ``{"error": {"message", "type", "param", "code"}}``; ``Retry-After`` is set when
      the error says when to come back (429, 503); a 401 carries
      ``WWW-Authenticate: Bearer`` (RFC 6750).
    * A request FastAPI cannot validate is a 400 ``invalid_value`` naming the first bad
      parameter; an exception nobody caught is a 500 ``internal``, logged with its
      traceback, and the process keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from dscache_server.auth import AuthError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class APIError(Exception):
    """An error answered in OpenAI's error shape.

    Attributes:
        status: the HTTP status.
        message: what went wrong, for a person.
        type_: OpenAI's error type (``invalid_request_error``, ``rate_limit_error``...).
        code: a stable machine-readable code (``queue_full``, ``not_ready``...).
        param: the request parameter at fault, if one is.
        retry_after: seconds for the ``Retry-After`` header, if the client should retry.
        headers: more response headers.
    """

    status: int
    message: str
    type_: str = field(default="invalid_request_error", kw_only=True)
    code: str | None = field(default=None, kw_only=True)
    param: str | None = field(default=None, kw_only=True)
    retry_after: int | None = field(default=None, kw_only=True)
    headers: dict[str, str] = field(default_factory=dict, kw_only=True)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, dict[str, str | None]]:
        """The JSON body: ``{"error": {...}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type_,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """The JSON response for this error."""
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


#: The error a client sees when the server failed, in a response or mid-stream.
INTERNAL_ERROR = APIError(500, "internal error", type_="server_error", code="internal")


def refused(exc: AuthError) -> APIError:
    """The answer to a request authentication refused (401 with a Bearer challenge, or 400)."""
    challenge = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    return APIError(exc.status, exc.message, type_=exc.type_, code=exc.code, headers=challenge)


def validation_error(errors: Sequence[Mapping[str, object]]) -> APIError:
    """A 400 naming the first of pydantic's validation errors."""
    first: Mapping[str, object] = errors[0] if errors else {}
    loc = first.get("loc", ())
    parts = [str(x) for x in loc if x != "body"] if isinstance(loc, (list, tuple)) else []
    param = ".".join(parts) or None
    msg = str(first.get("msg", "invalid request"))
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _invalid(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).response()


async def _bug(_request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error: %s", exc, exc_info=exc)
    return INTERNAL_ERROR.response()


def install_error_handlers(app: FastAPI) -> None:
    """Answers ``APIError``, validation failures and bugs in OpenAI's shape."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(Exception, _bug)
