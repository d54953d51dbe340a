"""What routing and admission read from an OpenAI-style request body: how many tokens it may
generate, the key of its prompt's leading part, and the model it names.

Obeys the routing rules: pure code, standard library and attrs only, no clock, no I/O, never
raises on client input (a body that is not JSON, or JSON of another shape, gives no facts).
The body is parsed once per request (``parse_json_body``); every reader takes the parsed
document.

- Expected tokens: ``max_completion_tokens``, else ``max_tokens`` (the chat and completions
  APIs' names, OpenAI's newer one first; Anthropic's Messages too), else ``max_output_tokens``
  (the Responses API's), when it is an integer >= 1; ``n`` > 1 choices
  multiply it (each choice is generated). Otherwise None: the group's
  ``default_max_tokens`` stands in.
- The model: ``model``, a string of 1 to ``MAX_MODEL`` characters (the OpenAI and Anthropic
  APIs' name, and vLLM's name for a LoRA adapter: ``routing/lora.py`` places by it).
- The prefix key (``affinity = "prefix"``): the text the engine computes first and reuses
  across requests. For a chat request: its system part (the system and developer messages
  before the first other message, in order, each as its role, a line feed, its text and a
  NUL), bounded to its first ``length`` bytes (UTF-8), then its first turn (the first other
  message, usually the user's, written the same way), bounded to its own first ``length``
  bytes. Each part has its own bound so that a system prompt longer than ``length`` does not
  swallow the first turn: single questions behind one long system prompt spread by their
  question, and a conversation keeps its key on every later turn (they repeat the same
  system part and first turn). For a completion request: the first ``length`` bytes of its
  ``prompt`` (a string, the first of a list of strings, or a list of token ids as their JSON
  text). Content given as parts takes the ``text`` of its text parts and the URL of its
  image parts. The key is a 16-byte blake2b of that, the same in every process (as
  ``affinity.py``'s key hash): replicas agree on where a prefix goes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import attrs

__all__ = ["INVALID", "MAX_MODEL", "LlmRequest", "parse_json_body", "read_request"]

INVALID: object = object()
"""The document of a body that is not JSON (or too deep to parse)."""


def parse_json_body(body: bytes) -> object:
    """The JSON document of ``body``, or ``INVALID``."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return INVALID


@attrs.frozen
class LlmRequest:
    max_tokens: int | None = None
    """Tokens the request may generate, as it says (None: it does not say)."""
    prefix_key: bytes | None = None
    """The key of its prompt's leading part (None: no prompt, or not asked for)."""
    model: str | None = None
    """The model it names (None: none, or not a string of 1 to ``MAX_MODEL`` characters)."""


NOTHING = LlmRequest()

_MESSAGE_ROLES = frozenset({"system", "developer"})
MAX_MODEL = 256
"""Characters of a model name read at most (Hugging Face ids are at most 96; a longer name
is nobody's model, and routing keeps no longer strings from a client)."""
_MAX_CHOICES = 128
"""``n`` above this is taken as this (the expectation must stay a bounded number)."""


def read_request(document: object, *, source: str = "auto", length: int = 0) -> LlmRequest:
    """The facts of a parsed request body; ``length`` 0 asks for no prefix key, ``source``
    is ``"auto"``, ``"messages"`` or ``"prompt"``."""
    if not isinstance(document, dict):
        return NOTHING
    return LlmRequest(
        max_tokens=_max_tokens(document),
        prefix_key=_prefix_key(document, source, length) if length > 0 else None,
        model=_model(document),
    )


def _model(document: Mapping[str, object]) -> str | None:
    model = document.get("model")
    if isinstance(model, str) and 0 < len(model) <= MAX_MODEL:
        return model
    return None


def _positive_int(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


def _max_tokens(document: Mapping[str, object]) -> int | None:
    tokens = _positive_int(document.get("max_completion_tokens"))
    if tokens is None:
        tokens = _positive_int(document.get("max_tokens"))
    if tokens is None:
        tokens = _positive_int(document.get("max_output_tokens"))
    if tokens is None:
        return None
    choices = _positive_int(document.get("n")) or 1
    return tokens * min(choices, _MAX_CHOICES)


def _prefix_key(document: Mapping[str, object], source: str, length: int) -> bytes | None:
    text: bytes | None = None
    if source in ("auto", "messages"):
        text = _messages_text(document.get("messages"), length)
    if text is None and source in ("auto", "prompt"):
        text = _prompt_text(document.get("prompt"), length)
    if not text:
        return None
    return hashlib.blake2b(text, digest_size=16, person=b"muxproxy-prefix").digest()


def _messages_text(messages: object, length: int) -> bytes | None:
    """The keyed text of a chat: the system part and the first turn, each bounded to
    ``length`` bytes on its own (see the module header)."""
    if not isinstance(messages, list) or not messages:
        return None
    system = bytearray()
    turn = b""
    for message in messages:
        if not isinstance(message, dict):
            break
        role = message.get("role")
        if not isinstance(role, str):
            break
        if role in _MESSAGE_ROLES:
            if len(system) < length:  # past the bound the system part is read no further
                system += role.encode("utf-8", "surrogatepass") + b"\n"
                system += _content_text(message.get("content"), length - len(system)) + b"\0"
            continue
        turn = role.encode("utf-8", "surrogatepass") + b"\n"
        turn += _content_text(message.get("content"), length - len(turn)) + b"\0"
        break  # the first user (or other) turn ends the prefix
    out = bytes(system[:length]) + turn[:length]
    return out or None


def _content_text(content: object, room: int) -> bytes:
    """A message's content as text, no longer than ``room`` bytes need (parts joined)."""
    if isinstance(content, str):
        return _utf8(content, room)
    if not isinstance(content, list):
        return b""
    out = bytearray()
    for part in content:
        if len(out) >= room:
            break
        if not isinstance(part, dict):
            continue
        text = part.get("text")
        if not isinstance(text, str):
            image = part.get("image_url")
            text = image.get("url") if isinstance(image, dict) else image
        if isinstance(text, str):
            out += _utf8(text, room - len(out)) + b"\n"
    return bytes(out)


def _prompt_text(prompt: object, length: int) -> bytes | None:
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt[:length]):
            return json.dumps(prompt[:length]).encode("ascii")[:length]  # token ids
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return _utf8(prompt, length)
    return None


def _utf8(text: str, room: int) -> bytes:
    """``text``'s UTF-8 bytes, at most ``room`` of them (encoding no more than needed:
    a character is at most 4 bytes)."""
    if room <= 0:
        return b""
    return text[:room].encode("utf-8", "surrogatepass")[:room]
