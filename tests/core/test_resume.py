"""Resumable SSE streams (``route.resume``) in the sans-IO core, as whole conversations.

The clock is the playbook's: ``pb.now`` moves only when a test moves it, so the linger
expiry is exact and needs no sleep. Each conversation asserts every command in order,
timers included: a client that goes away leaves its backend running for ``linger``
seconds (the linger timer), a reconnect with ``Last-Event-ID`` gets the events after it and
then the live tail, and what cannot be resumed is answered at once, never forwarded.
"""

from __future__ import annotations

import json
import re
import tracemalloc
from collections.abc import Sequence
from typing import Any

import attrs
import h2.events
import h11
from checks import Check, both, h1_body, h1_request, h1_response, h2_body, h2_ended
from playbook import (
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    closed,
    data,
    default_config,
    opened,
    sent,
    wakeup,
)

from muxproxy.config import Config, Resume, Route
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    OpenConnection,
    Origin,
    SetTimer,
)
from muxproxy.core.effects import Effects
from muxproxy.core.events import ShutdownRequested
from muxproxy.core.messages import ResponseHead
from muxproxy.core.streams.resume import Resumable, ResumeStore, State
from muxproxy.core.streams.sseids import EventStamper

SSE = [("Accept", "text/event-stream")]
ID = re.compile(rb"id: ([A-Za-z0-9_-]{22})\.([0-9]+)")
CHAT = "/v1/chat/completions"
ORIGIN = Origin(host="127.0.0.1", port=9001)


def resume_config(**resume: object) -> Config:
    config = default_config()
    route = Route(prefix="/", upstream="default", resume=Resume(**resume))  # type: ignore[arg-type]
    return attrs.evolve(config, routes=(route,))


class Stream:
    """One client's chat stream through the proxy (client connection 1, exchange 1) to an
    HTTP/1.1 backend peer on connection -1, up to the SSE head relayed to the client.

    ``relayed`` templates say ``{T}`` for the stream's token, which the first stamped event
    tells (``token``)."""

    def __init__(self, pb: Playbook, headers: Sequence[tuple[str, str]] = ()) -> None:
        self.pb = pb
        self.client = H1ClientPeer()
        self.backend = H1BackendPeer()
        self.token: bytes | None = None
        self.seq = 0
        pb.accept(1)
        pb >> data(1, self.client.request("POST", CHAT, [*headers], b"{}"))
        pb << CancelTimer(timer=("header", 1))
        pb << SetTimer(timer=("connect", 1), at=5.0)
        pb << OpenConnection(conn=-1, origin=ORIGIN)
        pb << SetTimer(timer=("body", 1), at=30.0)
        pb >> opened(-1)
        pb << CancelTimer(timer=("connect", 1))
        pb << (request := Sends(-1, self.backend, h1_request(b"POST", CHAT.encode(), b"{}")))
        pb << SetTimer(timer=("head", 1), at=60.0)
        pb >> sent(-1, len(request.data))
        pb >> data(-1, self.backend.sse_head())
        pb << CancelTimer(timer=("head", 1))
        self.head_arrived()
        pb << SetTimer(timer=("send", 1), at=60.0)
        pb << (head := Sends(1, self.client, h1_response(200)))
        pb << SetTimer(timer=("read", 1), at=300.0)
        pb >> sent(1, len(head.data))

    def head_arrived(self) -> None:
        """What the proxy does with the backend's head before relaying it: nothing here."""

    def body(self, template: bytes) -> Check:
        """The body is ``template`` with the stream's token for ``{T}``."""

        def check(events: Sequence[Any]) -> None:
            got = h1_body(events)
            if self.token is None and b"{T}" in template:
                found = ID.search(got)
                assert found, got
                self.token = found.group(1)
            assert got == self.ids(template), got

        return check

    def ids(self, template: bytes) -> bytes:
        return template.replace(b"{T}", self.token or b"?")

    def id(self, seq: int) -> bytes:
        assert self.token is not None
        return self.token + b".%d" % seq

    def send(self, chunk: bytes, relayed: bytes | None = None) -> None:
        """The backend sends ``chunk``; ``relayed``: what client 1 gets of it (and writes)."""
        self.pb >> data(-1, self.backend.chunk(chunk))
        if relayed is not None:
            self.pb << (reply := Sends(1, self.client, self.body(relayed)))
            self.pb >> sent(1, len(reply.data))


def lingers(pb: Playbook, conn: int = 1, *, until: float = 30.0) -> None:
    """Client ``conn`` goes away: the backend is not cut, the stream lingers ``until``."""
    pb >> closed(conn)
    pb << SetTimer(timer=("linger", 1), at=until)
    pb << CancelTimer(timer=("send", conn))
    pb.done()


def resume(
    pb: Playbook,
    conn: int,
    event_id: bytes,
    check: Check,
    headers: Sequence[tuple[str, str]] = SSE,
) -> Sends:
    """A new HTTP/1.1 client on ``conn`` asks for the events after ``event_id``; the answer
    comes at once (``check``). Returns the ``Sends`` (the client is its ``peer``)."""
    client = H1ClientPeer()
    pb.accept(conn)
    pb >> data(conn, client.request("GET", CHAT, [*headers, ("Last-Event-ID", event_id.decode())]))
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("send", conn), at=pb.now + 60.0)
    pb << (answer := Sends(conn, client, check))
    return answer


def refused(code: str) -> Check:
    """An SSE error event naming ``code`` (a ``resume_error``), in a 200 the client's
    EventSource reads."""

    def check(events: Sequence[Any]) -> None:
        body = h1_body(events)
        assert body.startswith(b"event: error\ndata: "), body
        error = json.loads(body.split(b"data: ", 1)[1])["error"]
        assert error["code"] == code and error["type"] == "resume_error", error

    return both(h1_response(200), check)


def h2_resume(
    pb: Playbook,
    conn: int,
    event_id: bytes,
    check: Check,
) -> H2ClientPeer:
    """A new HTTP/2 client on ``conn`` asks for the events after ``event_id``; ``check``
    gets what came back at once (on stream 1)."""
    client = H2ClientPeer()
    pb.accept(conn)
    pb >> data(conn, client.preface())
    pb << SetTimer(timer=("send", conn), at=pb.now + 60.0)
    pb << Sends(conn, client)
    headers = [(b"accept", b"text/event-stream"), (b"last-event-id", event_id)]
    _sid, request = client.request(b"GET", CHAT.encode(), headers=headers)
    pb >> data(conn, request)
    pb << CancelTimer(timer=("header", conn))
    pb << Sends(conn, client, check)
    return client


def idle(pb: Playbook, conn: int) -> None:
    pb << SetTimer(timer=("idle", conn), at=pb.now + 75.0)
    pb.done()


def test_events_get_ids_and_a_reconnect_gets_the_rest_then_the_live_tail() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\n", b"data: a\nid: {T}.1\n\n")
    # A partial event is held until it completes.
    first.send(b"data: b\n\ndata: c", b"data: b\nid: {T}.2\n\n")

    # The client goes away: the backend is not cut, and its events are kept.
    lingers(pb)
    pb >> data(-1, first.backend.chunk(b"\n\ndata: d\n\n"))
    pb.done()

    # A reconnect with the id of "a" gets "b", "c" and "d", then what comes next, then the end.
    replayed = b"data: b\nid: {T}.2\n\ndata: c\nid: {T}.3\n\ndata: d\nid: {T}.4\n\n"
    answer = resume(pb, 2, first.id(1), both(h1_response(200), first.body(replayed)))
    pb << CancelTimer(timer=("linger", 1))
    client = answer.peer
    pb >> sent(2, len(answer.data))
    pb >> data(-1, first.backend.chunk(b"data: [DONE]\n\n"))
    pb << (live := Sends(2, client, first.body(b"data: [DONE]\nid: {T}.5\n\n")))
    pb >> sent(2, len(live.data))
    pb >> data(-1, first.backend.end())
    pb << Sends(2, client, lambda events: [type(e) for e in events] == [h11.EndOfMessage])
    pb << SetTimer(timer=("pool", -1), at=60.0)  # a complete response: the connection goes back
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    idle(pb, 2)
    assert pb.core.resumes.resumed == 1


def test_a_client_that_never_returns_costs_at_most_linger() -> None:
    pb = Playbook(resume_config(linger=10))
    first = Stream(pb)
    first.send(b"data: a\n\n", b"data: a\nid: {T}.1\n\n")
    lingers(pb, until=10.0)
    pb.now = 10.0
    pb >> wakeup("linger", 1)
    pb << CloseConnection(conn=-1)  # the GPU stops
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("linger", 1), at=20.0)
    pb.done()
    assert pb.core.resumes.streams == {}
    resume(pb, 2, first.id(1), refused("resume_unknown"))
    idle(pb, 2)


def test_an_ended_stream_is_kept_for_linger_after_its_end() -> None:
    pb = Playbook(resume_config(linger=5))
    first = Stream(pb)
    first.send(b"data: a\n\n", b"data: a\nid: {T}.1\n\n")
    lingers(pb, until=5.0)
    first.send(b"data: b\n\n")
    pb >> data(-1, first.backend.end())
    pb << SetTimer(timer=("linger", 1), at=5.0)
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    ends = lambda events: isinstance(events[-1], h11.EndOfMessage)  # noqa: E731
    resume(pb, 2, first.id(1), both(first.body(b"data: b\nid: {T}.2\n\n"), ends))
    idle(pb, 2)
    pb.now = 5.0
    pb >> wakeup("linger", 1)
    pb.done()
    assert pb.core.resumes.streams == {}


def test_the_window_overflowing_while_nobody_reads_ends_the_backend_at_once() -> None:
    pb = Playbook(resume_config(window=4096))
    first = Stream(pb)
    first.send(b"data: a\n\n", b"data: a\nid: {T}.1\n\n")
    lingers(pb)
    for _ in range(40):  # 40 x ~130 bytes > 4 KiB: the first event would be dropped
        pb >> data(-1, first.backend.chunk(b"data: " + b"x" * 100 + b"\n\n"))
        if pb.queue:
            break
    pb << CancelTimer(timer=("linger", 1))
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("linger", 1), at=30.0)
    resume(pb, 2, first.id(1), refused("resume_unknown"))
    idle(pb, 2)


def test_a_resume_from_before_the_window_is_refused_as_evicted() -> None:
    pb = Playbook(resume_config(window=4096))
    first = Stream(pb)
    first.send(b"data: a\n\n", b"data: a\nid: {T}.1\n\n")
    x = b"data: " + b"x" * 100 + b"\n"
    for seq in range(2, 42):
        first.send(x + b"\n", x + b"id: {T}.%d\n\n" % seq)
    lingers(pb)
    resume(pb, 2, first.id(1), refused("resume_evicted"))
    idle(pb, 2)
    resume(pb, 3, first.id(41), h1_response(200, b""))
    pb << CancelTimer(timer=("linger", 1))
    pb.done()


def test_a_resume_with_other_credentials_is_answered_as_unknown() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb, headers=[("Authorization", "Bearer alice")])
    first.send(b"data: a\n\n", b"data: a\nid: {T}.1\n\n")
    lingers(pb)
    mallory = [*SSE, ("Authorization", "Bearer mallory")]
    resume(pb, 2, first.id(1), refused("resume_unknown"), mallory)
    idle(pb, 2)
    resume(pb, 3, first.id(1), refused("resume_unknown"))
    idle(pb, 3)
    alice = [*SSE, ("Authorization", "Bearer alice")]
    answer = resume(pb, 4, first.id(1), h1_response(200, b""), alice)
    pb << CancelTimer(timer=("linger", 1))
    pb.done()
    assert b"resume_" not in answer.data


def test_a_client_that_does_not_accept_sse_gets_410() -> None:
    pb = Playbook(resume_config())
    resume(pb, 2, b"A" * 22 + b".3", h1_response(410), headers=[])
    pb << CloseConnection(conn=2, flush_timeout=60.0, linger=True)
    pb.done()
    assert pb.core.resumes.refused["unknown"] == 1


def test_an_id_that_is_not_ours_goes_to_the_backend() -> None:
    pb = Playbook(resume_config())
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("GET", "/v1/stream", [*SSE, ("Last-Event-ID", "backend-own-17")]))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))

    def asks_the_backend(events: Sequence[Any]) -> None:
        assert (b"last-event-id", b"backend-own-17") in events[0].headers, events[0]

    pb << Sends(-1, H1BackendPeer(), both(h1_request(b"GET", b"/v1/stream"), asks_the_backend))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb.done()


def test_a_backend_that_sends_its_own_ids_is_passed_through_untouched() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    raw = b"id: 7\ndata: a\n\ndata: b\n\n"
    first.send(raw, raw)
    assert pb.core.resumes.streams == {}
    pb >> closed(1)
    pb << CloseConnection(conn=-1)  # nothing to resume: the backend is cut as ever
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << CancelTimer(timer=("send", 1))
    pb.done()


def test_a_newer_reconnect_takes_the_stream_over_from_a_live_reader() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\n", b"data: a\nid: {T}.1\n\n")
    lingers(pb)
    one = resume(pb, 2, first.id(1), h1_response(200, b""))
    pb << CancelTimer(timer=("linger", 1))
    pb >> sent(2, len(one.data))
    two = resume(pb, 3, first.id(1), h1_response(200, b""))
    # The older reader is cut, visibly (its HTTP/1.1 connection closes unfinished).
    pb << CloseConnection(conn=2)
    pb >> data(-1, first.backend.chunk(b"data: b\n\n"))
    pb << Sends(3, two.peer, first.body(b"data: b\nid: {T}.2\n\n"))
    pb.done()


def test_resume_over_http2_of_a_stream_begun_over_http1() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\n", b"data: a\nid: {T}.1\n\n")
    lingers(pb)
    first.send(b"data: b\n\n")

    def replayed(events: Sequence[Any]) -> None:
        (response,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
        assert dict(response.headers)[b":status"] == b"200"
        assert h2_body(events, 1) == first.ids(b"data: b\nid: {T}.2\n\n")

    client = h2_resume(pb, 2, first.id(1), replayed)
    pb << CancelTimer(timer=("linger", 1))
    pb >> data(-1, first.backend.end())
    pb << Sends(2, client, h2_ended(1))
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    idle(pb, 2)


def test_a_resumed_client_that_leaves_again_leaves_the_stream_lingering() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\n", b"data: a\nid: {T}.1\n\n")
    lingers(pb)
    answer = resume(pb, 2, first.id(1), h1_response(200, b""))
    pb << CancelTimer(timer=("linger", 1))
    pb >> sent(2, len(answer.data))
    lingers(pb, 2)
    first.send(b"data: b\n\n")
    resume(pb, 3, first.id(1), first.body(b"data: b\nid: {T}.2\n\n"))
    pb << CancelTimer(timer=("linger", 1))
    pb.done()


def test_stamper_keeps_line_ends_comments_and_gives_up_on_an_event_over_its_limit() -> None:
    stamper = EventStamper(b"T", limit=64)
    out, events = stamper.feed(b": ping\r\n\r\ndata: a\r\n\r\n")
    assert out == b": ping\r\n\r\ndata: a\r\nid: T.1\r\n\r\n"
    assert events == [(1, b"data: a\r\nid: T.1\r\n\r\n")]
    out, events = stamper.feed(b"data: " + b"x" * 80)
    assert stamper.overflowed and not stamper.stamping
    assert out == b"data: " + b"x" * 80 and events == []


# -- memory ------------------------------------------------------------------------------------

CHAT_EVENT = (
    b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk",'
    b'"created":1700000000,'
    b'"model":"m","choices":[{"index":0,"delta":{"content":" word"},"finish_reason":null}]}\n'
    b"id: AAAAAAAAAAAAAAAAAAAAAA.1234\n\n"
)
"""An OpenAI chat chunk as a resumable stream keeps it (~230 bytes)."""


class Owner:
    def __init__(self) -> None:
        self.abandoned: list[str] = []

    def take_reader(self, reader: object) -> None:
        raise AssertionError("not resumed here")

    def abandon(self, reason: str) -> None:
        self.abandoned.append(reason)


def lingering_stream(store: ResumeStore, owner: Owner, events: int) -> Resumable:
    head = ResponseHead(stream=1, status=200, headers=[(b"content-type", b"text/event-stream")])
    stream = store.open(Resume(), b"c" * 16, head, "1.1", owner)
    stream.attached = False
    store.unread(stream)
    for seq in range(1, events + 1):
        store.append(stream, seq, bytes(CHAT_EVENT))
    return stream


def test_a_thousand_lingering_streams_with_full_windows_stay_within_the_stated_budget() -> None:
    """docs/resume.md: a stream keeps at most ``window`` bytes of events plus
    ``EVENT_OVERHEAD`` per event and ``STREAM_OVERHEAD``; for chat chunks (~230 bytes) and the
    default 256 KiB window that is at most 380 KiB, so 1,000 lingering streams hold at most
    ~371 MiB, under the default ``limits.resume_memory`` of 512 MiB, and no stream is shed."""
    store = ResumeStore(Effects(default_config()))
    window = Resume().window
    per_window = window // len(CHAT_EVENT) + 1  # events that overfill a window
    owners = [Owner() for _ in range(1000)]
    # The accounting against what Python really allocates, on the first 100 (tracing is slow).
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        streams = [lingering_stream(store, owner, per_window + 50) for owner in owners[:100]]
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert used <= store.held_bytes  # what is accounted is what is held (or more)
    streams += [lingering_stream(store, owner, per_window + 50) for owner in owners[100:]]
    assert all(window - len(CHAT_EVENT) < s.size <= window for s in streams)
    assert 1000 * window <= store.held_bytes <= 1000 * 380 * 1024
    assert store.shed == 0 and not any(o.abandoned for o in owners)
    assert store.states() == {"read": 0, "lingering": 1000, "ended": 0}


def test_past_resume_memory_the_oldest_unread_streams_are_let_go() -> None:
    config = attrs.evolve(
        default_config(), limits=attrs.evolve(default_config().limits, resume_memory=1024 * 1024)
    )
    store = ResumeStore(Effects(config))
    read_owner = Owner()
    head = ResponseHead(stream=1, status=200, headers=[])
    read = store.open(Resume(), b"c" * 16, head, "1.1", read_owner)  # its client reads it
    for seq in range(1, 1001):
        store.append(read, seq, bytes(CHAT_EVENT))  # ~230 KB, never shed
    owners = [Owner() for _ in range(6)]
    streams = [lingering_stream(store, owner, 800) for owner in owners]  # ~180 KiB each
    assert store.held_bytes <= 1024 * 1024
    assert store.shed >= 1
    # Oldest first: the first lingering streams went, their backends ended; the newest stays.
    gone = [bool(o.abandoned) for o in owners]
    assert gone == sorted(gone, reverse=True) and not gone[-1]
    assert streams[-1].token in store.streams and read.token in store.streams
    assert not read_owner.abandoned


def test_a_stream_whose_owner_a_stop_cut_no_longer_names_it() -> None:
    """Found by fuzzing (fuzz/corpus/backend_h1/crash-resume-owner-after-stop): an exchange
    cut by a graceful stop's deadline stayed the owner of its stream, so a resume could have
    handed its client to a finished exchange."""
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\n", b"data: a\nid: {T}.1\n\n")
    (stream,) = pb.core.resumes.streams.values()
    pb >> ShutdownRequested(now=pb.now, deadline=pb.now)
    pb << CloseConnection(conn=1)
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("linger", 1), at=30.0)
    pb.done()
    assert not pb.core.exchanges
    assert stream.owner is None and stream.state is State.BROKEN


def test_a_sized_event_stream_is_not_numbered() -> None:
    """Found by fuzzing (fuzz/corpus/backend_h1/crash-resume-sized-body): ids added to an
    event stream with a Content-Length overran it, and h11 refused the bytes."""
    pb = Playbook(resume_config())
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("POST", CHAT, body=b"{}"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=ORIGIN)
    pb << SetTimer(timer=("body", 1), at=30.0)
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << Sends(-1, H1BackendPeer(), h1_request(b"POST", CHAT.encode(), b"{}"))
    pb << SetTimer(timer=("head", 1), at=60.0)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 9\r\n\r\n"
    pb >> data(-1, head + b"data: a\n\n")
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(200))
    pb << SetTimer(timer=("read", 1), at=300.0)
    pb << Sends(1, client, lambda events: h1_body(events) == b"data: a\n\n")
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    idle(pb, 1)
    assert pb.core.resumes.streams == {}


def test_a_resume_of_an_ended_stream_with_nothing_left_is_204_so_eventsource_stops() -> None:
    """WHATWG HTML §9.2.3: a 204 fails the EventSource's connection for good; an empty 200
    made it reconnect with the same id every few seconds, forever."""
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\ndata: [DONE]\n\n", b"data: a\nid: {T}.1\n\ndata: [DONE]\nid: {T}.2\n\n")
    pb >> data(-1, first.backend.end())
    pb << SetTimer(timer=("linger", 1), at=30.0)
    pb << Sends(1, first.client, lambda events: [type(e) for e in events] == [h11.EndOfMessage])
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    idle(pb, 1)
    no_content = both(
        h1_response(204), lambda events: [type(e) for e in events[1:]] == [h11.EndOfMessage]
    )
    resume(pb, 2, first.id(2), no_content)
    idle(pb, 2)  # a clean answer: the connection stays

    # Over HTTP/2 too, and one event before the end still gets the event and the end.
    def h2_no_content(events: Sequence[Any]) -> None:
        (head,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
        assert (b":status", b"204") in head.headers and h2_body(events, 1) == b""

    h2_resume(pb, 3, first.id(2), h2_no_content)
    idle(pb, 3)
    resume(pb, 4, first.id(1), h1_response(200))
    idle(pb, 4)
