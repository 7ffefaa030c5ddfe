"""The one place where errors become HTTP responses (OpenAI error shape).

``SluiceError`` subclasses carry their status; pydantic validation errors and
bad JSON become 400 naming the parameter; anything else is a 500 whose text
does not leak internals (the traceback goes to the log).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from sluice.errors import InvalidRequestError, SluiceError

__all__ = ["to_sluice_error", "error_body", "error_headers", "from_validation_error", "PayloadTooLargeError"]

log = logging.getLogger("sluice.server")


class PayloadTooLargeError(InvalidRequestError):
    status_code = 413

    def __init__(self, limit: int):
        super().__init__(
            f"request body is larger than the server's limit of {limit} bytes (--max-request-bytes)",
            code="request_too_large",
        )


class NotFoundError(SluiceError):
    status_code = 404
    error_type = "not_found_error"


class MethodNotAllowedError(SluiceError):
    status_code = 405
    error_type = "invalid_request_error"


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


def error_body(e: SluiceError) -> dict[str, Any]:
    return e.to_openai()


def error_headers(e: SluiceError) -> dict[str, str]:
    retry = getattr(e, "retry_after", None)
    if retry is None:
        return {}
    return {"retry-after": str(max(1, int(retry + 0.999)))}
