"""sluice's error tree (torch-free).  HTTP layers map it to OpenAI-shaped errors
in one place (``status_code`` / ``error_type`` below).

    SluiceError
     ├── InvalidRequestError        400  bad input: sampling values, prompt too long, ...
     │    └── ContextLengthError    400  prompt (+ max_tokens) exceeds the context window
     ├── ModelNotFoundError         404  unknown model name / path
     ├── ModelLoadError             500  a model file exists but cannot be read (corrupt GGUF, ...)
     ├── AuthenticationError        401
     ├── RateLimitError             429  (carries retry_after seconds)
     ├── OverloadedError            429  admission control: queue full
     ├── ServiceUnavailableError    503  draining, engine dead, no healthy replica
     └── EngineDeadError            503  the engine core process is gone
"""

from __future__ import annotations

__all__ = [
    "SluiceError",
    "InvalidRequestError",
    "ContextLengthError",
    "ModelNotFoundError",
    "ModelLoadError",
    "AuthenticationError",
    "RateLimitError",
    "OverloadedError",
    "ServiceUnavailableError",
    "EngineDeadError",
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


class ModelNotFoundError(SluiceError, FileNotFoundError):
    status_code = 404
    error_type = "not_found_error"

    def __init__(self, message: str, *, param: str | None = "model"):
        super().__init__(message, param=param, code="model_not_found")


class ModelLoadError(SluiceError):
    status_code = 500
    error_type = "model_load_error"


class AuthenticationError(SluiceError):
    status_code = 401
    error_type = "authentication_error"


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
