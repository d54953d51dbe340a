"""Resumable SSE streams (``route.resume``) in the sans-IO core, driven with bytes only.

The clock is the playbook's: ``pb.now`` moves only when a test moves it, so the linger
expiry is exact and needs no sleep.
"""

from __future__ import annotations

import json
import re
import tracemalloc

import attrs
import h2.events
import h11
from playbook import H1BackendPeer, H1ClientPeer, H2ClientPeer, Playbook, default_config

from muxproxy.config import Config, Resume, Route
from muxproxy.core.commands import CloseConnection, Command, SetTimer
from muxproxy.core.effects import Effects
from muxproxy.core.events import ShutdownRequested
from muxproxy.core.messages import ResponseHead
from muxproxy.core.streams.resume import Resumable, ResumeStore, State
from muxproxy.core.streams.sseids import EventStamper

SSE = [("Accept", "text/event-stream")]
ID = re.compile(rb"id: ([A-Za-z0-9_-]{22})\.([0-9]+)")


def resume_config(**resume: object) -> Config:
    config = default_config()
    route = Route(prefix="/", upstream="default", resume=Resume(**resume))  # type: ignore[arg-type]
    return attrs.evolve(config, routes=(route,))


def body_of(client: H1ClientPeer, pb: Playbook, conn: int, commands: list[Command]) -> bytes:
    """The response body bytes ``client`` decodes from ``commands`` (reported written)."""
    data = pb.take(conn, commands)
    if not data:
        return b""  # (h11 takes b"" for the end of the input)
    pb.sent(conn, len(data))
    return b"".join(e.data for e in client.events(data) if isinstance(e, h11.Data))


def closes(commands: list[Command], conn: int) -> bool:
    return any(isinstance(c, CloseConnection) and c.conn == conn for c in commands)


def linger_timer(commands: list[Command]) -> SetTimer:
    (timer,) = [c for c in commands if isinstance(c, SetTimer) and c.timer[0] == "linger"]
    return timer


class Stream:
    """One client's chat stream through the proxy, to an HTTP/1.1 backend peer."""

    def __init__(self, pb: Playbook, conn: int = 1, headers: list[tuple[str, str]] = ()) -> None:  # type: ignore[assignment]
        self.pb, self.conn = pb, conn
        self.client = H1ClientPeer()
        pb.accept(conn)
        before = len(pb.opens())
        pb.receive(conn, self.client.request("POST", "/v1/chat/completions", [*headers], b"{}"))
        self.up = pb.opens()[before].conn
        pb.opened(self.up)
        pb.sent(self.up, len(pb.take(self.up)))
        self.backend = H1BackendPeer()
        self.backend.events(pb.take(self.up))
        head = pb.receive(self.up, self.backend.sse_head())
        self.received = body_of(self.client, pb, conn, head)

    def send(self, data: bytes) -> list[Command]:
        commands = self.pb.receive(self.up, self.backend.chunk(data))
        self.received += body_of(self.client, self.pb, self.conn, commands)
        return commands

    def last_id(self) -> bytes:
        token, seq = ID.findall(self.received)[-1]
        return token + b"." + seq


def resume(
    pb: Playbook, conn: int, event_id: bytes, headers: list[tuple[str, str]] = SSE
) -> tuple[H1ClientPeer, list[Command]]:
    client = H1ClientPeer()
    pb.accept(conn)
    commands = pb.receive(
        conn,
        client.request(
            "GET", "/v1/chat/completions", [*headers, ("Last-Event-ID", event_id.decode())]
        ),
    )
    return client, commands


def h2_resume(
    pb: Playbook,
    conn: int,
    event_id: bytes,
    *,
    method: bytes = b"GET",
    path: bytes = b"/v1/chat/completions",
) -> tuple[H2ClientPeer, list[h2.events.Event]]:
    """A new HTTP/2 client on ``conn`` asking for the events after ``event_id``: the client,
    and the events it decoded of what came back at once."""
    client = H2ClientPeer()
    pb.accept(conn)
    pb.receive(conn, client.preface())
    headers = [(b"accept", b"text/event-stream"), (b"last-event-id", event_id)]
    _sid, request = client.request(method, path, headers=headers)
    return client, client.events(pb.take(conn, pb.receive(conn, request)))


def test_events_get_ids_and_a_reconnect_gets_the_rest_then_the_live_tail() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\n")
    first.send(b"data: b\n\ndata: c")  # a partial event is held until it completes
    assert first.received.count(b"id: ") == 2
    token = ID.findall(first.received)[0][0]
    assert first.received == b"data: a\nid: %s.1\n\ndata: b\nid: %s.2\n\n" % (token, token)
    seen = first.last_id()

    # The client goes away: the backend is not cut, and its events are kept.
    gone = pb.closed(1)
    assert not closes(gone, first.up)
    linger_timer(gone)
    more = pb.receive(first.up, first.backend.chunk(b"\n\ndata: d\n\n"))
    assert not closes(more, first.up) and pb.take(1, more) == b""

    # A reconnect with the id of "b" gets "c" and "d", then what comes next, then the end.
    client, commands = resume(pb, 2, seen.replace(b".2", b".1"))
    head = client.events(pb.take(2, commands))
    assert isinstance(head[0], h11.Response) and head[0].status_code == 200
    replayed = b"".join(e.data for e in head if isinstance(e, h11.Data))
    assert replayed == b"data: b\nid: %s.2\n\ndata: c\nid: %s.3\n\ndata: d\nid: %s.4\n\n" % (
        (token,) * 3
    )
    pb.sent(2, len(pb.take(2, commands)))
    live = pb.receive(first.up, first.backend.chunk(b"data: [DONE]\n\n"))
    assert body_of(client, pb, 2, live) == b"data: [DONE]\nid: %s.5\n\n" % token
    end = pb.receive(first.up, first.backend.end())
    assert [type(e) for e in client.events(pb.take(2, end))] == [h11.EndOfMessage]
    assert not closes(end, first.up)  # a complete response: the connection goes back
    assert pb.core.resumes.resumed == 1


def test_a_client_that_never_returns_costs_at_most_linger() -> None:
    pb = Playbook(resume_config(linger=10))
    first = Stream(pb)
    first.send(b"data: a\n\n")
    timer = linger_timer(pb.closed(1))
    assert timer.at == 10.0
    pb.now = 10.0
    expired = pb.wakeup(*timer.timer)
    assert closes(expired, first.up)  # the GPU stops
    assert pb.core.resumes.streams == {}
    client, commands = resume(pb, 2, first.last_id())
    body = b"".join(e.data for e in client.events(pb.take(2, commands)) if isinstance(e, h11.Data))
    assert body.startswith(b"event: error\ndata: ")
    error = json.loads(body.split(b"data: ", 1)[1])["error"]
    assert error["code"] == "resume_unknown" and error["type"] == "resume_error"


def test_an_ended_stream_is_kept_for_linger_after_its_end() -> None:
    pb = Playbook(resume_config(linger=5))
    first = Stream(pb)
    first.send(b"data: a\n\n")
    pb.closed(1)
    first.send(b"data: b\n\n")
    ended = pb.receive(first.up, first.backend.end())
    timer = linger_timer(ended)
    client, commands = resume(pb, 2, first.last_id())
    events = client.events(pb.take(2, commands))
    token = first.last_id().split(b".")[0]
    assert b"".join(e.data for e in events if isinstance(e, h11.Data)) == (
        b"data: b\nid: %s.2\n\n" % token
    )
    assert isinstance(events[-1], h11.EndOfMessage)
    pb.now = timer.at
    pb.wakeup(*timer.timer)
    assert pb.core.resumes.streams == {}


def test_the_window_overflowing_while_nobody_reads_ends_the_backend_at_once() -> None:
    pb = Playbook(resume_config(window=4096))
    first = Stream(pb)
    first.send(b"data: a\n\n")
    pb.closed(1)
    commands: list[Command] = []
    for _ in range(40):  # 40 x ~130 bytes > 4 KiB: the first event would be dropped
        commands = pb.receive(first.up, first.backend.chunk(b"data: " + b"x" * 100 + b"\n\n"))
        if closes(commands, first.up):
            break
    assert closes(commands, first.up)
    _client, answer = resume(pb, 2, first.last_id())
    assert b"resume_unknown" in pb.take(2, answer)


def test_a_resume_from_before_the_window_is_refused_as_evicted() -> None:
    pb = Playbook(resume_config(window=4096))
    first = Stream(pb)
    first.send(b"data: a\n\n")
    oldest = first.last_id()
    for _ in range(40):
        first.send(b"data: " + b"x" * 100 + b"\n\n")
    pb.closed(1)
    _, answer = resume(pb, 2, oldest)
    assert b'"code": "resume_evicted"' in pb.take(2, answer)
    _, answer = resume(pb, 3, first.last_id())
    assert b"resume_evicted" not in pb.take(3, answer)


def test_a_resume_with_other_credentials_is_answered_as_unknown() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb, headers=[("Authorization", "Bearer alice")])
    first.send(b"data: a\n\n")
    pb.closed(1)
    _, stranger = resume(pb, 2, first.last_id(), [*SSE, ("Authorization", "Bearer mallory")])
    assert b"resume_unknown" in pb.take(2, stranger)
    _, nobody = resume(pb, 3, first.last_id())
    assert b"resume_unknown" in pb.take(3, nobody)
    client, owner = resume(pb, 4, first.last_id(), [*SSE, ("Authorization", "Bearer alice")])
    events = client.events(pb.take(4, owner))
    assert isinstance(events[0], h11.Response) and events[0].status_code == 200
    assert b"resume_" not in pb.take(4, owner)


def test_a_client_that_does_not_accept_sse_gets_410() -> None:
    pb = Playbook(resume_config())
    client, commands = resume(pb, 2, b"A" * 22 + b".3", headers=[])
    (response, *_) = client.events(pb.take(2, commands))
    assert isinstance(response, h11.Response) and response.status_code == 410
    assert pb.core.resumes.refused["unknown"] == 1


def test_an_id_that_is_not_ours_goes_to_the_backend() -> None:
    pb = Playbook(resume_config())
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request("GET", "/v1/stream", [*SSE, ("Last-Event-ID", "backend-own-17")]))
    (opened,) = pb.opens()
    pb.opened(opened.conn)
    backend = H1BackendPeer()
    (request, *_) = backend.events(pb.take(opened.conn))
    assert (b"last-event-id", b"backend-own-17") in request.headers


def test_a_backend_that_sends_its_own_ids_is_passed_through_untouched() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    raw = b"id: 7\ndata: a\n\ndata: b\n\n"
    first.send(raw)
    assert first.received == raw
    assert pb.core.resumes.streams == {}
    gone = pb.closed(1)
    assert closes(gone, first.up)  # nothing to resume: the backend is cut as ever


def test_a_newer_reconnect_takes_the_stream_over_from_a_live_reader() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\n")
    pb.closed(1)
    one, answer = resume(pb, 2, first.last_id())
    pb.sent(2, len(pb.take(2, answer)))
    one.events(pb.take(2, answer))
    _two, answer = resume(pb, 3, first.last_id())
    # The older reader is cut, visibly (its HTTP/1.1 connection closes unfinished).
    assert closes(pb.log, 2)
    live = pb.receive(first.up, first.backend.chunk(b"data: b\n\n"))
    assert pb.take(2, live) == b""
    assert b"data: b\nid: " in pb.take(3, live)


def test_resume_over_http2_of_a_stream_begun_over_http1() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\n")
    pb.closed(1)
    first.send(b"data: b\n\n")
    client, events = h2_resume(pb, 2, first.last_id()[:-1] + b"1")
    (response,) = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(response.headers)[b":status"] == b"200"
    data = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert data.startswith(b"data: b\nid: ")
    end = pb.receive(first.up, first.backend.end())
    assert any(isinstance(e, h2.events.StreamEnded) for e in client.events(pb.take(2, end)))


def test_a_resumed_client_that_leaves_again_leaves_the_stream_lingering() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\n")
    pb.closed(1)
    client, answer = resume(pb, 2, first.last_id())
    pb.sent(2, len(pb.take(2, answer)))
    client.events(pb.take(2, answer))
    gone = pb.closed(2)
    assert not closes(gone, first.up)
    linger_timer(gone)
    first.send(b"data: b\n\n")
    _again, answer = resume(pb, 3, first.last_id())
    assert b"data: b\nid: " in pb.take(3, answer)


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
    first.send(b"data: a\n\n")
    (stream,) = pb.core.resumes.streams.values()
    pb.feed(ShutdownRequested(now=pb.now, deadline=pb.now))
    assert not pb.core.exchanges
    assert stream.owner is None and stream.state is State.BROKEN


def test_a_sized_event_stream_is_not_numbered() -> None:
    """Found by fuzzing (fuzz/corpus/backend_h1/crash-resume-sized-body): ids added to an
    event stream with a Content-Length overran it, and h11 refused the bytes."""
    pb = Playbook(resume_config())
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request("POST", "/v1/chat/completions", body=b"{}"))
    up = pb.opens()[0].conn
    pb.opened(up)
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 9\r\n\r\n"
    pb.receive(up, head + b"data: a\n\n")
    body = b"".join(e.data for e in client.events(pb.take(1)) if isinstance(e, h11.Data))
    assert body == b"data: a\n\n"
    assert pb.core.resumes.streams == {}


def test_a_resume_of_an_ended_stream_with_nothing_left_is_204_so_eventsource_stops() -> None:
    """WHATWG HTML §9.2.3: a 204 fails the EventSource's connection for good; an empty 200
    made it reconnect with the same id every few seconds, forever."""
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\ndata: [DONE]\n\n")
    pb.receive(first.up, first.backend.end())
    client, commands = resume(pb, 2, first.last_id())
    events = client.events(pb.take(2, commands))
    assert isinstance(events[0], h11.Response) and events[0].status_code == 204
    assert [type(e) for e in events[1:]] == [h11.EndOfMessage]
    assert not closes(commands, 2)  # a clean answer: the connection stays
    # Over HTTP/2 too, and one event before the end still gets the event and the end.
    _, events = h2_resume(pb, 3, first.last_id())
    (head, *rest) = [
        e for e in events if isinstance(e, h2.events.ResponseReceived | h2.events.DataReceived)
    ]
    assert (b":status", b"204") in head.headers and b"".join(e.data for e in rest) == b""
    _, again = resume(pb, 4, first.last_id().replace(b".2", b".1"))
    assert pb.take(4, again).startswith(b"HTTP/1.1 200 ")
