"""The fake LLM backend's wire formats other than chat completions, by request path.

Each makes the :class:`~muxproxy.testing.fakellm.apistream.Wire` of one request from
``(request, model, id, created, tokens)``; ``app.py`` routes these paths to ``apistream.py``.
Kept apart so the app imports one table, not every format.
"""

from __future__ import annotations

from collections.abc import Callable

from muxproxy.testing.fakellm.anthropic_messages import MessagesWire
from muxproxy.testing.fakellm.apistream import Wire
from muxproxy.testing.fakellm.openai_responses import ResponsesWire

WIRES: dict[str, Callable[..., Wire]] = {
    "/v1/responses": ResponsesWire.of,
    "/v1/messages": MessagesWire.of,
}
"""Request path -> the maker of its wire."""

PREFILL = frozenset({"/v1/messages"})
"""Paths whose final assistant message is continued without ``continue_final_message``: the
Anthropic Messages API's prefill."""
