"""Which LLM API a request path speaks, by its last segments: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/responses``, ``/v1/messages``, ``/v1/embeddings`` (a body with a
``model``, but no event stream: it has no reader), also under a prefix
(``/openai/v1/chat/completions``) and with a query or a trailing slash. Paths arrive
normalised (``core/http/paths.py``); matching is exact on the segments, so
``/v1/messages_old`` speaks none."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from muxproxy.core.apis.anthropic import read_messages
from muxproxy.core.apis.openai import read_chat, read_completions
from muxproxy.core.apis.reading import Reader
from muxproxy.core.apis.responses import read_responses


class Api(enum.Enum):
    CHAT_COMPLETIONS = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"
    EMBEDDINGS = "/v1/embeddings"


READERS: Mapping[Api, Reader] = {
    Api.CHAT_COMPLETIONS: read_chat,
    Api.COMPLETIONS: read_completions,
    Api.RESPONSES: read_responses,
    Api.MESSAGES: read_messages,
}


_BY_SUFFIX: Mapping[str, Api] = {api.value: api for api in Api}
_SUFFIXES = tuple(_BY_SUFFIX)
"""The paths' last segments, for one ``endswith`` per request (an enum's members and their
values cost a descriptor call each: this runs for every response metered)."""


def api_for(path: str) -> Api | None:
    """The API ``path`` speaks, or ``None``."""
    path = path.partition("?")[0].rstrip("/")
    # endswith on "/v1/..." matches whole segments: the suffix starts with "/".
    if not path.endswith(_SUFFIXES):
        return None
    for suffix, api in _BY_SUFFIX.items():
        if path.endswith(suffix):
            return api
    return None  # pragma: no cover - one of them matched above


def reader_for(path: str) -> Reader | None:
    """The event reader of the API ``path`` speaks, or ``None``."""
    api = api_for(path)
    return None if api is None else READERS.get(api)
