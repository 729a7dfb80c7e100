"""Reading and validating a request body: bytes on the event loop, everything else off it.

`read_body` only gathers bytes (refusing more than the limit as soon as it is passed, before the
rest arrives); `parse_request` runs in a worker thread and turns them into a request model:
strict UTF-8 (RFC 8259 allows no other encoding), JSON, plain Unicode (a lone UTF-16 surrogate
such as "\\ud800" is refused by name, it cannot be encoded for the tokenizer or in the reply),
then the pydantic model with errors that name the field.

The bytes are decoded here, not by `json.loads(bytes)`: that guesses UTF-16/32 from the first
bytes and decodes UTF-8 with "surrogatepass", so the raw bytes of a surrogate (ED A0 80) would
reach the tokenizer as a lone surrogate and fail there, a 500.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from engine.server.errors import ApiError

M = TypeVar("M", bound=BaseModel)

# a \uD800-\uDFFF escape: only then can the parsed JSON hold a surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "NamedToolChoice", "literal"}


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"The request body is over {limit} bytes, more than this server accepts (or than the "
        "model's context could hold). Send a shorter prompt.",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it passes `limit` bytes (by its Content-Length or while
    it arrives)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


_UTF8_BOM = b"\xef\xbb\xbf"
# the first bytes of UTF-16/32 JSON: a BOM, or a NUL beside the first ASCII character
_OTHER_ENCODINGS = (b"\xff\xfe", b"\xfe\xff", b"\x00")


def decode_utf8(body: bytes) -> str:
    """The body as text: strict UTF-8 (no surrogates, no overlong forms), a UTF-8 BOM skipped
    as RFC 8259 permits; anything else a 400 that says where it went wrong."""
    if body.startswith(_UTF8_BOM):
        body = body[len(_UTF8_BOM) :]
    elif body.startswith(_OTHER_ENCODINGS) or body[1:2] == b"\x00":
        raise ApiError(
            400,
            "The request body is not UTF-8 (it looks like UTF-16 or UTF-32). Send the JSON "
            "encoded as UTF-8.",
            code="invalid_encoding",
        )
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = body[exc.start : exc.end].hex(" ")
        raise ApiError(
            400,
            f"The request body is not valid UTF-8: bytes {bad} at offset {exc.start} "
            f"({exc.reason}). Send the JSON encoded as UTF-8; a character outside UTF-8, such "
            "as a lone surrogate, cannot be sent at all.",
            code="invalid_encoding",
        ) from None


def parse_json(body: bytes) -> dict[str, Any]:
    text = decode_utf8(body)
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, "The request body is nested too deeply.") from None
    except ValueError as exc:
        raise ApiError(400, f"The request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(body):
        _check_unicode(data)
    return data


def _check_unicode(data: Any) -> None:
    """Refuse strings (values or keys) holding a lone surrogate, naming where. Iterative: the
    body may be nested as deep as json.loads allows."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path))
                key = k.encode("utf-8", "backslashreplace").decode("utf-8")  # the path is sent
                stack.append((v, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                char = f"\\u{ord(value[exc.start]):04x}"
                where = f" in '{path}'" if path else ""
                raise ApiError(
                    400,
                    f"The request holds a lone UTF-16 surrogate ({char}){where}, which is not a "
                    "Unicode character. Send valid Unicode text (a surrogate only as half of a "
                    "pair).",
                    param=path or None,
                    code="invalid_unicode",
                ) from None


def validate(data: dict[str, Any], model: type[M]) -> M:
    """The request model for `data`; a 422 naming the first bad field, or a 400 for a request
    that is valid OpenAI but asks for what this server cannot do."""
    try:
        parsed = model.model_validate(data)
    except RecursionError:
        raise ApiError(400, "The request body is nested too deeply.") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        # drop pydantic's union-member tags ("str", "list[int]", ...) from the field path
        path = [str(p) for p in first["loc"] if str(p) not in _TYPE_TAGS and "[" not in str(p)]
        param = ".".join(path) or None
        count = exc.error_count()
        more = f" (and {count - 1} more problem{'s' if count > 2 else ''})" if count > 1 else ""
        raise ApiError(
            422,
            f"Invalid value for '{param}': {first['msg']}{more}",
            param=param,
            code="invalid_type" if first["type"].endswith("_type") else "invalid_value",
        ) from None
    name = parsed.unsupported_field()  # type: ignore[attr-defined]
    if name is not None:
        raise ApiError(
            400,
            f"'{name}' is not supported by this server; leave it out (or at its default).",
            param=name,
            code="unsupported_parameter",
        )
    if parsed.stream_options is not None and not parsed.stream:  # type: ignore[attr-defined]
        raise ApiError(  # as OpenAI refuses it
            400,
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code="invalid_value",
        )
    return parsed


def parse_request(
    body: bytes, model: type[M], precheck: Callable[[dict[str, Any]], None] | None = None
) -> M:
    """JSON -> Unicode check -> `precheck(data)` (cheap refusals before validating, e.g. a token
    list longer than the context) -> the model. Blocking: run it off the event loop."""
    data = parse_json(body)
    if precheck is not None:
        precheck(data)
    return validate(data, model)
