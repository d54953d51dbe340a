"""W3C Trace Context for one exchange: the client's ``traceparent`` read, the proxy's span
named, the ``traceparent`` the backend gets.

What it obeys (W3C Trace Context, Level 1):

- §3.2 ``traceparent`` is ``version-trace_id-parent_id-flags``: lower-case hex, 2-32-16-2
  digits; version ``ff`` is invalid; an all-zero trace id or parent id is invalid; a version
  above ``00`` is read by its first four fields (§3.2.4: a later version may add fields
  after them, so a longer value is kept only when a ``-`` follows). A request with more than
  one ``traceparent`` field has none we can trust, as with an invalid one.
- §3.3 ``tracestate`` goes on with its trace: kept as the client sent it when its
  ``traceparent`` is taken; dropped when that ``traceparent`` was missing or invalid (a
  state of a trace we do not continue describes nothing). The proxy adds no entry of its own.
- §3.2.2.3 the proxy's span becomes the parent: the backend's ``traceparent`` names the
  client's trace id (or a new one) and the proxy's span id, replacing the client's field.

Sampling is the parent's when the client sent a ``traceparent`` (its ``sampled`` flag), else
a ratio of trace ids, by OpenTelemetry's ``TraceIdRatioBased`` rule: the trace id's lower 64
bits below ``ratio * 2**64``. The flag goes upstream and tells the exporter whether to send
the span; metrics count every exchange.

Pure like the rest of the core: no clock, no ``random``. The ids are derived, ``blake2b``
personalised for muxproxy, from the process's random request-id prefix (``access.py``: read
once from ``os.urandom`` when the core is built) and the exchange's number, which is unique
in the process. So the id the backend head names when it is built and the one the access
record reports when the exchange ends are the same without the exchange keeping either,
and nothing of this runs unless ``[telemetry]`` is configured.
"""

from __future__ import annotations

import hashlib

import attrs

from muxproxy.core.messages import Headers

__all__ = ["TRACEPARENT", "TRACESTATE", "TraceContext", "trace_context", "with_traceparent"]

TRACEPARENT = b"traceparent"
TRACESTATE = b"tracestate"

MAX_TRACESTATE = 512
"""W3C Trace Context §3.3.1.1: a vendor must propagate at least 512 characters of
``tracestate``; a longer one is dropped rather than cut (a cut list could end mid-entry)."""

_HEX = frozenset(b"0123456789abcdef")
_PERSON = b"muxproxy-trace"
_SAMPLED = 0x01


@attrs.frozen(kw_only=True)
class TraceContext:
    """The proxy's span of one exchange in its trace."""

    trace_id: str
    """32 lower-case hex digits: the client's trace, or a new one."""
    span_id: str
    """16 hex digits: the proxy's span (the backend request's parent)."""
    parent_span_id: str | None
    """The client's span, when it sent a valid ``traceparent``."""
    sampled: bool
    tracestate: bytes | None
    """The client's ``tracestate``, kept with its trace."""

    @property
    def traceparent(self) -> bytes:
        """The ``traceparent`` for the backend: version 00, the proxy's span as the parent."""
        flags = "01" if self.sampled else "00"
        return f"00-{self.trace_id}-{self.span_id}-{flags}".encode("ascii")


def _hex(value: bytes, digits: int) -> bool:
    return len(value) == digits and set(value) <= _HEX and value.strip(b"0") != b""


def parse_traceparent(value: bytes) -> tuple[str, str, bool] | None:
    """(trace id, parent id, sampled) of a ``traceparent`` value, or None when invalid."""
    value = value.strip(b" \t")
    if len(value) < 55 or (len(value) > 55 and value[55:56] != b"-"):
        return None
    parts = value[:55].split(b"-")
    if len(parts) != 4:
        return None
    version, trace_id, parent_id, flags = parts
    if len(version) != 2 or not set(version) <= _HEX or version == b"ff":
        return None
    if version == b"00" and len(value) != 55:
        return None
    if not (_hex(trace_id, 32) and _hex(parent_id, 16)) or len(flags) != 2:
        return None
    if not set(flags) <= _HEX:  # "00" is valid flags: not ``_hex``, which refuses zeros
        return None
    return trace_id.decode("ascii"), parent_id.decode("ascii"), bool(int(flags, 16) & _SAMPLED)


def _nonzero(digest: bytes) -> str:
    """``digest`` as hex digits, never all zeros (an invalid id, §3.2.2.3, §3.2.2.4)."""
    if not any(digest):
        digest = digest[:-1] + b"\x01"
    return digest.hex()


def trace_context(headers: Headers, *, prefix: bytes, ident: int, ratio: float) -> TraceContext:
    """The trace context of the exchange number ``ident`` in the process whose request-id
    prefix is ``prefix``, for a request with ``headers``; ``ratio``: the share of new traces
    sampled (see the module)."""
    parents = [value for name, value in headers if name == TRACEPARENT]
    parent = parse_traceparent(parents[0]) if len(parents) == 1 else None
    # One hash for both ids: the first 16 bytes a new trace's id, the last 8 the span's.
    ids = hashlib.blake2b(b"%s-%d" % (prefix, ident), digest_size=24, person=_PERSON).digest()
    span_id = _nonzero(ids[16:])
    if parent is not None:
        trace_id, parent_id, sampled = parent
        states = [value for name, value in headers if name == TRACESTATE]
        # RFC 9110 §5.3: field lines of one name combine with ",", as tracestate allows.
        state = b",".join(states) if states else None
        if state is not None and len(state) > MAX_TRACESTATE:
            state = None
        return TraceContext(
            trace_id=trace_id,
            span_id=span_id,
            parent_span_id=parent_id,
            sampled=sampled,
            tracestate=state,
        )
    trace_id = _nonzero(ids[:16])
    sampled = int(trace_id[16:], 16) < ratio * 2**64
    return TraceContext(
        trace_id=trace_id, span_id=span_id, parent_span_id=None, sampled=sampled, tracestate=None
    )


def with_traceparent(headers: Headers, context: TraceContext) -> Headers:
    """``headers`` with the proxy's ``traceparent`` (and the kept ``tracestate``) in place of
    the client's."""
    out = [field for field in headers if field[0] not in (TRACEPARENT, TRACESTATE)]
    out.append((TRACEPARENT, context.traceparent))
    if context.tracestate is not None:
        out.append((TRACESTATE, context.tracestate))
    return out
