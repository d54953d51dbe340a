"""The life of one HTTP/2 backend connection (``h2pool.H2Upstream``) as a transition table.

States: connecting, starting (preface sent, the backend's SETTINGS awaited, RFC 9113 §3.4),
ready, draining (a GOAWAY came, or the stream ids ran out, RFC 9113 §5.1.1 and §6.8: in-flight
streams finish, no new ones), closed. Every (state, input) pair is listed (``states.py``): a
next state, ``IGNORED`` (late or repeated reports) or ``ILLEGAL`` (a muxproxy bug).
"""

from __future__ import annotations

import enum

from muxproxy.core.states import IGNORED, ILLEGAL, Transitions


class H2State(enum.Enum):
    __hash__ = object.__hash__  # as ``Phase``'s: a table lookup runs no Python code
    CONNECTING = "connecting"
    STARTING = "starting"
    """Connected, preface sent; waiting for the backend's SETTINGS."""
    READY = "ready"
    DRAINING = "draining"
    """GOAWAY received (or sent): in-flight streams finish, no new ones."""
    CLOSED = "closed"


class H2Input(enum.Enum):
    __hash__ = object.__hash__  # as ``Phase``'s: a table lookup runs no Python code
    OPENED = "opened"
    """The driver's ``ConnectionOpened``: the preface and our SETTINGS go out."""
    OPEN_FAILED = "open_failed"
    """The driver's ``OpenFailed``."""
    SETTINGS = "settings"
    """The backend's first SETTINGS arrived (RFC 9113 §3.4): streams may start."""
    GOAWAY = "goaway"
    """The backend's first GOAWAY arrived (RFC 9113 §6.8)."""
    RETIRE = "retire"
    """The last stream id was taken (RFC 9113 §5.1.1)."""
    CLOSE = "close"
    """We close it (``close``)."""
    PEER_CLOSED = "peer_closed"
    """The driver's ``ConnectionClosed``."""


_S = H2State
_I = H2Input
TRANSITIONS: Transitions[H2State, H2Input] = {
    (_S.CONNECTING, _I.OPENED): _S.STARTING,
    (_S.CONNECTING, _I.OPEN_FAILED): _S.CLOSED,
    (_S.CONNECTING, _I.SETTINGS): ILLEGAL,  # no byte is read before the connect opened
    (_S.CONNECTING, _I.GOAWAY): ILLEGAL,
    (_S.CONNECTING, _I.RETIRE): ILLEGAL,  # no stream before READY
    (_S.CONNECTING, _I.CLOSE): _S.CLOSED,
    (_S.CONNECTING, _I.PEER_CLOSED): _S.CLOSED,
    (_S.STARTING, _I.OPENED): IGNORED,  # reported twice
    (_S.STARTING, _I.OPEN_FAILED): ILLEGAL,  # the driver reports a close once it opened
    (_S.STARTING, _I.SETTINGS): _S.READY,
    (_S.STARTING, _I.GOAWAY): _S.DRAINING,  # before or with the first SETTINGS: no stream
    (_S.STARTING, _I.RETIRE): ILLEGAL,
    (_S.STARTING, _I.CLOSE): _S.CLOSED,
    (_S.STARTING, _I.PEER_CLOSED): _S.CLOSED,
    (_S.READY, _I.OPENED): IGNORED,
    (_S.READY, _I.OPEN_FAILED): ILLEGAL,
    (_S.READY, _I.SETTINGS): ILLEGAL,  # the first SETTINGS made it READY; it comes once
    (_S.READY, _I.GOAWAY): _S.DRAINING,
    (_S.READY, _I.RETIRE): _S.DRAINING,
    (_S.READY, _I.CLOSE): _S.CLOSED,
    (_S.READY, _I.PEER_CLOSED): _S.CLOSED,
    (_S.DRAINING, _I.OPENED): IGNORED,
    (_S.DRAINING, _I.OPEN_FAILED): ILLEGAL,
    (_S.DRAINING, _I.SETTINGS): IGNORED,  # after a GOAWAY that came first: too late to serve
    (_S.DRAINING, _I.GOAWAY): IGNORED,  # the first GOAWAY after the ids ran out
    (_S.DRAINING, _I.RETIRE): IGNORED,  # a stream taken while READY, opened after a GOAWAY
    (_S.DRAINING, _I.CLOSE): _S.CLOSED,
    (_S.DRAINING, _I.PEER_CLOSED): _S.CLOSED,
    # CLOSED: the driver's reports of it and its bytes were on their way.
    (_S.CLOSED, _I.OPENED): IGNORED,
    (_S.CLOSED, _I.OPEN_FAILED): IGNORED,
    (_S.CLOSED, _I.SETTINGS): IGNORED,
    (_S.CLOSED, _I.GOAWAY): IGNORED,
    (_S.CLOSED, _I.RETIRE): IGNORED,
    (_S.CLOSED, _I.CLOSE): IGNORED,
    (_S.CLOSED, _I.PEER_CLOSED): IGNORED,
}
del _S, _I
