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


def api_for(path: str) -> Api | None:
    """The API ``path`` speaks, or ``None``."""
    path = path.partition("?")[0].rstrip("/")
    for api in Api:
        if path == api.value or path.endswith(api.value):
            # endswith on "/v1/..." matches whole segments: the suffix starts with "/".
            return api
    return None


def reader_for(path: str) -> Reader | None:
    """The event reader of the API ``path`` speaks, or ``None``."""
    api = api_for(path)
    return None if api is None else READERS.get(api)
