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

A body made elsewhere (``OwnBody``: a refusal in its API's own error shape,
``core/exchange/refusal.py``; the model list of ``core/apis/modellist.py``) goes out the same
way, with its own body and content type in place of the error text's.
"""

from __future__ import annotations

import json

from muxproxy.config import Api
from muxproxy.core.messages import Headers, OwnBody

__all__ = ["error_response"]

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
    status: int, text: str, *, api: Api | None, date: bytes | None, body: OwnBody | None = None
) -> tuple[Headers, bytes]:
    """The fields and body of a proxy-made ``status`` response saying ``text``, or carrying
    ``body`` where one is given.

    ``date``: the ``Date`` value (``dates.HttpDate``), None when the core has no clock."""
    if body is not None:
        content_type, data = body.content_type, body.data
    elif api is Api.OPENAI:
        kind, code = _OPENAI.get(
            status, ("invalid_request_error" if status < 500 else "server_error", f"http_{status}")
        )
        error = {"message": text, "type": kind, "param": None, "code": code}
        data = json.dumps({"error": error}).encode()
        content_type = _JSON
    else:
        data = (text + "\n").encode()
        content_type = _TEXT
    headers: Headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(data)).encode()),
    ]
    if date is not None:
        headers.append((b"date", date))
    return headers, data
