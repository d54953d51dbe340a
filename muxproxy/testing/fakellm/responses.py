"""The fake LLM backend's whole-body responses: JSON, plain bytes and OpenAI-style errors.

Every response carries the backend's common headers (``x-backend-id``, and ``x-model-version``
when set), which :class:`Responder` is made with. Bodies are sent in one ASGI message with
their ``content-length``; errors have OpenAI's shape (``{"error": {"message", "type",
"param", "code"}}``), with the request's headers added under ``request_headers`` when the
client asked for an echo.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs

Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = Sequence[tuple[bytes, bytes]]

HEADER_BACKEND_ID = "x-backend-id"
HEADER_MODEL_VERSION = "x-model-version"


def dumps(obj: object) -> bytes:
    """Compact JSON."""
    return json.dumps(obj, separators=(",", ":")).encode()


@attrs.frozen
class Responder:
    """Writes whole-body responses, each with ``common`` headers."""

    common: tuple[tuple[bytes, bytes], ...]

    @classmethod
    def for_backend(cls, backend_id: str, model_version: str | None) -> Responder:
        """The responder of a backend named ``backend_id``, serving ``model_version``."""
        headers = [(HEADER_BACKEND_ID.encode(), backend_id.encode("latin-1"))]
        if model_version is not None:
            headers.append((HEADER_MODEL_VERSION.encode(), model_version.encode("latin-1")))
        return cls(tuple(headers))

    def json_head(self, status: int, length: int, extra: Headers = ()) -> dict[str, Any]:
        """The ``http.response.start`` of a JSON body of ``length`` bytes."""
        return {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(length).encode()),
                *self.common,
                *extra,
            ],
        }

    async def send_json(self, send: Send, status: int, obj: object, extra: Headers = ()) -> None:
        """Answer ``obj`` as JSON."""
        payload = dumps(obj)
        await send(self.json_head(status, len(payload), extra))
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    async def send_bytes(
        self, send: Send, status: int, payload: bytes, content_type: bytes
    ) -> None:
        """Answer ``payload`` as it is."""
        headers = [
            (b"content-type", content_type),
            (b"content-length", str(len(payload)).encode()),
            *self.common,
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    async def send_error(
        self,
        send: Send,
        status: int,
        message: str,
        error_type: str,
        echo: dict[str, str] | None,
        extra: Headers = (),
        param: str | None = None,
    ) -> None:
        """Answer an OpenAI-style error (``echo``: the request headers to add, or None;
        ``param``: the request field at fault, or None)."""
        obj: dict[str, Any] = {
            "error": {"message": message, "type": error_type, "param": param, "code": status}
        }
        if echo is not None:
            obj["request_headers"] = echo
        await self.send_json(send, status, obj, extra)
