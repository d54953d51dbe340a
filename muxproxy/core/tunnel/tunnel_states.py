"""The life of one byte tunnel (``tunnel.Tunnel``) as a transition table.

States: both directions flow (``OPEN``); one side ended its sending and the other direction
still flows (``CLIENT_ENDED``, ``BACKEND_ENDED``: RFC 9293 §3.6, RFC 8441 §5); ``CLOSED``. Every
(state, input) pair is listed (``states.py``): a next state, ``IGNORED`` (late reports, and what
a side sends after the tunnel closed) or ``ILLEGAL`` (a muxproxy bug: bytes or an end from a side
that already ended, which neither the driver nor h2 delivers).

Pairs that name their own state are acted on and change nothing (bytes on an open tunnel, the
idle timer while bytes still move). The per-chunk inputs do not look the table up: ``tunnel.py``
asks ``CLIENT_FLOWS`` and ``BACKEND_FLOWS``, the states where the table takes them, made from the
table itself below.
"""

from __future__ import annotations

import enum

from muxproxy.core.states import IGNORED, ILLEGAL, Transitions


class TunnelState(enum.Enum):
    OPEN = "open"
    CLIENT_ENDED = "client_ended"
    """The client ended its side (relayed to the backend); backend to client still flows."""
    BACKEND_ENDED = "backend_ended"
    """The backend ended its side (relayed to the client); client to backend still flows."""
    CLOSED = "closed"


class TunnelInput(enum.Enum):
    CLIENT_BYTES = "client_bytes"
    """Bytes from the client: raw HTTP/1.1 bytes, or one DATA payload."""
    BACKEND_BYTES = "backend_bytes"
    CLIENT_END = "client_end"
    """The client ended its side: its FIN (``InputEnded``), or END_STREAM."""
    BACKEND_END = "backend_end"
    CLIENT_DRAINED = "client_drained"
    """The client side wrote some of its pending bytes: the backend may be read again."""
    BACKEND_DRAINED = "backend_drained"
    """The backend side wrote some of its pending bytes: the client may be read again."""
    IDLE_TIMER = "idle_timer"
    """``timeouts.tunnel_idle`` fired (lazily: it may find bytes moved since)."""
    CLOSE = "close"
    """We end it: a side went away or failed, the idle timeout passed, or an end that the
    other side cannot carry as a half-close (TLS)."""


_S = TunnelState
_I = TunnelInput
TRANSITIONS: Transitions[TunnelState, TunnelInput] = {
    (_S.OPEN, _I.CLIENT_BYTES): _S.OPEN,
    (_S.OPEN, _I.BACKEND_BYTES): _S.OPEN,
    (_S.OPEN, _I.CLIENT_END): _S.CLIENT_ENDED,
    (_S.OPEN, _I.BACKEND_END): _S.BACKEND_ENDED,
    (_S.OPEN, _I.CLIENT_DRAINED): _S.OPEN,
    (_S.OPEN, _I.BACKEND_DRAINED): _S.OPEN,
    (_S.OPEN, _I.IDLE_TIMER): _S.OPEN,
    (_S.OPEN, _I.CLOSE): _S.CLOSED,
    # The client's FIN or END_STREAM came once; nothing of the client follows it.
    (_S.CLIENT_ENDED, _I.CLIENT_BYTES): ILLEGAL,
    (_S.CLIENT_ENDED, _I.BACKEND_BYTES): _S.CLIENT_ENDED,
    (_S.CLIENT_ENDED, _I.CLIENT_END): ILLEGAL,
    (_S.CLIENT_ENDED, _I.BACKEND_END): _S.CLOSED,  # both sides ended
    (_S.CLIENT_ENDED, _I.CLIENT_DRAINED): _S.CLIENT_ENDED,
    (_S.CLIENT_ENDED, _I.BACKEND_DRAINED): _S.CLIENT_ENDED,  # credit still given back
    (_S.CLIENT_ENDED, _I.IDLE_TIMER): _S.CLIENT_ENDED,
    (_S.CLIENT_ENDED, _I.CLOSE): _S.CLOSED,
    (_S.BACKEND_ENDED, _I.CLIENT_BYTES): _S.BACKEND_ENDED,
    (_S.BACKEND_ENDED, _I.BACKEND_BYTES): ILLEGAL,
    (_S.BACKEND_ENDED, _I.CLIENT_END): _S.CLOSED,  # both sides ended
    (_S.BACKEND_ENDED, _I.BACKEND_END): ILLEGAL,
    (_S.BACKEND_ENDED, _I.CLIENT_DRAINED): _S.BACKEND_ENDED,
    (_S.BACKEND_ENDED, _I.BACKEND_DRAINED): _S.BACKEND_ENDED,
    (_S.BACKEND_ENDED, _I.IDLE_TIMER): _S.BACKEND_ENDED,
    (_S.BACKEND_ENDED, _I.CLOSE): _S.CLOSED,
    # CLOSED: what either side sent or reported was on its way (an HTTP/2 client's DATA is
    # still acknowledged, so its connection window does not shrink for nothing).
    (_S.CLOSED, _I.CLIENT_BYTES): IGNORED,
    (_S.CLOSED, _I.BACKEND_BYTES): IGNORED,
    (_S.CLOSED, _I.CLIENT_END): IGNORED,
    (_S.CLOSED, _I.BACKEND_END): IGNORED,
    (_S.CLOSED, _I.CLIENT_DRAINED): IGNORED,
    (_S.CLOSED, _I.BACKEND_DRAINED): IGNORED,
    (_S.CLOSED, _I.IDLE_TIMER): IGNORED,
    (_S.CLOSED, _I.CLOSE): IGNORED,
}
del _S, _I


def takes(input: TunnelInput) -> frozenset[TunnelState]:
    """The states in which ``TRANSITIONS`` acts on ``input`` (leaving the state as it is)."""
    return frozenset(s for s in TunnelState if TRANSITIONS[(s, input)] is s)


CLIENT_FLOWS = takes(TunnelInput.CLIENT_BYTES)
"""Where the client's bytes go on to the backend."""
BACKEND_FLOWS = takes(TunnelInput.BACKEND_BYTES)
"""Where the backend's bytes go on to the client."""
