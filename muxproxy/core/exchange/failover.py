"""Failover: the servers one exchange tries, in order, and whether it may try again.

What it obeys:

- The order is the group's ``GroupRouter``'s (sticky pin, session key, balancer), asked once
  when the exchange is routed; the exchange walks it on failure. Each try counts as a stream
  on its server while it lasts (``stream_started`` / ``stream_ended``: least streams), a
  failure before the response head counts against the server's passive health (a server it
  takes out is logged), a response head for it.
- ``next_upstream`` (RFC 9110 §9.2.2: whether to retry is the proxy's decision): another try
  only on a configured condition (``error``, ``timeout``, ``http_<status>``), within ``tries``
  attempts in all and ``tries_timeout`` seconds of the first, and only while nothing reached
  the client (the exchange's table says so: ``exchange_states.py``). Once every candidate was
  tried the router is asked again, since failures change who is usable (the last primary
  down brings in the backups). The request body must be replayable (``body.RequestBody``:
  kept up to ``replay_buffer`` bytes); a retry it prevents is logged (``retry_skipped``).
- Admission (``max_streams``, ``max_waiting``): each try goes to the first candidate left
  that has room (``GroupRouter.has_room``); a first try that finds none makes the exchange
  wait in the group's queue (``admit.py``), a retry that finds none is not made. A try
  that ends frees room: the queue's next request is admitted after the current input
  (``ServerHost.room_freed``).
- The stale retry: a reused keep-alive connection that fails before any response byte most
  likely met the backend's close (RFC 9112 §9.3.1). It is retried once on a fresh connection
  to the same server, whatever ``next_upstream`` says, without counting a try or touching the
  server's health, when the request may be sent twice (``may_resend``).

``Failover`` asks the pool for each try's stream on behalf of its exchange (the pool's
``UpstreamUser``), which moves its own phase first (``RETRY``) and handles what comes back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from muxproxy.config import Upstream
from muxproxy.core.commands import Log, Origin
from muxproxy.core.effects import Effects
from muxproxy.core.exchange.body import RequestBody
from muxproxy.core.exchange.deadlines import connect_timeout
from muxproxy.core.http.headers import header_value
from muxproxy.core.messages import RequestHead
from muxproxy.core.ports import ServerHost, UpstreamStream, UpstreamUser
from muxproxy.core.timers import ExchangeTimer
from muxproxy.routing.load import Ticket
from muxproxy.routing.sticky import cookie_value, set_cookie_header

if TYPE_CHECKING:
    from muxproxy.routing.router import GroupRouter

# RFC 9110 §9.2.2: methods a client (and so a proxy) may send again after a connection failure.
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})


class Failover:
    """The candidate servers of one exchange (indices in ``group``) and its tries."""

    def __init__(
        self,
        fx: Effects,
        host: ServerHost,
        user: UpstreamUser,
        ident: int,
        group: Upstream,
        head: RequestHead,
        body: RequestBody,
        session_key: bytes | None,
        *,
        prefix: bytes | None = None,
        ticket: Ticket | None = None,
        model: str | None = None,
        conversation: list[bytes] | None = None,
    ) -> None:
        """The router's order for ``head`` with ``session_key``, ``prefix`` (the prompt's
        key) and ``model`` (the body's, for LoRA placement; ``candidates`` is empty where no
        server is usable); ``body``: the request's,
        replayed for a retry; ``ident``: the exchange's, for its ``connect`` timer;
        ``ticket``: its expected work, counted on the server of each try; ``conversation``:
        its message prefixes' keys, with ``kv_events`` (``routing/kvplace.py``)."""
        self.fx = fx
        self.body = body
        self.host = host
        self.user = user
        self.ident = ident
        self.group = group
        self.router: GroupRouter = host.router(group)
        self.session_key = session_key
        self.prefix = prefix
        self.model = model
        self.conversation = conversation
        self.ticket = ticket
        cookie = group.sticky.cookie
        self.pinned = (cookie_value(head.headers, cookie.name) or None) if cookie else None
        """The server id of the client's sticky cookie, if it sent one."""
        self.started = fx.now
        """When the first try started (``tries_timeout`` runs from there)."""
        self.candidates = self.router.candidates(
            session_key, self.pinned, fx.now, prefix, model, conversation
        )
        self.tries = 0
        self.server: int | None = None
        """The server of the current try, while it counts as a stream there."""
        self.address = ""
        """The configured address of the last server tried."""
        self.server_id: str | None = None
        self.origin: Origin | None = None
        self.stale_retried = False

    def attempt(self, *, user: UpstreamUser | None = None) -> None:
        """Ask for a stream to the next candidate (counted as a try); ``user``: who gets it,
        if not the exchange (the stream that continues its answer, ``continuing.py``)."""
        fx = self.fx
        index = self.server = self.candidates[self.tries]
        self.tries += 1
        self.router.stream_started(index, self.session_key, fx.now, self.ticket)
        server = self.group.servers[index]
        self.address = server.address
        self.server_id = self.router.ids[index].decode("ascii")
        self._connect(Origin.of(server), user=user)

    def attempt_fresh(self, reason: str, request_id: bytes) -> None:
        """The stale retry: a fresh connection to the same server."""
        assert self.origin is not None
        self.stale_retried = True
        self.count_retry("stale_connection", reason, request_id)
        self._connect(self.origin, fresh=True)

    def _connect(
        self, origin: Origin, *, fresh: bool = False, user: UpstreamUser | None = None
    ) -> None:
        fx = self.fx
        self.origin = origin
        at = fx.now + connect_timeout(self.group, fx.config)
        fx.set_timer((ExchangeTimer.CONNECT, self.ident), at)
        self.host.pool.acquire(origin, self.group, user or self.user, fresh=fresh)

    def leave(self) -> None:
        """The current try no longer counts as a stream on its server."""
        if self.server is not None:
            router = self.router
            router.stream_ended(self.server, self.ticket)
            self.server = None
            if router.queue:
                self.host.room_freed(router)

    def choose_room(self) -> bool:
        """Make the next try the first candidate left with room; False if none has any."""
        if not self.group.admission:
            return True
        router, now, candidates = self.router, self.fx.now, self.candidates
        for at in range(self.tries, len(candidates)):
            if router.has_room(candidates[at], now):
                if at != self.tries:
                    candidates.insert(self.tries, candidates.pop(at))
                return True
        return False

    def readmit(self, group: Upstream) -> None:
        """Admitted from the queue: the group as configured now, and its order now;
        ``tries_timeout`` runs from here (the wait was not a try)."""
        self.group = group
        self.started = self.fx.now
        self.router = self.host.router(group)
        router, now = self.router, self.fx.now
        self.candidates = router.candidates(
            self.session_key, self.pinned, now, self.prefix, self.model, self.conversation
        )

    def failed(self, condition: str, reason: str) -> None:
        """The current try failed before the response head went out: count it against the
        server (``condition``: error, timeout, http_<status>)."""
        assert self.server is not None
        self.host.measurements.failure(self.group.name, self.address, condition)
        if self.router.failed(self.server, self.fx.now):
            fail_timeout = self.group.servers[self.server].fail_timeout
            fields = {
                "upstream": self.group.name,
                "server": self.address,
                "up": False,
                "detail": f"passive: {reason}; out for {fail_timeout:g}s",
            }
            self.fx.emit(Log(event="health", fields=fields))

    def failed_mid_stream(self) -> None:
        """The current try failed after the response head went out (a truncated stream)."""
        self.host.measurements.failure(self.group.name, self.address, "mid_stream")

    def succeeded(self) -> None:
        """The current try's server answered."""
        assert self.server is not None
        self.router.succeeded(self.server)

    def pin(self) -> tuple[bytes, bytes] | None:
        """The Set-Cookie that pins the client to the current server, on a group with a
        sticky cookie, unless the client's cookie names that server already."""
        cookie = self.group.sticky.cookie
        assert self.server is not None
        server_id = self.router.ids[self.server]
        if cookie is None or self.pinned == server_id:
            return None
        return set_cookie_header(cookie, server_id)

    def allows(self, condition: str) -> bool:
        """Whether ``next_upstream`` allows another try after ``condition``; if so, the body
        is rewound for it."""
        policy = self.group.next_upstream
        if condition not in policy.on:
            return False
        now = self.fx.now
        if not self._try_left(now):
            return False
        if now - self.started >= policy.tries_timeout:
            return False
        if not self.choose_room():
            reason = "every other server is full"
            self.fx.emit(Log(event="retry_skipped", fields={"reason": reason}))
            return False
        if not self.body.rewind():
            reason = "request body larger than the replay buffer"
            self.fx.emit(Log(event="retry_skipped", fields={"reason": reason}))
            return False
        return True

    def allows_continuation(self) -> bool:
        """Whether an answer that broke mid-stream may be finished by another try (within
        ``next_upstream.tries`` and ``tries_timeout``, on a server with room)."""
        now = self.fx.now
        if not self._try_left(now):
            return False
        return now - self.started < self.group.next_upstream.tries_timeout and self.choose_room()

    def _try_left(self, now: float) -> bool:
        """Whether ``next_upstream.tries`` allow another try on a candidate not yet tried
        (servers usable again are added as candidates)."""
        if self.tries >= len(self.candidates):
            fresh = self.router.candidates(self.session_key, self.pinned, now, model=self.model)
            self.candidates.extend(i for i in fresh if i not in self.candidates)
        return self.tries < min(self.group.next_upstream.tries, len(self.candidates))

    def allows_stale(self, head: RequestHead, upstream: UpstreamStream | None) -> bool:
        """Whether the stale retry is still unused and ``head``, on ``upstream``, may be sent
        again; if so, the body is rewound for it."""
        if self.stale_retried or upstream is None or not may_resend(head, upstream.written):
            return False
        return self.body.rewind()

    def count_retry(self, condition: str, reason: str, request_id: bytes) -> None:
        """Another try follows: log and count it."""
        group = self.group.name
        measurements = self.host.measurements
        if condition == "stale_connection":
            measurements.failure(group, self.address, condition)
        measurements.retry(group, condition)
        fields = {
            "request_id": request_id.decode("ascii"),
            "group": group,
            "server": self.address,
            "upstream": str(self.origin),
            "condition": condition,
            "reason": reason,
        }
        self.fx.emit(Log(event="retry", fields=fields))


def may_resend(head: RequestHead, written: bool) -> bool:
    """Whether a request may go out a second time: idempotent (RFC 9110 §9.2.2), carrying an
    Idempotency-Key, or never ``written`` (an HTTP/2 stream a GOAWAY refused, RFC 9113 §8.7)."""
    return (
        head.method in IDEMPOTENT
        or header_value(head.headers, b"idempotency-key") is not None
        or not written
    )
