"""The proxy's own error responses: plain text, or the OpenAI API's error shape.

Every response the proxy makes itself (404 no route, 502/503/504 from the exchange, 400, 408,
413, 431 from the client side) is short and says why. By default it is ``text/plain``. On a
route configured with ``api = "openai"`` it is the JSON error object the OpenAI API answers
with, ``{"error": {"message", "type", "param", "code"}}`` as ``application/json``, because that
is what the OpenAI SDKs parse: they put ``message`` into the exception they raise, where a
text body leaves the user with a bare status code. ``type`` follows the API's own use
(``invalid_request_error`` for what the client must fix, ``server_error`` for the rest,
``requests`` for a 429), ``code`` names the status.

A 404 for a path that no route matches is never route-bound, so it is always plain text; so
are errors found before a request head is parsed (a head too large, malformed bytes).

An answer whose body a caller has rendered in the API's own shape (``ErrorBody``: the
``model_not_found`` of an OpenAI or Anthropic path, ``core/exchange/bymodel.py``) goes out as
it is, with the same fields.
"""

from __future__ import annotations

import json

import attrs

from muxproxy.config import Api
from muxproxy.core.messages import Headers

__all__ = ["ErrorBody", "ErrorShape", "error_response"]


@attrs.frozen(kw_only=True)
class ErrorBody:
    """An error's body already rendered, as ``application/json``."""

    body: bytes


ErrorShape = Api | ErrorBody
"""How the proxy's own answer is shaped: a route's ``api``, or a body rendered already."""

_TEXT = b"text/plain; charset=utf-8"
_JSON = b"application/json"

# status -> (type, code) of the OpenAI error object.
_OPENAI: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "bad_request"),
    404: ("invalid_request_error", "not_found"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("requests", "rate_limit_exceeded"),
    431: ("invalid_request_error", "request_header_fields_too_large"),
    501: ("invalid_request_error", "not_implemented"),
    502: ("server_error", "bad_gateway"),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "gateway_timeout"),
}


def error_response(
    status: int, text: str, *, api: ErrorShape | None, date: bytes | None
) -> tuple[Headers, bytes]:
    """The fields and body of a proxy-made ``status`` response saying ``text``.

    ``date``: the ``Date`` value (``dates.HttpDate``), None when the core has no clock."""
    if isinstance(api, ErrorBody):
        body = api.body
        content_type = _JSON
    elif api is Api.OPENAI:
        kind, code = _OPENAI.get(
            status, ("invalid_request_error" if status < 500 else "server_error", f"http_{status}")
        )
        error = {"message": text, "type": kind, "param": None, "code": code}
        body = json.dumps({"error": error}).encode()
        content_type = _JSON
    else:
        body = (text + "\n").encode()
        content_type = _TEXT
    headers: Headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
    ]
    if date is not None:
        headers.append((b"date", date))
    return headers, body
