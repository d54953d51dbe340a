"""A resume: a request with ``Last-Event-ID`` answered from a stream's kept events.

What it obeys:

- WHATWG HTML §9.2.4: a reconnecting ``EventSource`` re-sends its request with the last
  event id it saw as ``Last-Event-ID``; a client of its own may re-send the same ``POST``.
  On a route with ``resume``, an id the proxy wrote (``resume.parse_event_id``) is answered
  here, with no new generation: the events after it (``Resumable.after``), then the live
  tail, as one SSE response, whose head is the original's (RFC 9110 §15.3.1, 200), made for
  this client's protocol (the reconnect may use the other one). The request body of a
  re-sent ``POST`` is read and dropped. An id that is not the proxy's goes to the backend,
  whose resume it is.
- The credentials must be the original's (``resume.credential_of``); a stream that is not
  here, not with these credentials, forgotten, moved past, or never had that event is
  refused at once and never answered with a new generation: a client that accepts
  ``text/event-stream`` gets one ``event: error`` whose data is an OpenAI-style error object
  (``{"error": {"message", "type": "resume_error", "code"}}``, code ``resume_unknown``,
  ``resume_evicted`` or ``resume_invalid``); any other client gets 410 Gone (RFC 9110
  §15.5.11: the stream is gone here, and no longer resumable).
- While the owner's backend runs, the owner writes to this exchange's client (``readers.py``);
  this exchange only passes the client's flow events on to it, and ends when it ends. A
  client that goes away again leaves the stream lingering, as its first client did.
"""

from __future__ import annotations

import json

from ..routing.sticky import session_key_from_head
from .exchange import Exchange
from .exchange_states import ExchangeInput
from .headers import header_value
from .heads import client_head
from .messages import Headers, ResponseHead
from .ports import Phase
from .resume import Lookup, Resumable, State, credential_of, parse_event_id

_I = ExchangeInput

LAST_EVENT_ID = b"last-event-id"

_REASONS = {
    Lookup.UNKNOWN: "no resumable stream with this id (unknown, expired, or other credentials)",
    Lookup.EVICTED: "the events after this id are no longer kept (the resume window moved on)",
    Lookup.INVALID: "this stream never sent an event with this id",
}


def error_event(why: Lookup) -> bytes:
    """The SSE event of a refused resume."""
    error = {"message": _REASONS[why], "type": "resume_error", "code": f"resume_{why.value}"}
    return b"event: error\ndata: %s\n\n" % json.dumps({"error": error}).encode()


def wants_resume(headers: Headers) -> bool:
    """Whether a request may be a resume (it carries ``Last-Event-ID``): cheap, for every
    request."""
    return any(name == LAST_EVENT_ID for name, _ in headers)


class ReplayExchange(Exchange):
    """An exchange for a request with ``Last-Event-ID``; an ordinary one unless it resumes."""

    reading: Resumable | None = None
    """The stream this exchange resumed, while it does."""

    def start(self) -> None:
        if not self._locate():
            return
        route, group, head = self.route, self.group, self.head
        assert route is not None and group is not None
        event_id = parse_event_id(header_value(head.headers, LAST_EVENT_ID))
        if route.resume is None or event_id is None:
            self._begin()  # the backend's own resume, if any
            return
        token, seq = event_id
        store = self.host.resumes
        session_key, _ = session_key_from_head(group.sticky.sources, head.headers, head.target)
        stream = store.find(token, credential_of(head.headers, session_key))
        events = Lookup.UNKNOWN if stream is None else stream.after(seq)
        if isinstance(events, Lookup):
            store.refuse(events)
            self._refuse(events)
            return
        assert stream is not None
        store.resumed += 1
        self.move(_I.REPLAY)
        client = self.client
        self.status = stream.head.status
        self.upstream_version = stream.version
        self.response = client_head(
            stream.head,
            stream=self.stream,
            upstream_version=stream.version.encode("ascii"),
            to_h2=client.is_h2,
            date=self.fx.http_date(),
            request_id=self.request_id,
            pin=None,
        )
        client.send_head(self.response)
        self.head_at = self.first_byte_at = self.fx.now
        for event in events:
            self.bytes_out += len(event)
            client.send_body(self.stream, event)
        owner = stream.owner
        if stream.state is State.LIVE and owner is not None:
            self.reading = stream
            owner.take_reader(self)
        elif stream.state is State.ENDED:
            client.send_end(self.stream, [])
            self._finish("ok (resumed)")
        else:
            client.abort(self.stream)  # what is kept ends unfinished, as the backend did
            self._finish("resumed a stream whose backend failed")

    def _refuse(self, why: Lookup) -> None:
        accept = header_value(self.head.headers, b"accept") or b""
        if b"text/event-stream" not in accept.lower():
            self.fail(410, _REASONS[why], f"resume refused: {why.value}")
            return
        self.move(_I.REPLAY)
        headers: Headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
        ]
        if not self.client.is_h2:
            headers.append((b"transfer-encoding", b"chunked"))
        date = self.fx.http_date()
        if date is not None:
            headers.append((b"date", date))
        headers.append((b"x-request-id", self.request_id))
        self.status = 200
        self.client.send_head(ResponseHead(stream=self.stream, status=200, headers=headers))
        body = error_event(why)
        self.bytes_out += len(body)
        self.client.send_body(self.stream, body)
        self.client.send_end(self.stream, [])
        self._finish(f"resume refused: {why.value}")

    def let_go(self) -> None:
        """Ending (or dropped by fault isolation): the stream it read lingers again."""
        super().let_go()
        stream, self.reading = self.reading, None
        if stream is not None and stream.reader is self and isinstance(stream.owner, Exchange):
            stream.owner.reader_left()

    # -- what the owner hands on -----------------------------------------------------------

    def owner_finished(self) -> None:
        """The owner's backend stream ended (its end or abort went to our client)."""
        self.reading = None
        if self.phase is not Phase.DONE:
            self._finish("ok (resumed)")

    def taken_over(self) -> None:
        """``resume.Reader``: a newer connection resumed the stream."""
        self.reading = None
        if self.phase is not Phase.DONE:
            self.client.abort(self.stream)
            self._finish("resume taken over by a newer connection")

    # -- the client side, while resuming ---------------------------------------------------

    def request_body(self, data: bytes, flow_len: int) -> None:
        if self.phase is not Phase.STREAMING or self.failover is not None:
            super().request_body(data, flow_len)
            return
        self.bytes_in += len(data)  # a re-sent request's body: read and dropped
        self.client.acknowledge(self.stream, flow_len)

    def request_end(self, trailers: Headers) -> None:
        if self.phase is not Phase.STREAMING or self.failover is not None:
            super().request_end(trailers)
            return
        self.upload.end(trailers, None)

    def client_aborted(self, reason: str) -> None:
        stream = self.reading
        if stream is None:
            super().client_aborted(reason)
            return
        if self.move(_I.CLIENT_ABORTED):
            self._finish(f"client aborted: {reason}")  # ``let_go`` leaves the stream lingering

    def client_stalled(self) -> bool:
        stream = self.reading
        if stream is None:
            return super().client_stalled()
        owner = stream.owner
        return isinstance(owner, Exchange) and owner.client_stalled()

    def client_drained(self) -> None:
        stream = self.reading
        if stream is None:
            super().client_drained()
            return
        owner = stream.owner
        if isinstance(owner, Exchange):
            owner.client_drained()
