"""Errors as the client sees them: OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.

Every refusal the server makes is an `ApiError`; the handlers raise it and the app turns it into
a JSON response. A 5xx also says `Connection: close`: after an unexpected failure the state of the
connection (an unread body, a half-written reply) is unknown, so the client is told to open a
fresh one rather than finding its next request reset.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from engine.errors import ContextLengthError, GpurigError
from engine.server.schemas import ErrorBody, ErrorResponse


def excerpt(value: object, limit: int = 60) -> str:
    """A client's value, cut short, for an error message: a reply never echoes a whole
    megabyte back."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class ApiError(Exception):
    """An error to send to the client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})
        self.body = ErrorResponse(
            error=ErrorBody(message=message, type=type_, param=param, code=code)
        )

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.status >= 500:
            headers["connection"] = "close"
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=headers)


def server_error(exc: BaseException) -> ApiError:
    """A 500 for a failure that is the server's fault; names the exception's type only (its
    text may hold request data or paths)."""
    return ApiError(500, f"Internal error: {type(exc).__name__}", type_="server_error")


def context_error(limit: int, prompt_len: int, asked: int | None, param: str) -> ApiError:
    """OpenAI's wording for a prompt (+ completion) over the context, so clients that look for
    it (and people) recognise it."""
    if asked is None:  # the prompt alone leaves no room for one token
        told = (f"However, your prompt has {prompt_len} tokens, which leaves no room for a "
                "completion. Please reduce the length of the prompt.")  # fmt: skip
    else:
        told = (f"However, you requested {prompt_len + asked} tokens ({prompt_len} in the "
                f"prompt, {asked} in the completion). Please reduce the length of the prompt "
                "or of max_tokens.")  # fmt: skip
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. {told}",
        param=param,
        code="context_length_exceeded",
    )


# Error categories (engine/errors.py) that are the client's to fix: 400. Anything else the
# engine raises while running a job (a prompt that does not fit in memory, say) is a 500.
CLIENT_CATEGORIES = ("invalid_input", "refused")


def engine_error_to_api(exc: BaseException | None, param: str | None = None) -> ApiError:
    """The client's view of an error the engine raised on a request (naming `param` where the
    request's field is known)."""
    if isinstance(exc, ContextLengthError):
        return ApiError(
            400,
            f"This model's maximum context length is {exc.limit} tokens; the prompt has "
            f"{exc.requested}.",
            param="messages",
            code="context_length_exceeded",
        )
    if isinstance(exc, GpurigError) and exc.category in CLIENT_CATEGORIES:  # GenerationError
        if param is not None:
            return ApiError(400, f"{exc.message[:1].upper()}{exc.message[1:]}.", param=param)
        return ApiError(400, str(exc))
    return ApiError(500, f"Generation failed: {type(exc).__name__}: {exc}", type_="server_error")
