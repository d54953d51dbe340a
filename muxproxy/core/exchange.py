"""One proxied request/response: from the client's request head to the end of the response.

The exchange relays version-neutral messages between a client stream (``Downstream``) and one
backend stream (``pool.UpstreamStream``: a whole HTTP/1.1 connection or one stream of a shared
HTTP/2 connection); it never sees bytes of either protocol. Its rules:

- Routing: the route is chosen by the normalised path (``paths.py``: dot-segments resolved,
  encoded unreserved characters decoded; a dot-segment behind an encoded slash is a 400), and
  that path is what the backend gets; the group's ``GroupRouter`` orders the candidate servers
  (sticky pin, session key, balancer); the exchange walks that list on failure.
- Retries (``next_upstream``) only while nothing reached the client: on a connection error, a
  timeout or a configured status, within ``tries`` and ``tries_timeout``, with the request
  body replayed from a bounded copy (RFC 9110 §9.2.2: the proxy decides; we never retry once a
  response byte went out). With ``retry_until_first_event`` an SSE response head is held until
  its first event, so a backend that dies before its first token costs the user nothing.
- Per-chunk flush: every backend body chunk is handed to the client side in the same call
  that received it.
- Bounded buffers: bytes accepted from one side and not yet written to the other are counted;
  at ``high_water`` the source is stopped (backend: PauseReading; HTTP/1.1 client:
  PauseReading; HTTP/2 client: its WINDOW_UPDATEs are withheld), below ``low_water`` it
  resumes: a ``Flow`` per direction (``flow.py``), ``request_flow`` and ``response_flow``.
- Cancellation propagates: a client that goes away closes the backend connection at once,
  which is what stops a GPU generating tokens nobody reads.
- Truncation is visible: a backend that fails after the response head went out makes the
  client side abort the stream (RST_STREAM on HTTP/2, no final chunk on HTTP/1.1).
- Errors before the head map to short responses of our own (``errors.py``: plain text, or
  the OpenAI error object on an ``api = "openai"`` route): no route 404, no usable backend
  503, refused or broken backend 502, timeout 504 (RFC 9110 §15.6); the access log counts
  their body bytes like a backend's.
- Timeouts blame the party that is late. The backend's (response head, first token, read)
  never count time in which it waits for us: while the client is still sending the request
  body (the backend may want all of it before it answers) or while we paused the backend
  because the client is behind. A client that stops sending its body is cut by the lazy
  ``body`` timer (``client_header``; 408 / RST_STREAM, ``Downstream.refuse_slow_body``),
  also while the body is buffered for a session key; a client that stops reading, by the
  send timeouts of ``Downstream``.
- Date (RFC 9110 §6.6.1): a response the backend sent without one gets the proxy's, as do
  the proxy's own (``dates.py``: from the wall time the driver gives).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, assert_never

import attrs

from ..config import Route, Upstream
from ..routing.sticky import (
    cookie_value,
    expand_header_rule,
    session_key_from_body,
    session_key_from_head,
    set_cookie_header,
)
from . import grpc
from .access import access_fields, with_request_id
from .body import RequestBody
from .commands import Log, Origin
from .effects import Effects
from .flow import Flow
from .grpc import grpc_timeout, is_grpc, status_fields, trailers_only
from .headers import (
    header_value,
    is_event_stream,
    response_headers,
    trailer_fields,
    upstream_h1_headers,
)
from .intake import MalformedRequest
from .measure import SseMeter
from .messages import Headers, RequestHead, ResponseHead
from .paths import normalise_target
from .ports import ClientSide, ExchangeHost, Phase, RequestPhase, UpstreamStream
from .sse import HEARTBEAT, EventBoundary
from .timers import ExchangeTimer

if TYPE_CHECKING:
    from ..routing.router import GroupRouter

VIA = b"muxproxy"
# The timers of one attempt at a backend, cancelled when it ends.
ATTEMPT_TIMERS = (
    ExchangeTimer.CONNECT,
    ExchangeTimer.HEAD,
    ExchangeTimer.FIRST_TOKEN,
    ExchangeTimer.READ,
    ExchangeTimer.HEARTBEAT,
)
# RFC 9110 §9.2.2: methods a client (and so a proxy) may send again after a connection failure.
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})


# Phases in which nothing has reached the client yet, so a failure may still be retried.
UNCOMMITTED = frozenset({Phase.CONNECTING, Phase.WAITING_HEAD, Phase.HOLDING})


class Exchange:
    def __init__(
        self, fx: Effects, host: ExchangeHost, client: ClientSide, head: RequestHead, ident: int
    ) -> None:
        self.fx = fx
        self.host = host
        self.client = client
        self.stream = head.stream
        self.head = head
        self.ident = ident
        self.phase = Phase.CONNECTING
        self.request = RequestPhase.COMPLETE if head.end_stream else RequestPhase.BODY
        self.upstream: UpstreamStream | None = None
        self.origin: Origin | None = None
        self.route: Route | None = None
        self.group: Upstream | None = None
        self.router: GroupRouter | None = None
        self.body = RequestBody(0)
        self.request_trailers: Headers = []
        self.session_key: bytes | None = None
        self.pinned: bytes | None = None
        self.candidates: list[int] = []
        self.tries = 0
        self.server: int | None = None
        """Index of the server of the current attempt in its group."""
        self.response: ResponseHead | None = None
        self.request_flow = Flow()
        """The client as the request body's source; its credit: HTTP/2 bytes not yet
        acknowledged."""
        self.response_flow = Flow()
        """The backend as the response's source: stopped while the client is behind (this
        stream's bytes, or ``client_stalled``); then the client side holds us
        (``ClientSide.hold``)."""
        self.started = fx.now
        self.first_attempt_at = fx.now
        self.last_upstream_activity = fx.now
        self.last_request_activity = fx.now
        """When the client last moved the request body on (``watch_request_body``)."""
        self.request_done_at = fx.now
        """When the request was complete (its start while the body is still coming): the
        backend's response-head clock runs from there (``_backend_late``)."""
        self.first_byte_at: float | None = None
        self.status = 0
        self.bytes_out = 0
        self.bytes_in = 0
        """Request body bytes taken from the client."""
        self.outcome = ""
        self.request_id = self.host.request_ids.for_request(head.headers)
        """``X-Request-ID``: the client's when sane, else ours (``access.py``)."""
        self.server_address = ""
        """The configured address of the last server tried ("" before the first attempt)."""
        self.server_id: str | None = None
        self.head_at: float | None = None
        """When the backend's response head came (that of the attempt that answered)."""
        self.upstream_version: str | None = None
        self.meter: SseMeter | None = None
        """Events and first token of an SSE response (``measure.py``)."""
        self.sse: EventBoundary | None = None
        """Event boundaries of an SSE response that gets heartbeats (``route.sse_heartbeat``)."""
        self.heartbeat_at = 0.0
        self.stale_retried = False
        """The one retry after a stale pooled connection (``_retry_stale``) was used."""

    # -- routing ---------------------------------------------------------------------------

    def start(self) -> None:
        fx = self.fx
        head = self.head
        timeout = grpc_timeout(head.headers) if is_grpc(head.headers) else None
        if timeout is not None:
            # The whole call's deadline, across retries (gRPC's grpc-timeout).
            fx.set_timer((ExchangeTimer.DEADLINE, self.ident), fx.now + timeout)
        try:
            target = normalise_target(head.target)
        except MalformedRequest as exc:
            self.fail(exc.status, exc.reason)
            return
        if target is not head.target:
            # Routed and forwarded as normalised (paths.py): the backend has nothing left to
            # resolve that could take it out of the route's prefix.
            head = self.head = attrs.evolve(head, target=target)
        route = self.route = fx.config.route_for(head.target)
        if route is None:
            self.fail(404, "no route for this path")
            return
        group = self.group = fx.config.upstreams[route.upstream]
        self.router = self.host.router(group)
        self.body = RequestBody(group.next_upstream.replay_buffer)
        sticky = group.sticky
        if sticky.cookie is not None:
            value = cookie_value(head.headers, sticky.cookie.name)
            self.pinned = value or None
        key, need_body = session_key_from_head(sticky.sources, head.headers, head.target)
        if need_body and self.request is RequestPhase.BODY:
            self.phase = Phase.BUFFERING
            return
        self._route(key)

    def _buffered_enough(self) -> bool:
        assert self.group is not None
        limit = min(self.group.sticky.body_limit, self.fx.limits.high_water)
        return self.body.size >= limit

    def _route_by_body(self) -> None:
        assert self.group is not None
        head = self.head
        complete = self.request is RequestPhase.COMPLETE
        key = session_key_from_body(
            self.group.sticky.sources, head.headers, head.target, self.body.prefix(), complete
        )
        self._route(key)

    def _route(self, key: bytes | None) -> None:
        assert self.router is not None
        self.session_key = key
        self.candidates = self.router.candidates(key, self.pinned, self.fx.now)
        if not self.candidates:
            self.fail(503, "no backend available")
            return
        self.first_attempt_at = self.fx.now
        self._attempt()

    def _attempt(self) -> None:
        fx = self.fx
        assert self.group is not None and self.router is not None
        index = self.server = self.candidates[self.tries]
        self.tries += 1
        self.router.stream_started(index, self.session_key, fx.now)
        server = self.group.servers[index]
        self.server_address = server.address
        self.server_id = self.router.ids[index].decode("ascii")
        self.origin = Origin.of(server)
        self.phase = Phase.CONNECTING
        timeout = self.group.timeouts.connect or fx.config.timeouts.connect
        fx.set_timer((ExchangeTimer.CONNECT, self.ident), fx.now + timeout)
        self.host.pool.acquire(self.origin, self.group, self)

    def _leave_server(self) -> None:
        if self.server is not None and self.router is not None:
            self.router.stream_ended(self.server)
            self.server = None

    def _may_retry(self, condition: str) -> bool:
        group = self.group
        if group is None or condition not in group.next_upstream.on:
            return False
        policy = group.next_upstream
        if self.tries >= len(self.candidates) and self.router is not None:
            # Every candidate was tried; failures may have changed who is usable (the last
            # primary down brings in the backups), so ask again.
            fresh = self.router.candidates(self.session_key, self.pinned, self.fx.now)
            self.candidates.extend(i for i in fresh if i not in self.candidates)
        if self.tries >= min(policy.tries, len(self.candidates)):
            return False
        if self.fx.now - self.first_attempt_at >= policy.tries_timeout:
            return False
        if not self.body.rewind():
            self.fx.emit(
                Log(
                    event="retry_skipped",
                    fields={"reason": "request body larger than the replay buffer"},
                )
            )
            return False
        return True

    def _may_retry_stale(self) -> bool:
        """A reused keep-alive connection failed before any response byte: the backend most
        likely closed it while it sat in our pool (RFC 9112 §9.3.1). Retry once on a new
        connection to the same server, whatever ``next_upstream`` says, when the request may
        be sent twice: idempotent (RFC 9110 §9.2.2), carrying an Idempotency-Key, or not yet
        written at all."""
        upstream = self.upstream
        if self.phase is not Phase.WAITING_HEAD or self.stale_retried or upstream is None:
            return False
        head = self.head
        if not (
            head.method in IDEMPOTENT
            or header_value(head.headers, b"idempotency-key") is not None
            # An ``H2Stream`` a GOAWAY refused was never processed.
            or not upstream.written
        ):
            return False
        return self.body.rewind()

    def _retry_stale(self, reason: str) -> None:
        """Same server, fresh connection; the server's health and ``tries`` are untouched."""
        assert self.group is not None and self.origin is not None
        fx = self.fx
        self.stale_retried = True
        self._cancel_attempt_timers()
        self._release_upstream(close=True)
        self._count_retry("stale_connection", reason)
        self.phase = Phase.CONNECTING
        timeout = self.group.timeouts.connect or fx.config.timeouts.connect
        fx.set_timer((ExchangeTimer.CONNECT, self.ident), fx.now + timeout)
        self.host.pool.acquire(self.origin, self.group, self, fresh=True)

    def _retry_or_fail(self, condition: str, reason: str) -> None:
        """The current attempt failed before anything reached the client."""
        assert self.router is not None and self.server is not None
        fx = self.fx
        group = self.group
        assert group is not None
        self.host.measurements.failure(group.name, self.server_address, condition)
        if self.router.failed(self.server, fx.now):
            fx.emit(
                Log(
                    event="health",
                    fields={
                        "upstream": group.name,
                        "server": self.server_address,
                        "up": False,
                        "detail": f"passive: {reason}; out for"
                        f" {group.servers[self.server].fail_timeout:g}s",
                    },
                )
            )
        self._cancel_attempt_timers()
        self._release_upstream(close=True)
        if self._may_retry(condition):
            self._leave_server()
            self._count_retry(condition, reason)
            self._attempt()
            return
        if condition == "timeout":
            self.fail(504, "upstream timed out", reason)
        else:
            self.fail(502, "upstream unavailable", reason)

    def _count_retry(self, condition: str, reason: str) -> None:
        """Another attempt follows (``_attempt`` or ``_retry_stale``): log and count it."""
        fx = self.fx
        group = self.group.name if self.group is not None else ""
        if condition == "stale_connection":
            self.host.measurements.failure(group, self.server_address, condition)
        self.host.measurements.retry(group, condition)
        fx.emit(
            Log(
                event="retry",
                fields={
                    "request_id": self.request_id.decode("ascii"),
                    "group": group,
                    "server": self.server_address,
                    "upstream": str(self.origin),
                    "condition": condition,
                    "reason": reason,
                },
            )
        )

    # -- request direction -----------------------------------------------------------------

    def upstream_ready(self, upstream: UpstreamStream) -> None:
        """A backend connection is ours: send the head and whatever body was held."""
        if self.phase is not Phase.CONNECTING:
            upstream.exchange = None
            upstream.close()
            return
        fx = self.fx
        group = self.group
        assert group is not None
        fx.cancel_timer((ExchangeTimer.CONNECT, self.ident))
        self.upstream = upstream
        head = self.head
        # An HTTP/2 request body has no framing of its own (RFC 9113 §8.1); without a
        # Content-Length the HTTP/1.1 side frames it chunked (RFC 9112 §7.1).
        headers = upstream_h1_headers(
            head,
            client_ip=self.client.peer_ip,
            proto=self.client.scheme,
            via=VIA,
            has_body=not head.end_stream,
        )
        if group.set_headers:
            headers = self._apply_header_rules(headers)
        headers = with_request_id(headers, self.request_id)
        upstream.send_head(self.stream, head.method, head.target, headers)
        for chunk in self.body.take_unsent():
            upstream.send_body(chunk)
        if self.request is RequestPhase.COMPLETE:
            upstream.send_end(self.request_trailers)
        self.phase = Phase.WAITING_HEAD
        timeouts = group.timeouts
        now = fx.now
        fx.set_timer(
            (ExchangeTimer.HEAD, self.ident),
            now + (timeouts.response_head or fx.config.timeouts.response_head),
        )
        if timeouts.first_token:
            fx.set_timer((ExchangeTimer.FIRST_TOKEN, self.ident), now + timeouts.first_token)
        self._check_request_flow()

    def _apply_header_rules(self, headers: Headers) -> Headers:
        assert self.group is not None
        head = self.head
        for rule in self.group.set_headers:
            name = rule.name.lower().encode("latin-1")
            value = expand_header_rule(
                rule.value,
                session_key=self.session_key,
                remote_addr=self.client.peer_ip,
                headers=head.headers,
                target=head.target,
            )
            headers = [(n, v) for n, v in headers if n != name]
            if value is not None:
                headers.append((name, value))
        return headers

    def request_body(self, data: bytes, flow_len: int) -> None:
        if self.phase is Phase.DONE:
            self.client.acknowledge(self.stream, flow_len)
            return
        self.request_flow.hold(flow_len)
        self.last_request_activity = self.fx.now
        self.bytes_in += len(data)
        self.body.add(data)
        upstream = self.upstream
        if upstream is not None:
            for chunk in self.body.take_unsent():
                upstream.send_body(chunk)
        elif self.phase is Phase.BUFFERING and self._buffered_enough():
            self._route_by_body()
        self._check_request_flow()

    def request_end(self, trailers: Headers) -> None:
        if self.request is RequestPhase.COMPLETE:
            return  # a request without a body was complete with its head
        self.request = RequestPhase.COMPLETE
        self.request_done_at = self.fx.now
        if self.phase is Phase.DONE:
            return
        # RFC 9110 §6.5.1: only trailer fields either protocol can carry go on.
        trailers = self.request_trailers = trailer_fields(trailers) if trailers else trailers
        if self.upstream is not None:
            self.upstream.send_end(trailers)
        elif self.phase is Phase.BUFFERING:
            self._route_by_body()

    @property
    def request_size(self) -> int:
        """Request body bytes taken from the client so far."""
        return self.body.size

    def request_buffered(self) -> int:
        """Request bytes taken from the client and not yet written to the backend."""
        return self.body.unsent_size + (self.upstream.pending if self.upstream else 0)

    def _check_request_flow(self) -> None:
        if self.phase is Phase.DONE:
            return
        flow = self.request_flow
        buffered = self.request_buffered()
        limits = self.fx.limits
        if flow.filled(buffered, limits):
            self.client.pause_source()
        elif flow.drained(buffered, limits):
            # The client could not send while we withheld its window: its idle time starts
            # now (``watch_request_body``).
            self.last_request_activity = self.fx.now
            self.client.resume_source()
        credit = flow.release()
        if credit:
            self.client.acknowledge(self.stream, credit)

    def watch_request_body(self) -> None:
        """Slow request bodies (slowloris on HTTP/2, a stalled upload on HTTP/1.1, also one
        buffered for a session key): a request with a body must keep it moving. Lazy like the
        read timer: armed once here, moved only when it fires, so a body chunk costs no timer
        command. Tunnels override this (silence is theirs to keep)."""
        fx = self.fx
        fx.set_timer((ExchangeTimer.BODY, self.ident), fx.now + fx.config.timeouts.client_header)

    def _request_body_idle(self) -> None:
        """The ``body`` timer: reset the stream if the client sent no request body for
        ``timeouts.client_header`` seconds, unless the body is complete, the response has begun
        (the backend is answering), or we are the ones withholding the window."""
        if self.request is RequestPhase.COMPLETE or self.phase in (
            Phase.DONE,
            Phase.HOLDING,
            Phase.STREAMING,
        ):
            return
        fx = self.fx
        if self.request_flow.stopped:
            self.last_request_activity = fx.now  # backpressure: the client is not at fault
        due = self.last_request_activity + fx.config.timeouts.client_header
        if fx.now < due:
            fx.set_timer((ExchangeTimer.BODY, self.ident), due)
            return
        api = self.route.api if self.route is not None else None
        sent = self.client.refuse_slow_body(self.stream, api=api, request_id=self.request_id)
        if sent is not None:
            self.status = 408
            self.bytes_out += sent
        self.client_aborted("no request body within the client_header timeout")

    def upstream_drained(self) -> None:
        """The backend connection wrote some of its pending bytes."""
        flow = self.request_flow
        if flow.stopped or flow.withheld:
            self._check_request_flow()

    def client_aborted(self, reason: str) -> None:
        """The client reset the stream or went away: stop the backend at once."""
        if self.phase is Phase.DONE:
            return
        self._release_upstream(close=True)
        self._finish(f"client aborted: {reason}")

    # -- response direction ----------------------------------------------------------------

    def response_head(self, head: ResponseHead) -> None:
        if self.phase is not Phase.WAITING_HEAD:
            return
        fx = self.fx
        assert self.router is not None and self.server is not None and self.route is not None
        fx.cancel_timer((ExchangeTimer.HEAD, self.ident))
        status = head.status
        condition = f"http_{status}"
        if self._may_retry(condition):
            self._retry_or_fail(condition, f"backend answered {status}")
            return
        self.router.succeeded(self.server)
        self.status = status
        self.head_at = fx.now
        group = self.group
        assert group is not None
        self.host.measurements.group(group.name).response_head.observe(fx.now - self.started)
        version = self.upstream.http_version if self.upstream else b"1.1"
        self.upstream_version = version.decode("ascii")
        headers = response_headers(
            status,
            head.headers,
            via=VIA,
            upstream_version=version,
            to_h2=self.client.is_h2,
            date=fx.http_date(),
        )
        headers = with_request_id(headers, self.request_id)
        cookie = self.group.sticky.cookie if self.group else None
        if cookie is not None:
            server_id = self.router.ids[self.server]
            if self.pinned != server_id:
                headers.append(set_cookie_header(cookie, server_id))
        self.response = ResponseHead(stream=self.stream, status=status, headers=headers)
        self.last_upstream_activity = fx.now
        if (
            self.route.retry_until_first_event
            and 200 <= status < 300
            and is_event_stream(head.headers)
        ):
            self.phase = Phase.HOLDING
            # The head timer is gone and ``_commit`` has not armed the idle one yet: without
            # this a backend that sends the head and then nothing would hold the client
            # forever (unless a first-token timeout is configured).
            idle = self.group.timeouts.idle if self.group else None
            fx.set_timer(
                (ExchangeTimer.READ, self.ident), fx.now + (idle or fx.config.timeouts.read)
            )
            return
        self._commit()

    def _commit(self) -> None:
        """Send the response head: from here on nothing is retried."""
        assert self.response is not None
        fx = self.fx
        self.phase = Phase.STREAMING
        self.body.commit()
        self.client.send_head(self.response)
        idle = (self.group.timeouts.idle if self.group else None) or fx.config.timeouts.read
        fx.set_timer((ExchangeTimer.READ, self.ident), self.last_upstream_activity + idle)
        sse = (
            200 <= self.status < 300
            and self.head.method != b"HEAD"
            and is_event_stream(self.response.headers)
        )
        if sse and self.group is not None:
            self.meter = SseMeter(self.host.measurements.group(self.group.name), self.started)
        heartbeat = self.route.sse_heartbeat if self.route else None
        if (
            heartbeat
            and sse
            # A sized body cannot take extra bytes (RFC 9112 §6.3); SSE backends stream
            # without Content-Length anyway.
            and header_value(self.response.headers, b"content-length") is None
        ):
            # Lazy like the read timer: armed once here, moved only when it fires. The head
            # going out now counts as the last thing the client got.
            self.sse = EventBoundary()
            self.heartbeat_at = fx.now
            fx.set_timer((ExchangeTimer.HEARTBEAT, self.ident), fx.now + heartbeat)

    def response_body(self, data: bytes) -> None:
        phase = self.phase
        if phase is not Phase.STREAMING:
            if phase is not Phase.HOLDING:
                return
            self._commit()
        now = self.fx.now
        self.last_upstream_activity = now
        if self.first_byte_at is None:
            self.first_byte_at = now
            self.fx.cancel_timer((ExchangeTimer.FIRST_TOKEN, self.ident))
        self.bytes_out += len(data)
        meter = self.meter
        if meter is not None:
            meter.feed(data, now)
        if self.sse is not None:
            self.sse.feed(data)
        client = self.client
        client.send_body(self.stream, data)
        upstream = self.upstream
        if upstream is not None and self.response_flow.filled(
            client.buffered(self.stream), self.fx.limits
        ):
            upstream.pause()
            client.hold(self)

    def client_stalled(self) -> bool:
        """The client connection is behind (``ClientStream.client_stalled``): stop our backend."""
        upstream = self.upstream
        if upstream is not None and self.response_flow.stop():
            upstream.pause()
            return True
        return False

    def client_drained(self) -> None:
        """The client side wrote some of this stream's bytes; maybe read the backend again."""
        upstream = self.upstream
        client = self.client
        if (
            upstream is not None
            and self.response_flow.stopped
            # The connection's gate first: ``drained`` resumes the flow when it says yes.
            and not client.congested
            and self.response_flow.drained(client.buffered(self.stream), self.fx.limits)
        ):
            upstream.resume()
            client.release(self)

    def response_end(self, trailers: Headers) -> None:
        if self.phase is Phase.HOLDING:
            self._commit()
        if self.phase is not Phase.STREAMING:
            return
        # RFC 9110 §6.5.1: only trailer fields either protocol can carry go on.
        self.client.send_end(self.stream, trailer_fields(trailers) if trailers else trailers)
        self._release_upstream(close=False)
        self._finish("ok")

    def upstream_failed(self, reason: str, *, timeout: bool = False, stale: bool = False) -> None:
        """The backend connection broke, could not be opened, or timed out."""
        if stale and self._may_retry_stale():
            self._retry_stale(reason)
            return
        if self.phase in UNCOMMITTED:
            self._retry_or_fail("timeout" if timeout else "error", reason)
        elif self.phase is Phase.STREAMING:
            if self.group is not None:
                self.host.measurements.failure(self.group.name, self.server_address, "mid_stream")
            self._release_upstream(close=True)
            # Truncation must be visible: never a clean end for a broken stream. (On HTTP/1.1
            # that is the close, which comes once this exchange is over: ``request_close``.)
            self.client.abort(self.stream)
            self._finish(f"upstream failed mid-stream: {reason}")

    def timer_fired(self, kind: ExchangeTimer) -> None:
        fx = self.fx
        timeouts = self.group.timeouts if self.group else None
        match kind:
            case ExchangeTimer.READ:
                self._read_timeout()
            case ExchangeTimer.CONNECT:
                self.upstream_failed("connect timeout", timeout=True)
            case ExchangeTimer.HEAD:
                head = (timeouts.response_head if timeouts else None) or (
                    fx.config.timeouts.response_head
                )
                if self._backend_late(kind, head):
                    self.upstream_failed("response head timeout", timeout=True)
            case ExchangeTimer.FIRST_TOKEN:
                first_token = timeouts.first_token if timeouts else None
                if not first_token or self._backend_late(kind, first_token):
                    reason = "no first token within the first-token timeout"
                    self.upstream_failed(reason, timeout=True)
            case ExchangeTimer.HEARTBEAT:
                self._heartbeat()
            case ExchangeTimer.DEADLINE:
                self._deadline_exceeded()
            case ExchangeTimer.BODY:
                self._request_body_idle()
            case ExchangeTimer.TUNNEL:
                pass  # a tunnel's (``websocket.py``)
            case _:
                assert_never(kind)

    def _read_timeout(self) -> None:
        fx = self.fx
        # HOLDING too: the idle deadline bounds a held head (see ``response_head``).
        if self.phase is not Phase.STREAMING and self.phase is not Phase.HOLDING:
            return
        idle = (self.group.timeouts.idle if self.group else None) or fx.config.timeouts.read
        if self.client.holds(self):
            # We paused the backend because the client is behind: its silence is ours.
            # The client side has its own bound (``Downstream``'s send and window timers).
            self.last_upstream_activity = fx.now
        due = self.last_upstream_activity + idle
        if fx.now < due:
            # Lazy timer: the deadline moves with every chunk, but we re-arm only here,
            # so relaying a chunk costs no timer command.
            fx.set_timer((ExchangeTimer.READ, self.ident), due)
            return
        self.upstream_failed("no data from upstream within the read timeout", timeout=True)

    def _backend_late(self, kind: ExchangeTimer, timeout: float) -> bool:
        """Whether the ``head`` or ``first_token`` timer that fired blames the backend. Not
        while the client still owes request body bytes the backend is taking: a backend may
        wait for the whole request before it answers, and a client that stopped sending is
        the ``body`` timer's to judge (RFC 9110 §15.5.9: 408, not a 504). Then the clock
        runs from the end of the request; the timer is re-armed, so a body chunk costs none."""
        fx = self.fx
        if self.request is RequestPhase.BODY and not self.request_flow.stopped:
            fx.set_timer((kind, self.ident), fx.now + timeout)
            return False
        due = self.request_done_at + timeout
        if fx.now < due:
            fx.set_timer((kind, self.ident), due)
            return False
        return True

    def _deadline_exceeded(self) -> None:
        """The gRPC call's ``grpc-timeout`` passed: DEADLINE_EXCEEDED in any phase."""
        if self.phase is Phase.DONE:
            return
        self._cancel_attempt_timers()
        if self.phase is Phase.STREAMING:
            self._release_upstream(close=True)
            self.phase = Phase.DONE
            fields = status_fields(grpc.DEADLINE_EXCEEDED, "deadline exceeded (grpc-timeout)")
            self.client.send_end(self.stream, fields)
            self._finish("grpc-timeout exceeded")
            return
        self._release_upstream(close=True)
        self.fail(504, "deadline exceeded (grpc-timeout)")

    def _heartbeat(self) -> None:
        """An SSE comment after ``sse_heartbeat`` seconds without upstream bytes, so idle
        timeouts along the way (load balancers, proxies) keep a thinking model's stream."""
        sse = self.sse
        if self.phase is not Phase.STREAMING or sse is None or self.route is None:
            return
        interval = self.route.sse_heartbeat
        assert interval is not None
        fx = self.fx
        now = fx.now
        due = max(self.last_upstream_activity, self.heartbeat_at) + interval
        if now >= due:
            # Only between events (a comment inside one would end it early), and only when
            # the client took everything: unsent bytes keep nothing alive.
            if sse.at_boundary and not self.client.buffered(self.stream):
                self.client.send_body(self.stream, HEARTBEAT)
                self.heartbeat_at = now
            due = now + interval
        fx.set_timer((ExchangeTimer.HEARTBEAT, self.ident), due)

    # -- endings ---------------------------------------------------------------------------

    def fail(self, status: int, text: str, reason: str = "") -> None:
        """Answer with a short response of our own (only while no response head went out):
        plain text, or the OpenAI error object on an ``api = "openai"`` route (errors.py)."""
        self.status = status
        if is_grpc(self.head.headers):
            # A gRPC client gets a gRPC answer (grpc.py): 200 and a Trailers-Only response.
            self.status = 200
            fields = trailers_only(grpc.status_for_http(status), text)
            date = self.fx.http_date()
            if date is not None:
                fields.append((b"date", date))
            fields.append((b"x-request-id", self.request_id))
            head = ResponseHead(stream=self.stream, status=200, headers=fields)
            self.client.send_head(head, end_stream=True)
        else:
            api = self.route.api if self.route is not None else None
            self.bytes_out += self.client.send_error(
                self.stream,
                status,
                text,
                api=api,
                head_only=self.head.method == b"HEAD",
                request_id=self.request_id,
            )
        self._finish(reason or text)

    def _cancel_attempt_timers(self) -> None:
        for kind in ATTEMPT_TIMERS:
            self.fx.cancel_timer((kind, self.ident))

    def _release_upstream(self, *, close: bool) -> None:
        upstream = self.upstream
        self.upstream = None
        if upstream is not None:
            upstream.exchange = None
            # Whoever stopped it, its reading is not ours to resume any more (released to the
            # pool it is resumed there); a next attempt's backend starts running.
            self.response_flow.resume()
            self.client.release(self)
            if close or self.request is not RequestPhase.COMPLETE:
                upstream.close()
            else:
                upstream.release()
        elif self.origin is not None and self.phase is Phase.CONNECTING:
            self.host.pool.forget(self)

    def _finish(self, outcome: str) -> None:
        fx = self.fx
        self.phase = Phase.DONE
        self.outcome = outcome
        self._cancel_attempt_timers()
        fx.cancel_timer((ExchangeTimer.DEADLINE, self.ident))
        fx.cancel_timer((ExchangeTimer.BODY, self.ident))
        self._leave_server()
        flow = self.request_flow
        credit = flow.take()
        if credit:
            self.client.acknowledge(self.stream, credit)
        if flow.resume():
            self.client.resume_source()
        self.host.exchange_finished(self)
        self.client.exchange_finished(self)
        self._measure()
        fx.emit(Log(event="access", fields=access_fields(self, outcome)))

    def _measure(self) -> None:
        """Add what this exchange measured to the totals (``measure.py``)."""
        fx = self.fx
        measurements = self.host.measurements
        group = self.group.name if self.group is not None else ""
        version = self.head.http_version.decode("latin-1")
        measurements.request(group, self.server_address, self.status, version)
        stats = measurements.group(group)
        stats.bytes_sent += self.bytes_out
        stats.bytes_received += self.bytes_in
        meter = self.meter
        if meter is not None:
            stats.sse_events += meter.events
            stats.inter_token.sum += meter.gap_sum
            if meter.first_token_at is None:
                stats.streams_without_token += 1
            stats.stream_duration.observe(fx.now - self.started)
