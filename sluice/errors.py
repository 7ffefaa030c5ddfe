"""sluice's error tree (torch-free).  HTTP layers map it to OpenAI-shaped errors
in one place (``sluice.http_errors.error_response``, using ``status_code`` /
``error_type`` below); the engine core sends it across the process boundary as
``engine.protocol.EngineError`` and ``from_parts`` rebuilds it.

    SluiceError                     500  internal error
     ├── InvalidRequestError        400  bad input: sampling values, prompt too long, ...
     │    ├── ContextLengthError    400  prompt (+ max_tokens) exceeds the context window
     │    └── PayloadTooLargeError  413  request body over the configured limit
     ├── NotFoundError              404  no such route
     │    └── ModelNotFoundError    404  unknown model name / path
     ├── MethodNotAllowedError      405  route exists, method does not
     ├── ConflictError              409  the resource is busy (a profile is already running)
     ├── ConfigError                500  a bad setting (flag, SLUICE_* variable, config file);
     │                                   the CLI prints it as one line and exits 2
     ├── ModelLoadError             500  a model file exists but cannot be read (corrupt GGUF, ...)
     ├── AuthenticationError        401
     ├── PermissionDeniedError      403  the caller may not use this endpoint (admin routes)
     ├── RateLimitError             429  (carries retry_after seconds)
     ├── OverloadedError            429  admission control: queue full
     ├── ServiceUnavailableError    503  draining, engine dead, no healthy replica
     │    └── EngineDeadError       503  the engine core process is gone
     └── ProfilerUnavailableError   503  py-spy missing or not allowed to attach (ptrace); no retry helps
"""

from __future__ import annotations

__all__ = [
    "SluiceError",
    "InvalidRequestError",
    "ContextLengthError",
    "PayloadTooLargeError",
    "NotFoundError",
    "ModelNotFoundError",
    "MethodNotAllowedError",
    "ConflictError",
    "ConfigError",
    "ModelLoadError",
    "AuthenticationError",
    "PermissionDeniedError",
    "RateLimitError",
    "OverloadedError",
    "ServiceUnavailableError",
    "EngineDeadError",
    "ProfilerUnavailableError",
    "from_parts",
]


class SluiceError(Exception):
    status_code: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequestError(SluiceError, ValueError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    def __init__(self, message: str, *, param: str | None = "prompt"):
        super().__init__(message, param=param, code="context_length_exceeded")


class PayloadTooLargeError(InvalidRequestError):
    status_code = 413

    def __init__(self, limit: int, *, setting: str = "--max-request-bytes"):
        super().__init__(
            f"request body is larger than the limit of {limit} bytes ({setting})", code="request_too_large"
        )


class NotFoundError(SluiceError):
    status_code = 404
    error_type = "not_found_error"


class ModelNotFoundError(NotFoundError, FileNotFoundError):
    def __init__(self, message: str, *, param: str | None = "model"):
        super().__init__(message, param=param, code="model_not_found")


class MethodNotAllowedError(SluiceError):
    status_code = 405
    error_type = "invalid_request_error"


class ConflictError(SluiceError):
    status_code = 409
    error_type = "conflict_error"


class ConfigError(SluiceError, ValueError):
    """A bad setting.  ``setting`` is the field name (``max_num_seqs``) when one is
    to blame; the settings layer rewrites the message to name its flag."""

    error_type = "configuration_error"

    def __init__(self, message: str, *, setting: str | None = None):
        super().__init__(message, param=setting, code="invalid_setting")
        self.setting = setting


class ModelLoadError(SluiceError):
    status_code = 500
    error_type = "model_load_error"


class AuthenticationError(SluiceError):
    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(SluiceError):
    status_code = 403
    error_type = "permission_error"


class _RetryAfter(SluiceError):
    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None):
        super().__init__(message, code=code)
        self.retry_after = retry_after


class RateLimitError(_RetryAfter):
    status_code = 429
    error_type = "rate_limit_error"


class OverloadedError(_RetryAfter):
    status_code = 429
    error_type = "overloaded_error"


class ServiceUnavailableError(_RetryAfter):
    status_code = 503
    error_type = "service_unavailable"


class EngineDeadError(ServiceUnavailableError):
    pass


class ProfilerUnavailableError(SluiceError):
    status_code = 503
    error_type = "profiler_unavailable"


def from_parts(
    error_type: str,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    retry_after: float | None = None,
) -> SluiceError:
    """Rebuild an error from its wire form (``EngineError``): the most specific
    class the type and code name, with the same message, param and code."""
    if code == "context_length_exceeded":
        return ContextLengthError(message, param=param)
    if error_type == ModelNotFoundError.error_type and code == "model_not_found":
        return ModelNotFoundError(message, param=param)
    retrying: dict[str, type[_RetryAfter]] = {
        c.error_type: c for c in (RateLimitError, OverloadedError, ServiceUnavailableError)
    }
    if error_type in retrying:
        return retrying[error_type](message, retry_after=1.0 if retry_after is None else retry_after, code=code)
    plain: dict[str, type[SluiceError]] = {
        c.error_type: c
        for c in (InvalidRequestError, NotFoundError, AuthenticationError, PermissionDeniedError, ModelLoadError,
                  ConflictError, ProfilerUnavailableError, SluiceError)
    }
    return plain.get(error_type, SluiceError)(message, param=param, code=code)
