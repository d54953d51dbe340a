"""The fake LLM backend's knobs: per-request ``x-fake-*`` headers and the CLI options.

Each knob has a default on :class:`~muxproxy.testing.fakellm.FakeLLM` (constructor / CLI
option, and the instance is mutable, so a test may change one between requests) and a
per-request header override:

=======================  =============================  ====================================
header                   attribute / CLI option         meaning
=======================  =============================  ====================================
``x-fake-tokens``        ``tokens`` / ``--tokens``      tokens per reply (16); without the
                                                        header the request's ``max_tokens``
                                                        (or ``max_completion_tokens``) is
                                                        used if given. Continuing a final
                                                        assistant message of ``k`` tokens
                                                        (``continue_final_message``): this
                                                        is the whole answer's length, so
                                                        ``n - k`` more come, while
                                                        ``max_tokens`` counts the new
                                                        tokens only, as in vLLM
                                                        (``answer.py``)
``x-fake-delay``         ``delay`` / ``--delay``        seconds between tokens (0.02)
``x-fake-first-delay``   ``first_delay`` /              seconds before the first token (0)
                         ``--first-delay``
``x-fake-die-after``     ``die_after`` /                after N token events, abort: HTTP/1.1
                         ``--die-after``                closes the connection (no last
                                                        chunk), HTTP/2 resets the stream
                                                        (RST_STREAM INTERNAL_ERROR). N ==
                                                        tokens: dies before the finish chunk;
                                                        N > tokens: no abort; ``none`` (or
                                                        ``-1``) disables a default. N counts
                                                        this response's tokens: a
                                                        continuation emits N more, then
                                                        dies again. 0 on ``/v1/responses``
                                                        and ``/v1/messages``: an error
                                                        event instead of the first token
                                                        (``server_error``,
                                                        ``overloaded_error``), then the end
``x-fake-status``        ``status`` / ``--status``      answer every request with status S
                                                        and a small OpenAI-style JSON error
                                                        body (200: normal behaviour)
``x-fake-role-chunk``    ``role_chunk`` /               ``1``: a stream starts at once, before
                         ``--role-chunk``               ``first_delay``, with a role-only
                                                        chunk (``"delta": {"role":
                                                        "assistant", "content": ""}``), as
                                                        vLLM and OpenAI send; the first token
                                                        chunk then carries no role (False)
``x-fake-echo-headers``  (per request only)             ``1``: add ``request_headers``
                                                        (lower-case name -> value, repeats
                                                        joined ", ") to the JSON body / the
                                                        first SSE chunk
``x-fake-sink``          (per request only)             ``1`` on a POST to any path: answer
                                                        ``{"received_bytes": n,
                                                        "sha256": hex}``
=======================  =============================  ====================================

The engine model's options have no header (they shape one engine shared by all requests, so
they are read once, when the :class:`~muxproxy.testing.fakellm.FakeLLM` is made); giving any
one but ``--block-tokens`` turns the model on (see ``engine.py``):

==========================================  ==================================================
attribute / CLI option                      meaning
==========================================  ==================================================
``max_running`` / ``--max-running N``       at most N generations at once; the rest wait,
                                            first come first served (no limit)
``kv_blocks`` / ``--kv-blocks B``           a prefix KV cache of B blocks (no cache)
``block_tokens`` / ``--block-tokens T``     tokens per KV block (16); a token is 4 bytes of
                                            the prompt text
``ttft_base`` / ``--ttft-base S``           seconds from admission to the first token,
                                            added to the first delay (0)
``prefill_per_token`` /                     seconds more per prompt token not found in the
``--prefill-per-token S``                   cache (0)
``prefill_chunk`` /                         the step model: one loop of engine steps serves
``--prefill-chunk N``                       every running generation (continuous batching);
                                            a step is ``--delay`` plus the prefill per token
                                            of at most N prefill tokens, and brings a token
                                            to every stream done with its prefill, so a cold
                                            prompt slows them all; ``x-fake-delay`` does not
                                            apply (off: each generation prefills on its own)
``--kv-events PORT``                        publish the cache's changes as vLLM's KV-cache
                                            events on a ZeroMQ PUB socket at PORT (0: any
                                            free port), and answer ``POST /tokenize``
                                            (``kvevents.py``; needs ``--kv-blocks``)
==========================================  ==================================================

LoRA (``lora.py``; off by default), read once too:

==========================================  ==================================================
attribute / CLI option                      meaning
==========================================  ==================================================
``lora`` / ``--lora-adapters A,B``          hold these adapters from the start and report
                                            them in ``/metrics`` (``lora_requests_info``)
``lora`` / ``--max-lora N``                 at most N adapters held (as many as given); a
                                            request naming another loads it, the least
                                            recently used evicted
==========================================  ==================================================

A malformed header raises :class:`BadKnob` naming the header and what it expects (the app
answers 400 with its text); a malformed option is argparse's usage error, naming the option.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

HEADER_TOKENS = "x-fake-tokens"
HEADER_DELAY = "x-fake-delay"
HEADER_FIRST_DELAY = "x-fake-first-delay"
HEADER_DIE_AFTER = "x-fake-die-after"
HEADER_STATUS = "x-fake-status"
HEADER_ECHO = "x-fake-echo-headers"
HEADER_ROLE_CHUNK = "x-fake-role-chunk"
HEADER_SINK = "x-fake-sink"

_TRUE = frozenset({"1", "true", "yes", "on"})
_NO_DIE = frozenset({"", "none", "off", "-1"})


class BadKnob(ValueError):
    """A malformed ``x-fake-*`` header (answered with 400)."""


class Defaults(Protocol):
    """The knobs' defaults (``FakeLLM``'s attributes of the same names)."""

    @property
    def tokens(self) -> int: ...
    @property
    def delay(self) -> float: ...
    @property
    def first_delay(self) -> float: ...
    @property
    def die_after(self) -> int | None: ...
    @property
    def status(self) -> int: ...
    @property
    def role_chunk(self) -> bool: ...


@attrs.frozen
class Knobs:
    """The knobs of one request: its headers over the defaults."""

    tokens: int
    tokens_from_header: bool
    delay: float
    first_delay: float
    die_after: int | None
    status: int
    role_chunk: bool


def read_knobs(headers: Mapping[str, str], defaults: Defaults) -> Knobs:
    """The knobs of a request with ``headers`` (lower-case names); raises :class:`BadKnob`."""
    raw_die = headers.get(HEADER_DIE_AFTER)
    if raw_die is None:
        die_after = defaults.die_after
    elif raw_die.strip().lower() in _NO_DIE:
        die_after = None
    else:
        die_after = _header_int(HEADER_DIE_AFTER, raw_die, 0, None)
    raw_status = headers.get(HEADER_STATUS)
    return Knobs(
        tokens=_header_int(HEADER_TOKENS, headers.get(HEADER_TOKENS), 0, None, defaults.tokens),
        tokens_from_header=HEADER_TOKENS in headers,
        delay=_header_float(HEADER_DELAY, headers.get(HEADER_DELAY), defaults.delay),
        first_delay=_header_float(
            HEADER_FIRST_DELAY, headers.get(HEADER_FIRST_DELAY), defaults.first_delay
        ),
        die_after=die_after,
        status=_header_int(HEADER_STATUS, raw_status, 200, 599, defaults.status),
        role_chunk=(
            is_true(headers[HEADER_ROLE_CHUNK])
            if HEADER_ROLE_CHUNK in headers
            else defaults.role_chunk
        ),
    )


def is_true(value: str) -> bool:
    """Whether a flag header's value turns it on (``1``, ``true``, ``yes``, ``on``)."""
    return value.strip().lower() in _TRUE


def collect_headers(raw: Sequence[tuple[bytes, bytes]]) -> dict[str, str]:
    """ASGI headers as lower-case name -> value, repeats joined ", "."""
    headers: dict[str, str] = {}
    for raw_name, raw_value in raw:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


def _header_int(name: str, raw: str | None, low: int, high: int | None, default: int = 0) -> int:
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise BadKnob(f"{name}: expected an integer, got {raw!r}") from None
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise BadKnob(f"{name}: expected an integer {bounds}, got {value}")
    return value


def _header_float(name: str, raw: str | None, default: float) -> float:
    if raw is None:
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise BadKnob(f"{name}: expected seconds, got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise BadKnob(f"{name}: expected finite seconds >= 0, got {raw!r}")
    return value


# ---- command line ----------------------------------------------------------------------


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected finite seconds >= 0, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65_535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected adapter names separated by commas")
    return names


def _status(text: str) -> int:
    value = int(text)
    if not 200 <= value <= 599:
        raise argparse.ArgumentTypeError(f"expected a status in 200..599, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``muxproxy fakellm`` options to ``parser``."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument(
        "--port", type=_non_negative_int, default=0, help="port to bind (0: any free port)"
    )
    parser.add_argument(
        "--id", dest="backend_id", default="fake", help="backend id, sent as x-backend-id"
    )
    parser.add_argument(
        "--model-version",
        default=None,
        metavar="V",
        help="model version, sent as x-model-version on every response",
    )
    parser.add_argument("--tokens", type=_non_negative_int, default=16, help="tokens per reply")
    parser.add_argument("--delay", type=_seconds, default=0.02, help="seconds between tokens")
    parser.add_argument(
        "--first-delay", type=_seconds, default=0.0, help="seconds before the first token"
    )
    parser.add_argument(
        "--die-after",
        type=_non_negative_int,
        default=None,
        help="abort every completion after N tokens",
    )
    parser.add_argument(
        "--status", type=_status, default=200, help="answer every request with this status"
    )
    parser.add_argument(
        "--role-chunk",
        action="store_true",
        help="start every stream with a role-only chunk, as vLLM does",
    )
    engine = parser.add_argument_group(
        "engine model", "a GPU inference engine's queue, prefix cache and prefill (off by default)"
    )
    engine.add_argument(
        "--max-running",
        type=_positive_int,
        default=None,
        metavar="N",
        help="run at most N generations at once; the rest wait, first come first served",
    )
    engine.add_argument(
        "--kv-blocks",
        type=_non_negative_int,
        default=None,
        metavar="B",
        help="a prefix KV cache of B blocks (prompts and generated tokens), least recently used"
        " evicted first",
    )
    engine.add_argument(
        "--block-tokens",
        type=_positive_int,
        default=16,
        metavar="T",
        help="tokens per KV block (16); a token is 4 bytes of prompt text",
    )
    engine.add_argument(
        "--ttft-base",
        type=_seconds,
        default=None,
        metavar="S",
        help="seconds from admission to the first token, before prefill (0)",
    )
    engine.add_argument(
        "--prefill-per-token",
        type=_seconds,
        default=None,
        metavar="S",
        help="seconds of prefill per prompt token not found in the cache (0)",
    )
    lora = parser.add_argument_group("LoRA", "LoRA adapters held and reported (off by default)")
    lora.add_argument(
        "--lora-adapters",
        type=_names,
        default=[],
        metavar="A,B",
        help="hold these LoRA adapters from the start, reported in /metrics",
    )
    lora.add_argument(
        "--max-lora",
        type=_positive_int,
        default=None,
        metavar="N",
        help="hold at most N adapters (as many as given); another one named is loaded, "
        "the least recently used evicted",
    )
    engine.add_argument(
        "--prefill-chunk",
        type=_positive_int,
        default=None,
        metavar="N",
        help=(
            "step model: one loop of engine steps for all running generations, each step "
            "--delay plus the prefill of at most N uncached prompt tokens, every stream a "
            "token a step (off: each generation prefills on its own)"
        ),
    )
    engine.add_argument(
        "--kv-events",
        type=_port,
        default=None,
        metavar="PORT",
        help="publish the cache's changes as vLLM's KV-cache events (ZeroMQ PUB, topic"
        ' "kv-events") on PORT (0: any free port) and answer POST /tokenize; needs --kv-blocks',
    )
