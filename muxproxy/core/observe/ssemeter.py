"""SSE metering: one response's events, its first token and the gaps between events, fed once
per chunk the backend sent.

Pure like the rest of the core: times are ``now`` values the caller passes (the core reads no
clock), and the counts go into the server's ``TokenTimes`` (``series.py``) in place.

Invariant: nothing on the per-chunk path allocates or builds a dict. A stream's ``SseMeter``
holds its server's ``TokenTimes`` and histograms once, and a chunk costs a ``bytes.count`` of
one byte, an ``endswith`` and, when it completed an event, one bucket increment. This is the
proxy's per-token hot path (``bench/icount.py --modes token``).

SSE events (WHATWG HTML §9.2.6). An event ends at an empty line: two line ends in a row.
Lines end with LF, CRLF or CR; a stream's line end is taken from its first line (the first
CR or LF seen, a CR followed by LF being CRLF), and its events are counted as occurrences of
that line end twice (``\\n\\n``, ``\\r\\n\\r\\n``, ``\\r\\r``), also when the two halves come in
different chunks. A stream that mixes line ends (the specification allows it; no server
does) is counted by its first one. Comment-only blocks (``: ping``) count as events too.

Tokens. Time to first token is measured to the chunk that completed the first event that
carries a token, not to the first byte. Only events up to that one are inspected, by byte
patterns (``TOKEN_FIELD`` and friends, compiled once; never a JSON parse); after it events
are only counted. An event carries a token unless:

1. it has no ``data:`` line (a comment, ``event:``, ``id:`` or ``retry:`` lines only); or
2. its data is ``[DONE]`` (the OpenAI end marker); or
3. its data is a JSON object (``data:`` then optional spaces then ``{``) in which none of the
   fields ``content``, ``reasoning_content``, ``reasoning``, ``text``, ``tool_calls``,
   ``token`` has a non-empty value (a non-empty string, array or object, or a number/literal
   other than ``null``). So an OpenAI role-only first chunk
   (``{"choices":[{"delta":{"role":"assistant","content":""}}]}``), a finish chunk with an
   empty delta, a usage chunk and an error object are not tokens; an OpenAI content or tool
   call delta, a completions ``text``, a vLLM ``reasoning_content`` delta, TGI's ``token``
   and Anthropic's ``text_delta`` are.

Any other data (plain text) is a token. The patterns look at field names, so a token whose
text is the string ``"content":""`` escaped inside another value cannot fool them (its quotes
are escaped ``\\"``). An event larger than ``INSPECT_LIMIT`` without an end is taken as a
token (the inspection buffer stays bounded).

Per API (``core/apis/streaming.py``): the exchange may hand the meter another content rule
(``is_content``: the Responses and Messages readers) and a ``token_marker``, counted per chunk
(with the bytes a chunk boundary splits it across) as the stream's ``tokens``; without one,
``tokens`` is ``events``. Chat Completions keeps the rules above and pays one attribute test
per chunk for the marker.

Inter-token gaps: after the first token, every backend chunk that completes at least one
event adds one observation, the time since the previous such chunk (events that arrive in
one read were produced together as far as the proxy can tell).
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable

from mypy_extensions import mypyc_attr

from muxproxy.core.apis.streaming import stream_for
from muxproxy.core.observe.series import TokenTimes

INSPECT_LIMIT = 64 * 1024
"""Most bytes of not-yet-complete events held to classify them, before the first token."""

_CR = 0x0D
_LF = 0x0A

TOKEN_FIELD = re.compile(
    rb'"(?:content|reasoning_content|reasoning|text|tool_calls|token)"\s*:\s*'
    rb'(?:"[^"]|\[\s*[^\]\s]|\{\s*[^}\s]|[-0-9tf])'
)
"""A token-carrying field with a non-empty value (see the module's rules)."""
_JSON_DATA = re.compile(rb"(?:\A|[\r\n])data: ?\s*\{")
_DATA_LINE = re.compile(rb"(?:\A|[\r\n])data:")
_DONE = re.compile(rb"(?:\A|[\r\n])data: ?\[DONE\]\s*\Z")


def is_token_event(event: bytes) -> bool:
    """Whether one SSE event (its bytes up to, not including, the empty line) carries a
    token, by the module's rules."""
    if _DATA_LINE.search(event) is None:
        return False
    if _DONE.search(event) is not None:
        return False
    if TOKEN_FIELD.search(event) is not None:
        return True
    return _JSON_DATA.search(event) is None


# The compiled build keeps the class open to Python subclasses: an extension's stream meter
# (``exchange/hooked.py``'s ``EventTap``) is one.
@mypyc_attr(allow_interpreted_subclasses=True)
class SseMeter:
    """One SSE response's events, first token and gaps (see the module's rules)."""

    __slots__ = (
        "bounds",
        "buffer",
        "carry",
        "counted",
        "events",
        "first_token_at",
        "gaps",
        "is_content",
        "last",
        "last_event_at",
        "marker",
        "partials",
        "sep",
        "started",
        "stats",
        "tail",
    )

    def __init__(
        self,
        stats: TokenTimes,
        started: float,
        is_content: Callable[[bytes], bool] = is_token_event,
        marker: bytes = b"",
    ) -> None:
        self.stats = stats
        self.is_content = is_content
        """Whether one event is content (before the first token only)."""
        self.marker = marker
        """The API's token event marker; empty: every event is one (the module's rules)."""
        self.counted = 0
        """Occurrences of ``marker`` so far."""
        self.tail = b""
        """The last bytes of the last chunk, a marker's length less one."""
        hist = stats.inter_token
        self.bounds = hist.bounds
        self.gaps = hist.counts
        """The server's inter-token bucket counts, fed in place. Their sum is not added per
        chunk: a stream's gaps add up to ``last_event_at - first_token_at``, which
        ``gap_sum`` gives when the stream ends (and ``snapshot`` while it runs)."""
        self.started = started
        """When the request head came: time to first token counts from here."""
        self.sep = b""
        """Two line ends: the stream's event terminator; empty until its first line end."""
        self.last = _LF
        """``sep``'s last byte: LF, or CR for a stream of CR line ends."""
        self.partials: tuple[bytes, ...] = ()
        """``sep``'s proper prefixes, longest last: what a chunk can end in mid-terminator."""
        self.carry = 0
        """How many bytes of ``sep`` the last chunk ended with (0: none)."""
        self.buffer = b""
        """Before the first token: the bytes of events not yet complete."""
        self.events = 0
        self.first_token_at: float | None = None
        self.last_event_at = 0.0

    def feed(self, data: bytes, now: float) -> None:
        """One chunk of the response body, as the backend sent it."""
        if self.marker:
            self._count_markers(data)
        if self.first_token_at is None:
            self._inspect(data, now)
            return
        # The counting path, once per chunk: a few C calls and no allocation (but for a
        # chunk after one that ended mid-terminator, which is rare).
        if self.carry:
            data = self.partials[self.carry] + data
            self.carry = 0
        sep = self.sep
        # Counting one byte is a simpler loop than searching for two or four: a chunk with
        # fewer than two of the terminator's last byte holds no terminator, and one with
        # exactly two that ends with the terminator holds just that one (the common case,
        # one event per read). Only other chunks are searched.
        ends = data.count(self.last)
        if ends < 2:
            n = 0
            self.carry = _carry(data, self.partials)
        elif ends == 2 and data.endswith(sep):
            n = 1
        else:
            n = data.count(sep)
            if not data.endswith(sep):
                self.carry = _carry(data, self.partials)
        if n:
            self.events += n
            self.gaps[bisect_left(self.bounds, now - self.last_event_at)] += 1
            self.last_event_at = now

    def _count_markers(self, data: bytes) -> None:
        marker = self.marker
        text = self.tail + data
        self.counted += text.count(marker)
        # A tail one byte short of the marker holds no whole one: none is counted twice.
        self.tail = text[1 - len(marker) :]

    @property
    def tokens(self) -> int:
        """The tokens relayed so far: the API's token events, else the events."""
        return self.counted if self.marker else self.events

    @property
    def gap_sum(self) -> float:
        """The sum of the inter-token gaps observed so far."""
        if self.first_token_at is None:
            return 0.0
        return self.last_event_at - self.first_token_at

    def _inspect(self, data: bytes, now: float) -> None:
        """Before the first token: split the events out and classify each."""
        buffer = self.buffer + data
        if not self.sep:
            sep = stream_terminator(buffer)
            if sep is None and len(buffer) <= INSPECT_LIMIT:
                self.buffer = buffer
                return
            # None here: no line end in the first ``INSPECT_LIMIT`` bytes, not an SSE
            # stream anyone writes; counted as LF from here on.
            self._set_terminator(sep or b"\n\n")
        sep = self.sep
        start = 0
        while True:
            end = buffer.find(sep, start)
            if end < 0:
                break
            self.events += 1
            token = self.is_content(buffer[start:end])
            start = end + len(sep)
            if token:
                self._token(now)
                rest = buffer[start:]
                self.events += rest.count(sep)
                self.carry = 0 if rest.endswith(sep) else _carry(rest, self.partials)
                self.buffer = b""
                return
        self.buffer = buffer[start:]
        if len(self.buffer) > INSPECT_LIMIT:
            # Bounded: an event this large is not a role-only chunk.
            self.carry = _carry(self.buffer, self.partials)
            self.buffer = b""
            self._token(now)

    def _set_terminator(self, sep: bytes) -> None:
        self.sep = sep
        self.last = sep[-1]
        self.partials = tuple(sep[:k] for k in range(len(sep)))

    def _token(self, now: float) -> None:
        self.first_token_at = now
        self.last_event_at = now
        self.stats.ttft.observe(now - self.started)


def meter_rules(target: bytes) -> tuple[Callable[[bytes], bool], bytes]:
    """The content rule and token marker (``SseMeter``'s ``is_content`` and ``marker``) of
    the API a request target speaks (``core/apis/streaming.py``): the byte patterns and no
    marker for Chat Completions, Completions and a path of no known API."""
    api = stream_for(target)
    if api is None:
        return is_token_event, b""
    return api.is_content or is_token_event, api.token_marker


def stream_terminator(data: bytes) -> bytes | None:
    """The event terminator of a stream starting with ``data``; None while no line end is
    known (no CR or LF yet, or a CR as the last byte, which may be the start of a CRLF)."""
    lf = data.find(b"\n")
    cr = data.find(b"\r")
    if cr < 0:
        return None if lf < 0 else b"\n\n"
    if 0 <= lf < cr:
        return b"\n\n"
    if cr + 1 == len(data):
        return None
    return b"\r\n\r\n" if data[cr + 1] == _LF else b"\r\r"


def _carry(data: bytes, partials: tuple[bytes, ...]) -> int:
    """The longest proper prefix of the terminator that ``data`` ends with (its length)."""
    if not data or (data[-1] != _LF and data[-1] != _CR):
        return 0
    for k in range(len(partials) - 1, 0, -1):
        if data.endswith(partials[k]):
            return k
    return 0
