"""The fake LLM backend's OpenAI Responses API objects (``POST /v1/responses``).

Pure, a :class:`~muxproxy.testing.fakellm.apistream.Wire`: it only says what each event is;
``apistream.py`` sends them. What it obeys is the Responses wire format, closely enough for the
``openai`` Python SDK (``client.responses.create``, streaming or not): one assistant
``message`` output item holding one ``output_text`` part; streamed, ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per token, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` and ``response.completed`` (with
``usage``), each with the next ``sequence_number`` from 0. An engine that fails before its
first token (die-after 0) answers, after the events before it, an ``error`` event
(``{"type": "error", "code": "server_error", "message", "param", "sequence_number"}``), as the
Responses API reports a failure outside a response.
"""

from __future__ import annotations

from typing import Any

import attrs

from muxproxy.testing.fakellm.apistream import Event, prompt_words


@attrs.define
class ResponsesWire:
    """One response's events, numbered as they are made."""

    response_id: str
    model: str
    created: int
    input_tokens: int
    output_tokens: int
    _sequence: int = attrs.field(default=0, init=False)

    @classmethod
    def of(
        cls, request: dict[str, Any], model: str, ident: str, created: int, tokens: int
    ) -> ResponsesWire:
        """The wire answering ``request`` with ``tokens`` tokens."""
        return cls(f"resp_{ident}", model, created, prompt_words(request.get("input")), tokens)

    @property
    def _item_id(self) -> str:
        return f"msg_{self.response_id}"

    def _event(self, name: str, **fields: Any) -> Event:
        data = {"type": name, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return name, data

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": []}

    def _item(self, text: str | None) -> dict[str, Any]:
        return {
            "id": self._item_id,
            "type": "message",
            "role": "assistant",
            "status": "in_progress" if text is None else "completed",
            "content": [] if text is None else [self._part(text)],
        }

    def _response(self, text: str | None) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": "in_progress" if text is None else "completed",
            "output": [] if text is None else [self._item(text)],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }
        if text is not None:
            obj["usage"] = {
                "input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens,
            }
        return obj

    def start(self) -> list[Event]:
        place = {"item_id": self._item_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.created", response=self._response(None)),
            self._event("response.in_progress", response=self._response(None)),
            self._event("response.output_item.added", output_index=0, item=self._item(None)),
            self._event("response.content_part.added", **place, part=self._part("")),
        ]

    def delta(self, text: str) -> list[Event]:
        place = {"item_id": self._item_id, "output_index": 0, "content_index": 0}
        return [self._event("response.output_text.delta", **place, delta=text, logprobs=[])]

    def end(self, text: str) -> list[Event]:
        place = {"item_id": self._item_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.output_text.done", **place, text=text, logprobs=[]),
            self._event("response.content_part.done", **place, part=self._part(text)),
            self._event("response.output_item.done", output_index=0, item=self._item(text)),
            self._event("response.completed", response=self._response(text)),
        ]

    def whole(self, text: str) -> dict[str, Any]:
        return self._response(text)

    def overloaded(self) -> Event | None:
        return self._event(
            "error", code="server_error", message="The server is overloaded", param=None
        )
