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
- The credentials must be the original's (``resumebind.binding_of``); a stream that is not
  here, not with these credentials, forgotten, moved past, or never had that event is
  refused at once and never answered with a new generation: a client that accepts
  ``text/event-stream`` gets one ``event: error`` whose data is an OpenAI-style error object
  (``{"error": {"message", "type": "resume_error", "code"}}``, code ``resume_unknown``,
  ``resume_evicted`` or ``resume_invalid``); any other client gets 410 Gone (RFC 9110
  §15.5.11: the stream is gone here, and no longer resumable).
- While the owner's backend runs, the owner writes to this exchange's client (``readers.py``);
  this exchange only passes the client's flow events on to it, and ends when it ends. A
  client that goes away again leaves the stream lingering, as its first client did.
- A token this process does not hold, on a route with ``resume.store``, is asked of the
  shared store (``ResumeFetch``; the driver reads Redis and feeds ``ResumeFetched``): the
  head comes with the first batch, the events after it, and the state ends the response
  (``ended``: the end; ``broken``: the visible truncation) or refuses it (``unknown``,
  ``evicted``, ``invalid``, and ``unavailable`` when the store cannot be reached, answered
  as the others: ``resume_unavailable``, or 503 for a client that takes no SSE). One batch
  at a time: the next is asked for (``ResumeFetchMore``) only once the client's buffer is
  under its high water, so a slow client holds the store's reads back, not our memory.
"""

from __future__ import annotations

import json

from muxproxy.config import Resume, Upstream
from muxproxy.core.commands import ResumeFetch, ResumeFetchCancel, ResumeFetchMore
from muxproxy.core.events import ResumedHead, ResumeFetched
from muxproxy.core.exchange import placement
from muxproxy.core.exchange.exchange import Exchange
from muxproxy.core.exchange.exchange_states import ExchangeInput
from muxproxy.core.exchange.heads import client_head
from muxproxy.core.http.headers import header_value
from muxproxy.core.messages import Headers, ResponseHead
from muxproxy.core.ports import Phase
from muxproxy.core.streams.resume import Lookup, Resumable, State, parse_event_id
from muxproxy.core.streams.resumebind import binding_of

_I = ExchangeInput

LAST_EVENT_ID = b"last-event-id"

_REASONS = {
    Lookup.UNKNOWN: "no resumable stream with this id (unknown, expired, or other credentials)",
    Lookup.EVICTED: "the events after this id are no longer kept (the resume window moved on)",
    Lookup.INVALID: "this stream never sent an event with this id",
    Lookup.UNAVAILABLE: "the resume store cannot be reached now",
    Lookup.LOST: "the process that held this stream stopped before its end; nothing follows",
    Lookup.CORRUPT: "the resume store returned a record that is not valid",
}
_STATUS = {Lookup.UNAVAILABLE: 503, Lookup.CORRUPT: 502}
"""A refusal's status for a client that takes no SSE; 410 for the others."""
_LOOKUPS = {member.value: member for member in Lookup}


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
    fetching = False
    """A ``ResumeFetch`` of ours runs in the driver (its last batch not in yet)."""
    fetched_head = False
    """The first batch of the fetch came (the head went out)."""
    wants_more = False
    """The fetch waits for our ``ResumeFetchMore``, which goes once the client drained."""

    def start(self) -> None:
        # Not a resume of ours: the backend's own resume, if any. A route chosen by the body's
        # model is known later (``routed_by_model``).
        if placement.locate(self) and not self._resumes():
            placement.begin(self)

    def routed_by_model(self) -> bool:
        return self._resumes()

    def _resumes(self) -> bool:
        """Answer from a stream kept here (or ask the shared store) if this request resumes
        one on its route; False: an ordinary request."""
        route, group, head = self.route, self.group, self.head
        assert route is not None and group is not None
        event_id = parse_event_id(header_value(head.headers, LAST_EVENT_ID))
        if route.resume is None or event_id is None:
            return False
        self._resume(route.resume, group, event_id)
        return True

    def _resume(self, settings: Resume, group: Upstream, event_id: tuple[bytes, int]) -> None:
        head = self.head
        token, seq = event_id
        store = self.host.resumes
        credential = binding_of(settings, group, head)
        stream = store.find(token, credential)
        if stream is None and settings.store is not None:
            # Not held here: maybe by another worker or replica, through the shared store.
            self.fetching = True
            self.fx.emit(
                ResumeFetch(
                    store=settings.store,
                    request=self.ident,
                    token=token,
                    after=seq,
                    credential=credential,
                )
            )
            return
        events = Lookup.UNKNOWN if stream is None else stream.after(seq)
        if isinstance(events, Lookup):
            store.refuse(events)
            self._refuse(events)
            return
        assert stream is not None
        store.resumed += 1
        if stream.state is State.ENDED and seq == stream.last_seq:
            self._nothing_left()
            return
        self._send_head(stream.head, stream.version)
        if self._head_only():
            return
        client = self.client
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
            self._finish("resumed a stream whose backend failed", cut=True)

    def _send_head(self, head: ResponseHead, version: str) -> None:
        """The original response head, made for this client's protocol."""
        self.move(_I.REPLAY)
        client = self.client
        self.status = head.status
        self.upstream_version = version
        self.response = client_head(
            head,
            stream=self.stream,
            upstream_version=version.encode("ascii"),
            to_h2=client.is_h2,
            date=self.fx.http_date(),
            request_id=self.request_id,
            pin=None,
        )
        client.send_head(self.response)
        self.head_at = self.first_byte_at = self.fx.now

    def _head_only(self) -> bool:
        """A HEAD (RFC 9110 §9.3.2) is answered with the head alone, at once: it neither
        replays events nor waits on a live stream (nor holds up a request pipelined behind
        it). True when it was, and the exchange is over."""
        if self.head.method != b"HEAD":
            return False
        self.client.send_end(self.stream, [])
        self._finish("ok (resumed, head only)")
        return True

    def _nothing_left(self) -> None:
        """The stream ended and the client had every event: 204, which tells an
        ``EventSource`` to stop reconnecting (WHATWG HTML §9.2.3), where an empty 200 made it
        reconnect every few seconds, forever."""
        self.move(_I.REPLAY)
        headers: Headers = [(b"x-request-id", self.request_id)]
        date = self.fx.http_date()
        if date is not None:
            headers.insert(0, (b"date", date))
        self.status = 204
        self.client.send_head(ResponseHead(stream=self.stream, status=204, headers=headers))
        self.client.send_end(self.stream, [])
        self._finish("ok (resumed: the stream had ended, nothing left)")

    def _takes_sse(self) -> bool:
        accept = header_value(self.head.headers, b"accept") or b""
        return b"text/event-stream" in accept.lower()

    def _refuse(self, why: Lookup) -> None:
        if why is Lookup.CORRUPT or not self._takes_sse():
            # A record that failed its checks is the store's fault: a clean 502 for every
            # client (RFC 9110 §15.6.3), which also stops an EventSource.
            self.fail(_STATUS.get(why, 410), _REASONS[why], f"resume refused: {why.value}")
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

    # -- a stream of another process, from the shared store -------------------------------

    def fetched(self, event: ResumeFetched) -> None:
        """A batch of our ``ResumeFetch`` (``events.ResumeFetched``)."""
        state = event.state
        if state != "live":
            self.fetching = False
        if self.phase is Phase.DONE:
            return  # the cancel went when it ended
        if not self.fetched_head:
            if event.head is None:
                why = _LOOKUPS.get(state, Lookup.UNAVAILABLE)
                self.fetching = False  # a refusal is the fetch's last batch
                self.host.resumes.refuse(why)
                self._refuse(why)
                return
            self.fetched_head = True
            self.host.resumes.resumed += 1
            if state == "ended" and not event.events:
                self._nothing_left()
                return
            self._send_head(_head_of(event.head, self.stream), event.head.version)
            if self._head_only():
                return  # ``_wrap_up`` cancels the fetch
        client = self.client
        for data in event.events:
            self.bytes_out += len(data)
            client.send_body(self.stream, data)
        if state == "live":
            flow = self.response_flow
            if flow.stopped or flow.filled(client.buffered(self.stream), self.fx.limits):
                self.wants_more = True
                client.hold(self)
            else:
                self.fx.emit(ResumeFetchMore(request=self.ident))
        elif state == "ended":
            client.send_end(self.stream, [])
            self._finish("ok (resumed)")
        elif state == "lost" and self._takes_sse():
            # Its owner died: what the store held went out; the documented resume error
            # tells the client that nothing follows (a reconnect would get no more).
            self.host.resumes.refuse(Lookup.LOST)
            body = error_event(Lookup.LOST)
            self.bytes_out += len(body)
            client.send_body(self.stream, body)
            client.send_end(self.stream, [])
            self._finish("resumed from the store: owner lost")
        else:
            # ``broken``, or the store lost the stream or could not be read meanwhile: what
            # went out ends unfinished, visibly.
            client.abort(self.stream)
            self._finish(f"resumed from the store: {state}", cut=True)

    def _wrap_up(self, outcome: str, *, cut: bool = False) -> None:
        if self.fetching:
            self.fetching = False
            self.fx.emit(ResumeFetchCancel(request=self.ident))
        super()._wrap_up(outcome, cut=cut)

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
            self._finish("resume taken over by a newer connection", cut=True)

    # -- the client side, while resuming ---------------------------------------------------

    @property
    def _resuming(self) -> bool:
        """Answering from kept events, or asking the store for them once the body's model
        chose the route (BUFFERING): the request's body goes to no backend."""
        if self.phase is Phase.STREAMING:
            return self.failover is None
        return self.fetching and self.phase is Phase.BUFFERING

    def request_body(self, data: bytes, flow_len: int) -> None:
        if not self._resuming:
            super().request_body(data, flow_len)
            return
        self.bytes_in += len(data)  # a re-sent request's body: read and dropped
        self.upload.give_back(flow_len)

    def request_end(self, trailers: Headers) -> None:
        if not self._resuming:
            super().request_end(trailers)
            return
        self.upload.end(trailers, None)

    def client_aborted(self, reason: str) -> None:
        stream = self.reading
        if stream is None:
            super().client_aborted(reason)
            return
        if self.move(_I.CLIENT_ABORTED):
            # ``let_go`` leaves the stream lingering
            self._finish(f"client aborted: {reason}", cut=True)

    def client_stalled(self) -> bool:
        if self.fetched_head:
            return self.phase is Phase.STREAMING and self.response_flow.stop()
        stream = self.reading
        if stream is None:
            return super().client_stalled()
        owner = stream.owner
        return isinstance(owner, Exchange) and owner.client_stalled()

    def client_drained(self) -> None:
        if self.fetched_head:
            client = self.client
            if (
                self.wants_more
                and self.phase is Phase.STREAMING
                and not client.congested
                and self.response_flow.drained(client.buffered(self.stream), self.fx.limits)
            ):
                self.wants_more = False
                client.release(self)
                self.fx.emit(ResumeFetchMore(request=self.ident))
            return
        stream = self.reading
        if stream is None:
            super().client_drained()
            return
        owner = stream.owner
        if isinstance(owner, Exchange):
            owner.client_drained()


def _head_of(head: ResumedHead, stream: int) -> ResponseHead:
    return ResponseHead(stream=stream, status=head.status, headers=list(head.headers))
