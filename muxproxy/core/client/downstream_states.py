"""A client connection's life as data: its states, what moves them, and the table of both.

``Downstream`` (``downstream.py``) is in one ``ClientState`` at a time, which names what it
speaks and, while it speaks HTTP, what bounds it while it carries no request:

- SNIFFING: a plain listener's connection whose first bytes do not tell yet whether it speaks
  HTTP/1.1 or HTTP/2 with prior knowledge (RFC 9113 §3.3, §3.4);
- ``H1_*`` / ``H2_*``: HEAD, a request head is due (the ``header`` timer: ``client_header``
  from the connection's start, or on a kept-alive HTTP/1.1 connection from the first byte of
  the next head, RFC 9110 §15.5.9); IDLE, between requests (the ``idle`` timer,
  ``keepalive_idle``); BUSY, requests in progress (their exchanges' timers bound it);
- CLOSING: we closed it (``CloseConnection``); the driver writes what is pending, within the
  command's ``flush_timeout``, and reports the close. Nothing more is read or written;
- CLOSED: the driver reported the close (or the client's EOF): the core has forgotten it.

Its inputs (``ClientInput``) are what the driver reports, its timers by kind, what its
exchanges and the graceful stop (``shutdown.py``) ask of it, and its own decisions (the
protocol, the h2c switch, the keep-alive cycle). ``TRANSITIONS`` lists every pair, under the
rules of ``states.py``. A pair whose target is the state it comes from is acted on and moves
nothing: bytes read on an open connection, say. Read for this part:

- IGNORED: the input comes late, after our own close (CLOSING: a read or a write report the
  driver had under way, a timer still armed, the graceful stop), or again (a second close;
  the follow-up of a second stream that ended in the same event).
- ILLEGAL: only a bug brings it: a timer in a state that never has it armed (``idle`` runs
  only while IDLE, ``header`` only while HEAD or sniffing, ``window`` and ``goaway`` only on
  HTTP/2), a second request at once on HTTP/1.1, a second choice of protocol. Once CLOSED the
  core routes nothing to the connection and has cancelled its timers, so what can still reach
  it is work of its own that was under way (a deferred follow-up or close, an exchange that
  ends as the close aborts it): that is IGNORED, a driver event or a timer ILLEGAL.

Fast paths: a lookup builds and hashes a pair (the members hash by identity, as ``Phase``'s:
``Enum.__hash__`` would run in Python), so the inputs of every token (``DATA``, ``SENT``) do
not look the table up in the states that act on them; they read ``ClientState.protocol``, a
plain attribute of each state, and take the table only in the others.
``tests/core/test_downstream_states.py`` checks that both say the same.
"""

from __future__ import annotations

import enum

from muxproxy.core.states import IGNORED, ILLEGAL, Transitions
from muxproxy.core.timers import ClientTimer


class Protocol(enum.Enum):
    """What a client connection speaks: the part of its ``ClientState`` the hot paths read."""

    SNIFFING = "sniffing"
    """Plain listener, first bytes not seen yet: HTTP/1.1 or the HTTP/2 preface?"""
    HTTP1 = "http/1.1"
    HTTP2 = "h2"
    CLOSED = "closed"
    """Closing or closed: nothing more is read or written."""


class ClientState(enum.Enum):
    """The state of one client connection (see the module docstring)."""

    __hash__ = object.__hash__  # as ``Phase``'s: a table lookup runs no Python code

    protocol: Protocol
    """What it speaks in this state."""

    def __init__(self, value: str, protocol: Protocol) -> None:
        self.protocol = protocol

    SNIFFING = ("sniffing", Protocol.SNIFFING)
    H1_HEAD = ("h1_head", Protocol.HTTP1)
    H1_IDLE = ("h1_idle", Protocol.HTTP1)
    H1_BUSY = ("h1_busy", Protocol.HTTP1)
    H2_HEAD = ("h2_head", Protocol.HTTP2)
    H2_IDLE = ("h2_idle", Protocol.HTTP2)
    H2_BUSY = ("h2_busy", Protocol.HTTP2)
    CLOSING = ("closing", Protocol.CLOSED)
    CLOSED = ("closed", Protocol.CLOSED)


class ClientInput(enum.Enum):
    __hash__ = object.__hash__  # as ``Phase``'s: a table lookup runs no Python code
    H1 = "h1"
    """It speaks HTTP/1.1: ALPN said so (or nothing, over TLS), or its first bytes are not the
    HTTP/2 preface."""
    H2 = "h2"
    """It speaks HTTP/2: ALPN ``h2``, or its first bytes are the preface's first line."""
    H2C = "h2c"
    """An HTTP/1.1 request's h2c upgrade is accepted (RFC 7540 §3.2): the 101, then HTTP/2
    with that request as stream 1."""
    DATA = "data"
    """Bytes from the client (``DataReceived``)."""
    SENT = "sent"
    """The driver wrote bytes (``DataSent``)."""
    HEAD_BEGAN = "head_began"
    """The first bytes of a request head came on an HTTP/1.1 connection that carries no
    request (an idle one, or pipelined behind the response that just ended)."""
    STARTED = "started"
    """A request head became an exchange."""
    FINISHED = "finished"
    """An exchange ended (``exchange_finished``); what follows for the connection is deferred
    until the current event is handled (``Effects.defer``)."""
    FOLLOW_UP = "follow_up"
    """That deferred follow-up runs: the next request, idle, or the close."""
    UNUSED = "unused"
    """The last exchange ended and nothing of a next request is here: the ``idle`` timer."""
    SEND_TIMER = "send_timer"
    """No write progress for ``timeouts.send`` (lazy: checked when it fires)."""
    WINDOW_TIMER = "window_timer"
    """An HTTP/2 stream's response waited ``timeouts.send`` for the client's window."""
    IDLE_TIMER = "idle_timer"
    """``keepalive_idle`` passed between requests."""
    HEADER_TIMER = "header_timer"
    """``client_header`` passed with no whole request head."""
    GOAWAY_TIMER = "goaway_timer"
    """No ACK in time for the PING of a graceful stop's first GOAWAY (``shutdown.py``)."""
    STOP = "stop"
    """A graceful stop began (``shutdown.stop_client``), or the protocol was chosen after."""
    REFUSE = "refuse"
    """Accepted while stopping (``shutdown.refuse_client``): closed at once."""
    CUT = "cut"
    """The graceful stop's deadline (``shutdown.cut_client``)."""
    CLOSE = "close"
    """We close it: an error answered, a timeout, the stop, an exchange's or tunnel's end."""
    PEER_CLOSED = "peer_closed"
    """The driver's ``ConnectionClosed``, or the client's EOF (``InputEnded``)."""


TIMER_INPUTS: dict[ClientTimer, ClientInput] = {
    ClientTimer.SEND: ClientInput.SEND_TIMER,
    ClientTimer.WINDOW: ClientInput.WINDOW_TIMER,
    ClientTimer.IDLE: ClientInput.IDLE_TIMER,
    ClientTimer.HEADER: ClientInput.HEADER_TIMER,
    ClientTimer.GOAWAY: ClientInput.GOAWAY_TIMER,
}

_S = ClientState
_I = ClientInput
TRANSITIONS: Transitions[ClientState, ClientInput] = {
    # The protocol is chosen once, while sniffing (or at the accept, by ALPN).
    (_S.SNIFFING, _I.H1): _S.H1_HEAD,
    (_S.H1_HEAD, _I.H1): ILLEGAL,
    (_S.H1_IDLE, _I.H1): ILLEGAL,
    (_S.H1_BUSY, _I.H1): ILLEGAL,
    (_S.H2_HEAD, _I.H1): ILLEGAL,
    (_S.H2_IDLE, _I.H1): ILLEGAL,
    (_S.H2_BUSY, _I.H1): ILLEGAL,
    (_S.CLOSING, _I.H1): ILLEGAL,  # nothing is read once closing
    (_S.CLOSED, _I.H1): ILLEGAL,
    (_S.SNIFFING, _I.H2): _S.H2_HEAD,
    (_S.H1_HEAD, _I.H2): ILLEGAL,
    (_S.H1_IDLE, _I.H2): ILLEGAL,
    (_S.H1_BUSY, _I.H2): ILLEGAL,
    (_S.H2_HEAD, _I.H2): ILLEGAL,
    (_S.H2_IDLE, _I.H2): ILLEGAL,
    (_S.H2_BUSY, _I.H2): ILLEGAL,
    (_S.CLOSING, _I.H2): ILLEGAL,
    (_S.CLOSED, _I.H2): ILLEGAL,
    # h11 parses one request at a time and withholds an h2c offer's head, so the offer is
    # taken while no exchange runs, after its first bytes made an idle connection HEAD.
    (_S.SNIFFING, _I.H2C): ILLEGAL,
    (_S.H1_HEAD, _I.H2C): _S.H2_HEAD,
    (_S.H1_IDLE, _I.H2C): ILLEGAL,
    (_S.H1_BUSY, _I.H2C): ILLEGAL,
    (_S.H2_HEAD, _I.H2C): ILLEGAL,
    (_S.H2_IDLE, _I.H2C): ILLEGAL,
    (_S.H2_BUSY, _I.H2C): ILLEGAL,
    (_S.CLOSING, _I.H2C): ILLEGAL,
    (_S.CLOSED, _I.H2C): ILLEGAL,
    # Bytes in. Once we closed, a read the driver had under way is dropped.
    (_S.SNIFFING, _I.DATA): _S.SNIFFING,
    (_S.H1_HEAD, _I.DATA): _S.H1_HEAD,
    (_S.H1_IDLE, _I.DATA): _S.H1_IDLE,
    (_S.H1_BUSY, _I.DATA): _S.H1_BUSY,
    (_S.H2_HEAD, _I.DATA): _S.H2_HEAD,
    (_S.H2_IDLE, _I.DATA): _S.H2_IDLE,
    (_S.H2_BUSY, _I.DATA): _S.H2_BUSY,
    (_S.CLOSING, _I.DATA): IGNORED,
    (_S.CLOSED, _I.DATA): ILLEGAL,
    # Bytes written. Nothing is sent while sniffing; once closing the driver's flush is
    # bounded by its own ``flush_timeout``, so its progress is of no use here.
    (_S.SNIFFING, _I.SENT): ILLEGAL,
    (_S.H1_HEAD, _I.SENT): _S.H1_HEAD,
    (_S.H1_IDLE, _I.SENT): _S.H1_IDLE,
    (_S.H1_BUSY, _I.SENT): _S.H1_BUSY,
    (_S.H2_HEAD, _I.SENT): _S.H2_HEAD,
    (_S.H2_IDLE, _I.SENT): _S.H2_IDLE,
    (_S.H2_BUSY, _I.SENT): _S.H2_BUSY,
    (_S.CLOSING, _I.SENT): IGNORED,
    (_S.CLOSED, _I.SENT): ILLEGAL,
    # The keep-alive cycle (HTTP/1.1 only): an idle connection's next head begins, or a
    # pipelined one had begun when the last response ended (the follow-up).
    (_S.SNIFFING, _I.HEAD_BEGAN): ILLEGAL,
    (_S.H1_HEAD, _I.HEAD_BEGAN): ILLEGAL,
    (_S.H1_IDLE, _I.HEAD_BEGAN): _S.H1_HEAD,
    (_S.H1_BUSY, _I.HEAD_BEGAN): _S.H1_HEAD,
    (_S.H2_HEAD, _I.HEAD_BEGAN): ILLEGAL,
    (_S.H2_IDLE, _I.HEAD_BEGAN): ILLEGAL,
    (_S.H2_BUSY, _I.HEAD_BEGAN): ILLEGAL,
    (_S.CLOSING, _I.HEAD_BEGAN): ILLEGAL,
    (_S.CLOSED, _I.HEAD_BEGAN): ILLEGAL,
    # An exchange starts. HTTP/2 streams run side by side: another one keeps the connection
    # BUSY (its HEAD and IDLE timers are off already).
    # Nothing is read once closing, and no exchange is started while handling a read that
    # closes (h11 gives one request a read; h2's connection errors close after the read).
    (_S.SNIFFING, _I.STARTED): ILLEGAL,
    (_S.H1_HEAD, _I.STARTED): _S.H1_BUSY,
    (_S.H1_IDLE, _I.STARTED): _S.H1_BUSY,
    (_S.H1_BUSY, _I.STARTED): ILLEGAL,  # one request at a time (RFC 9112 §9.3)
    (_S.H2_HEAD, _I.STARTED): _S.H2_BUSY,
    (_S.H2_IDLE, _I.STARTED): _S.H2_BUSY,
    (_S.H2_BUSY, _I.STARTED): _S.H2_BUSY,
    (_S.CLOSING, _I.STARTED): ILLEGAL,
    (_S.CLOSED, _I.STARTED): ILLEGAL,
    # An exchange ends: only a BUSY connection carries one. Once closing, the close aborted
    # it and nothing follows.
    (_S.SNIFFING, _I.FINISHED): ILLEGAL,
    (_S.H1_HEAD, _I.FINISHED): ILLEGAL,
    (_S.H1_IDLE, _I.FINISHED): ILLEGAL,
    (_S.H1_BUSY, _I.FINISHED): _S.H1_BUSY,
    (_S.H2_HEAD, _I.FINISHED): ILLEGAL,
    (_S.H2_IDLE, _I.FINISHED): ILLEGAL,
    (_S.H2_BUSY, _I.FINISHED): _S.H2_BUSY,
    (_S.CLOSING, _I.FINISHED): IGNORED,
    (_S.CLOSED, _I.FINISHED): IGNORED,  # aborted by the close the driver reported
    # Its follow-up. Streams that end in one event each have one, and the first may have
    # made the connection idle already; the rest still cancel their request bodies.
    (_S.SNIFFING, _I.FOLLOW_UP): ILLEGAL,
    (_S.H1_HEAD, _I.FOLLOW_UP): ILLEGAL,
    (_S.H1_IDLE, _I.FOLLOW_UP): ILLEGAL,
    (_S.H1_BUSY, _I.FOLLOW_UP): _S.H1_BUSY,
    (_S.H2_HEAD, _I.FOLLOW_UP): ILLEGAL,
    (_S.H2_IDLE, _I.FOLLOW_UP): _S.H2_IDLE,
    (_S.H2_BUSY, _I.FOLLOW_UP): _S.H2_BUSY,
    (_S.CLOSING, _I.FOLLOW_UP): IGNORED,  # closed meanwhile
    (_S.CLOSED, _I.FOLLOW_UP): IGNORED,
    (_S.SNIFFING, _I.UNUSED): ILLEGAL,
    (_S.H1_HEAD, _I.UNUSED): ILLEGAL,
    (_S.H1_IDLE, _I.UNUSED): ILLEGAL,
    (_S.H1_BUSY, _I.UNUSED): _S.H1_IDLE,
    (_S.H2_HEAD, _I.UNUSED): ILLEGAL,
    (_S.H2_IDLE, _I.UNUSED): IGNORED,  # a second follow-up: the idle timer runs already
    (_S.H2_BUSY, _I.UNUSED): _S.H2_IDLE,
    (_S.CLOSING, _I.UNUSED): ILLEGAL,
    (_S.CLOSED, _I.UNUSED): ILLEGAL,
    # Timers. ``send`` is armed once something was sent, ``window`` once an HTTP/2 stream's
    # response waits for a window; neither is cancelled when the connection goes idle or
    # closes, and each checks what it bounds when it fires. ``idle`` runs only while IDLE,
    # ``header`` only while HEAD (and while sniffing), ``goaway`` only on HTTP/2. The close
    # the driver reports cancels them all; until then, ours leaves the flush to the driver.
    (_S.SNIFFING, _I.SEND_TIMER): ILLEGAL,
    (_S.H1_HEAD, _I.SEND_TIMER): _S.H1_HEAD,
    (_S.H1_IDLE, _I.SEND_TIMER): _S.H1_IDLE,
    (_S.H1_BUSY, _I.SEND_TIMER): _S.H1_BUSY,
    (_S.H2_HEAD, _I.SEND_TIMER): _S.H2_HEAD,
    (_S.H2_IDLE, _I.SEND_TIMER): _S.H2_IDLE,
    (_S.H2_BUSY, _I.SEND_TIMER): _S.H2_BUSY,
    (_S.CLOSING, _I.SEND_TIMER): IGNORED,
    (_S.CLOSED, _I.SEND_TIMER): ILLEGAL,
    (_S.SNIFFING, _I.WINDOW_TIMER): ILLEGAL,
    (_S.H1_HEAD, _I.WINDOW_TIMER): ILLEGAL,
    (_S.H1_IDLE, _I.WINDOW_TIMER): ILLEGAL,
    (_S.H1_BUSY, _I.WINDOW_TIMER): ILLEGAL,
    (_S.H2_HEAD, _I.WINDOW_TIMER): ILLEGAL,  # no stream has sent anything yet
    (_S.H2_IDLE, _I.WINDOW_TIMER): _S.H2_IDLE,
    (_S.H2_BUSY, _I.WINDOW_TIMER): _S.H2_BUSY,
    (_S.CLOSING, _I.WINDOW_TIMER): IGNORED,
    (_S.CLOSED, _I.WINDOW_TIMER): ILLEGAL,
    (_S.SNIFFING, _I.IDLE_TIMER): ILLEGAL,
    (_S.H1_HEAD, _I.IDLE_TIMER): ILLEGAL,
    (_S.H1_IDLE, _I.IDLE_TIMER): _S.H1_IDLE,
    (_S.H1_BUSY, _I.IDLE_TIMER): ILLEGAL,
    (_S.H2_HEAD, _I.IDLE_TIMER): ILLEGAL,
    (_S.H2_IDLE, _I.IDLE_TIMER): _S.H2_IDLE,
    (_S.H2_BUSY, _I.IDLE_TIMER): ILLEGAL,
    (_S.CLOSING, _I.IDLE_TIMER): IGNORED,
    (_S.CLOSED, _I.IDLE_TIMER): ILLEGAL,
    (_S.SNIFFING, _I.HEADER_TIMER): _S.SNIFFING,
    (_S.H1_HEAD, _I.HEADER_TIMER): _S.H1_HEAD,
    (_S.H1_IDLE, _I.HEADER_TIMER): ILLEGAL,
    (_S.H1_BUSY, _I.HEADER_TIMER): ILLEGAL,
    (_S.H2_HEAD, _I.HEADER_TIMER): _S.H2_HEAD,
    (_S.H2_IDLE, _I.HEADER_TIMER): ILLEGAL,
    (_S.H2_BUSY, _I.HEADER_TIMER): ILLEGAL,
    (_S.CLOSING, _I.HEADER_TIMER): IGNORED,
    (_S.CLOSED, _I.HEADER_TIMER): ILLEGAL,
    (_S.SNIFFING, _I.GOAWAY_TIMER): ILLEGAL,
    (_S.H1_HEAD, _I.GOAWAY_TIMER): ILLEGAL,
    (_S.H1_IDLE, _I.GOAWAY_TIMER): ILLEGAL,
    (_S.H1_BUSY, _I.GOAWAY_TIMER): ILLEGAL,
    (_S.H2_HEAD, _I.GOAWAY_TIMER): _S.H2_HEAD,
    (_S.H2_IDLE, _I.GOAWAY_TIMER): _S.H2_IDLE,
    (_S.H2_BUSY, _I.GOAWAY_TIMER): _S.H2_BUSY,
    (_S.CLOSING, _I.GOAWAY_TIMER): IGNORED,
    (_S.CLOSED, _I.GOAWAY_TIMER): ILLEGAL,
    # The graceful stop reaches every connection the core holds, a closing one too; a
    # connection accepted while stopping is refused before anything else happens to it.
    (_S.SNIFFING, _I.STOP): _S.SNIFFING,
    (_S.H1_HEAD, _I.STOP): _S.H1_HEAD,
    (_S.H1_IDLE, _I.STOP): _S.H1_IDLE,
    (_S.H1_BUSY, _I.STOP): _S.H1_BUSY,
    (_S.H2_HEAD, _I.STOP): _S.H2_HEAD,
    (_S.H2_IDLE, _I.STOP): _S.H2_IDLE,
    (_S.H2_BUSY, _I.STOP): _S.H2_BUSY,
    (_S.CLOSING, _I.STOP): IGNORED,
    (_S.CLOSED, _I.STOP): ILLEGAL,
    (_S.SNIFFING, _I.REFUSE): _S.SNIFFING,
    (_S.H1_HEAD, _I.REFUSE): _S.H1_HEAD,  # by ALPN
    (_S.H1_IDLE, _I.REFUSE): ILLEGAL,
    (_S.H1_BUSY, _I.REFUSE): ILLEGAL,
    (_S.H2_HEAD, _I.REFUSE): _S.H2_HEAD,
    (_S.H2_IDLE, _I.REFUSE): ILLEGAL,
    (_S.H2_BUSY, _I.REFUSE): ILLEGAL,
    (_S.CLOSING, _I.REFUSE): ILLEGAL,
    (_S.CLOSED, _I.REFUSE): ILLEGAL,
    (_S.SNIFFING, _I.CUT): _S.SNIFFING,
    (_S.H1_HEAD, _I.CUT): _S.H1_HEAD,
    (_S.H1_IDLE, _I.CUT): _S.H1_IDLE,
    (_S.H1_BUSY, _I.CUT): _S.H1_BUSY,
    (_S.H2_HEAD, _I.CUT): _S.H2_HEAD,
    (_S.H2_IDLE, _I.CUT): _S.H2_IDLE,
    (_S.H2_BUSY, _I.CUT): _S.H2_BUSY,
    (_S.CLOSING, _I.CUT): IGNORED,
    (_S.CLOSED, _I.CUT): ILLEGAL,
    # The close: ours (again, or deferred past the driver's report), and the driver's.
    (_S.SNIFFING, _I.CLOSE): _S.CLOSING,
    (_S.H1_HEAD, _I.CLOSE): _S.CLOSING,
    (_S.H1_IDLE, _I.CLOSE): _S.CLOSING,
    (_S.H1_BUSY, _I.CLOSE): _S.CLOSING,
    (_S.H2_HEAD, _I.CLOSE): _S.CLOSING,
    (_S.H2_IDLE, _I.CLOSE): _S.CLOSING,
    (_S.H2_BUSY, _I.CLOSE): _S.CLOSING,
    (_S.CLOSING, _I.CLOSE): IGNORED,
    (_S.CLOSED, _I.CLOSE): IGNORED,
    (_S.SNIFFING, _I.PEER_CLOSED): _S.CLOSED,
    (_S.H1_HEAD, _I.PEER_CLOSED): _S.CLOSED,
    (_S.H1_IDLE, _I.PEER_CLOSED): _S.CLOSED,
    (_S.H1_BUSY, _I.PEER_CLOSED): _S.CLOSED,
    (_S.H2_HEAD, _I.PEER_CLOSED): _S.CLOSED,
    (_S.H2_IDLE, _I.PEER_CLOSED): _S.CLOSED,
    (_S.H2_BUSY, _I.PEER_CLOSED): _S.CLOSED,
    (_S.CLOSING, _I.PEER_CLOSED): _S.CLOSED,
    (_S.CLOSED, _I.PEER_CLOSED): ILLEGAL,  # the core forgot it at the first
}
del _S, _I
