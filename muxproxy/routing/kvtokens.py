"""A request's prompt tokens for scoring against the engines' KV-cache indexes: learnt from
the engine's own ``POST /tokenize``, cached per conversation prefix, never waited for.

Obeys the routing rules: pure code, standard library and attrs only, no clock, no I/O. The
driver sends the tokenize requests this module writes and hands back the answers.

Why tokens at all: the indexes (``kvindex.py``) match blocks by their tokens, and only the
engine's tokenizer and chat template give them. Why cached per prefix and never waited for:
a tokenize round trip before every placement would add its latency to every first token,
while the part of a prompt worth routing for is the part an engine has already seen, which
is a conversation's earlier turns. So a request is scored with the tokens of its longest
message prefix already tokenized, and its own messages are tokenized after it is placed,
for its next turn. A first turn (or a single question) finds nothing and is placed by the
approximate prefix key, as without events.

The keys (:func:`conversation_keys`): for a chat request, one per message, each a 16-byte
blake2b chained over the previous key and the message's canonical JSON (sorted keys, no
spaces), so ``keys[k - 1]`` names the first ``k`` messages exactly, whatever follows; and the
model, as the first link (two models tokenize differently). For a completion request with a
string ``prompt``, one key of the prompt. The tokenize request of a chat prefix asks for the
messages as the engine would compute them before the next turn's own text:
``add_generation_prompt: false`` (vLLM's ``TokenizeChatRequest``; ``TokenizeCompletionRequest``
for a prompt). Chat templates that are not concatenative (one whose rendering of an earlier
message depends on a later one) give a prefix's tokens that differ from the longer prompt's
near the end: the score is then a block or so short, never wrong about which engine holds
the rest.

Bounds: :class:`TokenCache` holds at most ``max_entries`` prefixes and ``max_tokens`` tokens
all together, forgetting the least recently used first; an answer of more than
:data:`MAX_ANSWER_TOKENS` tokens is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import attrs

__all__ = [
    "MAX_ANSWER_TOKENS",
    "TokenCache",
    "TokenizeError",
    "conversation_keys",
    "parse_tokenize_answer",
    "tokenize_body",
]

MAX_ANSWER_TOKENS = 1 << 20
"""The most tokens one tokenize answer may carry (a million: beyond any context window)."""

_DIGEST_BYTES = 16


class TokenizeError(ValueError):
    """A tokenize answer that is not ``{"tokens": [int, ..], ..}`` within the bounds."""


def _link(parent: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(parent + data, digest_size=_DIGEST_BYTES).digest()


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def conversation_keys(document: object) -> list[bytes]:
    """The keys of a request's message prefixes, shortest first (see the header); [] when
    the body is neither a chat request nor a completion request with a string prompt."""
    if not isinstance(document, Mapping):
        return []
    model = document.get("model")
    root = _link(b"muxproxy tokens", _canonical(model if isinstance(model, str) else None))
    messages = document.get("messages")
    if isinstance(messages, list):
        keys: list[bytes] = []
        parent = root
        for message in messages:
            parent = _link(parent, _canonical(message))
            keys.append(parent)
        return keys
    prompt = document.get("prompt")
    if isinstance(prompt, str):
        return [_link(root, b"prompt:" + prompt.encode())]
    return []


def tokenize_body(document: Mapping[str, object], messages: int | None = None) -> bytes:
    """The body of ``POST /tokenize`` for the first ``messages`` messages of a chat request
    (None: all), or for a completion request's prompt."""
    body: dict[str, object] = {}
    if isinstance(document.get("model"), str):
        body["model"] = document["model"]
    chat = document.get("messages")
    if isinstance(chat, list):
        body["messages"] = chat if messages is None else chat[:messages]
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = document.get("prompt")
    return _canonical(body)


def parse_tokenize_answer(body: bytes) -> tuple[int, ...]:
    """The tokens of a tokenize answer (vLLM's ``TokenizeResponse``); raises
    :class:`TokenizeError`."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        raise TokenizeError("the tokenize answer is not JSON") from None
    tokens = document.get("tokens") if isinstance(document, dict) else None
    if not isinstance(tokens, list):
        raise TokenizeError("the tokenize answer has no tokens list")
    if len(tokens) > MAX_ANSWER_TOKENS:
        raise TokenizeError(
            f"the tokenize answer has {len(tokens)} tokens, over {MAX_ANSWER_TOKENS}"
        )
    if not all(
        isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in tokens
    ):
        raise TokenizeError("the tokenize answer's tokens are not all integers >= 0")
    return tuple(tokens)


@attrs.define
class TokenCache:
    """Tokens of message prefixes, by :func:`conversation_keys` key, least recently used
    forgotten first."""

    max_entries: int = attrs.field(validator=attrs.validators.ge(1))
    max_tokens: int = attrs.field(validator=attrs.validators.ge(1))

    tokens: int = attrs.field(default=0, init=False)
    """Tokens held, all entries together."""
    _entries: OrderedDict[bytes, tuple[int, ...]] = attrs.field(
        factory=OrderedDict, init=False, repr=False
    )

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: bytes, tokens: tuple[int, ...]) -> None:
        """Remember ``tokens`` for ``key``; one longer than ``max_tokens`` is not kept."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.tokens -= len(old)
        if len(tokens) > self.max_tokens:
            return
        self._entries[key] = tokens
        self.tokens += len(tokens)
        while len(self._entries) > self.max_entries or self.tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self.tokens -= len(dropped)

    def longest(self, keys: Sequence[bytes]) -> tuple[int, tuple[int, ...]] | None:
        """(how many messages, their tokens) of the longest prefix of ``keys`` known; None."""
        for at in range(len(keys) - 1, -1, -1):
            tokens = self._entries.get(keys[at])
            if tokens is not None:
                self._entries.move_to_end(keys[at])
                return at + 1, tokens
        return None

    def wanted(self, keys: Sequence[bytes]) -> bool:
        """Whether the whole request (its last key) is worth tokenizing: not known yet."""
        return bool(keys) and keys[-1] not in self._entries
