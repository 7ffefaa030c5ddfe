"""The one place where errors become HTTP responses (OpenAI error shape), for
the server and the gateway alike.

``SluiceError`` subclasses carry their status; pydantic validation errors and
bad JSON become 400 naming the parameter; anything else is a 500 whose text
does not leak internals (the traceback goes to the log).  ``Retry-After`` is
whole seconds, rounded up: a client told to wait 1.2 s waits 2, never less.
"""

from __future__ import annotations

import logging
import math

import msgspec
from pydantic import ValidationError
from starlette.responses import Response

from sluice.errors import InvalidRequestError, MethodNotAllowedError, NotFoundError, SluiceError

__all__ = [
    "to_sluice_error",
    "error_headers",
    "error_response",
    "from_validation_error",
    "from_http_status",
    "retry_after_header",
]

log = logging.getLogger("sluice.http")
_json = msgspec.json.Encoder()


def from_validation_error(e: ValidationError) -> InvalidRequestError:
    errs = e.errors(include_url=False)
    first = errs[0] if errs else {"loc": (), "msg": str(e), "type": ""}
    if first.get("type") == "json_invalid":
        return InvalidRequestError(f"request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if not str(p).startswith(("function-", "union["))]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        msg = f"unrecognized request argument: {param}"
    elif first.get("type") == "missing":
        msg = f"missing required parameter: {param}"
    else:
        msg = f"invalid value for {param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})"
    return InvalidRequestError(msg, param=param, code="invalid_value")


def to_sluice_error(e: BaseException) -> SluiceError:
    if isinstance(e, SluiceError):
        return e
    if isinstance(e, ValidationError):
        return from_validation_error(e)
    log.error("internal error", exc_info=e)
    return SluiceError("internal server error", code="internal_error")


def from_http_status(status: int, method: str, path: str, detail: str) -> SluiceError:
    """The router's own 404 / 405 (and any other HTTP status it raises) in the error tree."""
    if status == 404:
        return NotFoundError(f"no route {method} {path}", code="route_not_found")
    if status == 405:
        return MethodNotAllowedError(f"method {method} not allowed on {path}")
    err = SluiceError(detail)
    err.status_code = status
    return err


def retry_after_header(seconds: float) -> str:
    """``Retry-After`` value: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(seconds - 1e-9)))


def error_headers(e: SluiceError) -> dict[str, str]:
    retry = getattr(e, "retry_after", None)
    return {} if retry is None else {"retry-after": retry_after_header(retry)}


def error_response(e: SluiceError, request_id: str | None = None) -> Response:
    """The OpenAI-shaped JSON error with its status, ``Retry-After`` and (when
    given) ``x-request-id``."""
    headers = error_headers(e)
    if request_id is not None:
        headers["x-request-id"] = request_id
    return Response(_json.encode(e.to_openai()), status_code=e.status_code, headers=headers,
                    media_type="application/json")  # fmt: skip
