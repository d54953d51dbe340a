"""The fake LLM backend's Anthropic Messages API objects (``POST /v1/messages``).

Pure, a :class:`~muxproxy.testing.fakellm.apistream.Wire`: it only says what each event is;
``apistream.py`` sends them. What it obeys is the Messages wire format, closely enough for the
``anthropic`` Python SDK (``client.messages.create`` and ``client.messages.stream``): one
``text`` content block, ``stop_reason`` ``end_turn``; streamed, ``message_start``,
``content_block_start``, ``ping``, one ``content_block_delta`` (``text_delta``) per token,
``content_block_stop``, ``message_delta`` (``stop_reason``, ``usage.output_tokens``) and
``message_stop``. An engine that fails before its first token answers, as Anthropic does, an
``error`` event of type ``overloaded_error``. ``usage.input_tokens`` counts the words of the
``system`` prompt and the messages (the fake has no tokenizer).
"""

from __future__ import annotations

from typing import Any

import attrs

from muxproxy.testing.fakellm.apistream import Event, prompt_words


@attrs.frozen
class MessagesWire:
    """One message's events."""

    message_id: str
    model: str
    input_tokens: int
    output_tokens: int

    @classmethod
    def of(
        cls, request: dict[str, Any], model: str, ident: str, created: int, tokens: int
    ) -> MessagesWire:
        """The wire answering ``request`` with ``tokens`` tokens (``created`` is unused)."""
        words = prompt_words(request.get("system")) + prompt_words(request.get("messages"))
        return cls(f"msg_{ident}", model, words, tokens)

    def _message(self, text: str | None) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [] if text is None else [{"type": "text", "text": text}],
            "stop_reason": None if text is None else "end_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.input_tokens,
                "output_tokens": 0 if text is None else self.output_tokens,
            },
        }

    def start(self) -> list[Event]:
        return [
            ("message_start", {"type": "message_start", "message": self._message(None)}),
            (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            ),
            ("ping", {"type": "ping"}),
        ]

    def delta(self, text: str) -> list[Event]:
        delta = {"type": "text_delta", "text": text}
        return [
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
        ]

    def end(self, text: str) -> list[Event]:
        delta = {"stop_reason": "end_turn", "stop_sequence": None}
        usage = {"output_tokens": self.output_tokens}
        return [
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}),
            ("message_stop", {"type": "message_stop"}),
        ]

    def whole(self, text: str) -> dict[str, Any]:
        return self._message(text)

    def overloaded(self) -> Event | None:
        error = {"type": "overloaded_error", "message": "Overloaded"}
        return "error", {"type": "error", "error": error}
