"""Timers: who owns a timer, and its kind, as types.

A timer id is ``(kind, ident)``: ``ident`` names the owner (an exchange, a connection, a probe),
and the kind's enum names what kind of owner it is, so ``ProxyCore`` dispatches a ``Wakeup`` by
the enum (``match`` with ``assert_never``: a kind no owner handles is a type error, never a
timer silently ignored) and each owner dispatches on its own kinds the same way. Every kind is a
``StrEnum``: a timer id is still a plain ``(str, int)`` to a driver that treats it as an opaque
key (``docs/embedding.md``), and compares equal to one.
"""

from __future__ import annotations

import enum


class ExchangeTimer(enum.StrEnum):
    """An exchange's timers; ``ident`` is the exchange's."""

    CONNECT = "connect"
    """The backend connection's connect (``timeouts.connect``)."""
    HEAD = "head"
    """The backend's response head (``timeouts.response_head``)."""
    FIRST_TOKEN = "first_token"
    """The first body byte of the response (``[upstreams.NAME.timeouts] first_token``)."""
    READ = "read"
    """Backend silence mid-response (``timeouts.read``; lazy: re-armed when it fires)."""
    HEARTBEAT = "heartbeat"
    """An SSE comment to a quiet stream (``sse_heartbeat``)."""
    TUNNEL = "tunnel"
    """A tunnel's idle bound (``timeouts.tunnel_idle``)."""
    DEADLINE = "deadline"
    """A gRPC call's ``grpc-timeout``."""
    BODY = "body"
    """A request body that stopped coming (``timeouts.client_header``)."""
    QUEUE = "queue"
    """A request waiting for a server with room (``[upstreams.NAME.queue] timeout``)."""


class ClientTimer(enum.StrEnum):
    """A client connection's timers; ``ident`` is the connection's id."""

    HEADER = "header"
    """A request head due (``timeouts.client_header``)."""
    IDLE = "idle"
    """A kept-alive connection between requests (``timeouts.keepalive_idle``)."""
    SEND = "send"
    """No write progress (``timeouts.send``)."""
    WINDOW = "window"
    """An HTTP/2 stream waiting for the client's window (``timeouts.send``)."""
    GOAWAY = "goaway"
    """The PING ack after a graceful stop's first GOAWAY (``shutdown.py``)."""


class BackendTimer(enum.StrEnum):
    """A backend connection's timer; ``ident`` is the connection's id."""

    POOL = "pool"
    """Idle in the pool; for HTTP/2 also the connection's start and PING deadlines."""


class ProbeTimer(enum.StrEnum):
    """A health probe's timers; ``ident`` is the probe's."""

    PROBE = "probe"
    """The next check is due."""
    PROBE_TIMEOUT = "probe_timeout"
    """The check in flight took too long."""


class CoreTimer(enum.StrEnum):
    """The core's own timer; ``ident`` is 0."""

    SHUTDOWN = "shutdown"
    """A graceful stop's deadline."""
    SESSIONS = "sessions"
    """The batch of sessions remembered is due (``sessionshare.py``)."""


class ResumeTimer(enum.StrEnum):
    """A resumable stream's timer; ``ident`` is the stream's (``resume.py``)."""

    LINGER = "linger"
    """Nobody read the stream for ``resume.linger`` seconds: end its backend, forget it."""


TimerKind = ExchangeTimer | ClientTimer | BackendTimer | ProbeTimer | CoreTimer | ResumeTimer
TimerId = tuple[TimerKind, int]
