"""The fake LLM backend's answer: one fixed token sequence, and continuing a partial one.

Pure: no trio, no I/O, no clock, no randomness.

**The answer.** Token ``i`` is the text ``"tok<i> "`` (:func:`token`), and an ``n``-token
answer is tokens ``0 .. n - 1`` (:func:`reply_text`). It depends on the token index alone:
not on the prompt, the ``seed``, the sampling options or the backend, so every fake gives
every request the same text for the same length, and a reply cut short anywhere can be
continued, by this fake or another, and checked exactly: the spliced answer is the
uninterrupted one.

**Continuing** (:func:`plan_reply`), as vLLM and SGLang do with the chat-template options
``continue_final_message: true`` and ``add_generation_prompt: false``, and as the Anthropic
Messages API does with any final assistant message (its prefill; no option): the request's
last message is an assistant message whose text ``T`` is the start of the answer, and the
reply goes on from where ``T`` stops. What it obeys:

* ``T`` must be a token-aligned prefix of the answer, ``tokens_text(0, k)`` for some ``k``
  (a string content, or its ``{"type": "text"}`` parts joined); else 400. ``k`` may be 0
  (an empty ``T``: the whole answer).
* Both options true is refused (vLLM's request validator: "Cannot set both
  `continue_final_message` and `add_generation_prompt` to True."), and so is
  ``continue_final_message`` when the last message is not the assistant's (vLLM's chat
  template check, with its words). As in vLLM, ``add_generation_prompt`` left out does
  not count as true. ``continue_final_message``, and with it ``add_generation_prompt``,
  must be a JSON boolean when given.
* **The token budget.** The fake's own length (the ``x-fake-tokens`` header, else the
  ``tokens`` default when the body gives no ``max_tokens``) is the length ``n`` of the
  *whole* answer: a continuation emits tokens ``k .. n - 1``, and a ``T`` longer than ``n``
  tokens is refused (400: it is not a prefix of the answer). A request's ``max_tokens`` (or
  ``max_completion_tokens``), when it sets the length (no header), counts only the *new*
  tokens, as vLLM counts them for the new generation: a continuation emits tokens ``k .. k
  + max_tokens - 1``. So a request resent with the partial answer appended and the same
  ``x-fake-tokens`` (or neither it nor ``max_tokens``) gets exactly the rest, and one sent
  with ``max_tokens`` lowered by ``k`` (what a client must do for vLLM too) gets exactly
  the rest; one that keeps ``max_tokens`` gets ``k`` tokens too many, as vLLM would give
  it.
* The continuation is a reply like any other (its own ``id`` and ``created``, its role
  chunk, finish chunk and ``usage``); its ``usage`` counts ``T`` in the prompt and only the
  new tokens as completion tokens, as vLLM's does, and die-after counts its own tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from muxproxy.testing.fakellm.engine import content_text

CONTINUE = "continue_final_message"
GENERATION_PROMPT = "add_generation_prompt"

BOTH_OPTIONS = f"Cannot set both `{CONTINUE}` and `{GENERATION_PROMPT}` to True."
"""vLLM's refusal of both options true, word for word."""
NOT_ASSISTANT = f"Cannot set `{CONTINUE}` to True when the last message is not from the assistant."
"""vLLM's refusal of a continuation without a final assistant message, word for word."""

_SHOWN = 24
"""Characters of a mismatching ``T`` quoted in the error (enough to see what went wrong)."""


def token(i: int) -> str:
    """Token ``i`` of the answer: ``"tok<i> "``."""
    return f"tok{i} "


def tokens_text(start: int, stop: int) -> str:
    """Tokens ``start .. stop - 1`` of the answer, joined."""
    return "".join(token(i) for i in range(start, stop))


def reply_text(n_tokens: int) -> str:
    """The full reply text of an ``n_tokens`` completion: ``"tok0 tok1 ... "``."""
    return tokens_text(0, n_tokens)


class BadContinuation(ValueError):
    """A request the fake cannot continue (answered 400); ``param`` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@attrs.frozen(kw_only=True)
class Reply:
    """What one chat completion emits: tokens ``first .. first + count - 1`` of the answer."""

    first: int
    """The index of its first token: 0, or the tokens the continued message holds."""
    count: int
    """How many tokens it emits (its ``completion_tokens``)."""
    continued: bool
    """Whether it continues a final assistant message."""

    def token(self, j: int) -> str:
        """Its ``j``-th token (``0 <= j < count``)."""
        return token(self.first + j)

    @property
    def text(self) -> str:
        """All of its text."""
        return tokens_text(self.first, self.first + self.count)


def plan_reply(
    request: Mapping[str, object], tokens: int, *, counts_new: bool, prefill: bool = False
) -> Reply:
    """The reply to a chat ``request`` of ``tokens`` tokens; raises :class:`BadContinuation`.

    ``counts_new``: ``tokens`` is the request's ``max_tokens``, which counts the new tokens
    of a continuation only (else it is the whole answer's length; see the module docstring).
    ``prefill``: a final assistant message is continued with no option (Anthropic Messages).
    """
    messages = request.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if prefill:
        if not isinstance(last, dict) or last.get("role") != "assistant":
            return Reply(first=0, count=tokens, continued=False)
    elif not _flag(request, CONTINUE):
        return Reply(first=0, count=tokens, continued=False)
    elif _flag(request, GENERATION_PROMPT):
        raise BadContinuation(BOTH_OPTIONS, GENERATION_PROMPT)
    if not isinstance(last, dict) or last.get("role") != "assistant":
        raise BadContinuation(NOT_ASSISTANT, "messages")
    done = answered_tokens(content_text(last))
    if counts_new:
        return Reply(first=done, count=tokens, continued=True)
    if done > tokens:
        raise BadContinuation(
            f"{CONTINUE}: the final assistant message holds {done} tokens, more than the "
            f"{tokens} of this backend's answer, so it is not a prefix of it",
            "messages",
        )
    return Reply(first=done, count=tokens - done, continued=True)


def answered_tokens(text: str) -> int:
    """How many tokens of the answer ``text`` is; raises :class:`BadContinuation` unless it is
    a token-aligned prefix of it."""
    done = 0
    at = 0
    while at < len(text):
        expected = token(done)
        if not text.startswith(expected, at):
            raise BadContinuation(
                f"{CONTINUE}: the final assistant message is not a token-aligned prefix of "
                f"this backend's answer ({reply_text(2)}...): after its first {done} tokens "
                f"it has {text[at : at + _SHOWN]!r} where {expected!r} was expected",
                "messages",
            )
        at += len(expected)
        done += 1
    return done


def _flag(request: Mapping[str, object], name: str) -> bool:
    value = request.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadContinuation(f"{name} must be a boolean, got {value!r}", name)
    return value
