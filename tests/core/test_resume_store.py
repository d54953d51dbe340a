"""Resume through a shared store (``resume.store``) in the sans-IO core, as conversations.

The owner's side: ``ResumeAppend`` commands, one per backend read that completed events (never
one per event), the meta with the first only, the end once. The reader's side: a resume of a
token this core does not hold becomes a ``ResumeFetch``, and the ``ResumeFetched`` batches the
driver would feed become one SSE response (or a refusal), the next batch asked for only while
the client keeps up. Every command is asserted in order, the store's among them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import h11
from checks import Check, both, h1_body, h1_response
from playbook import (
    H1ClientPeer,
    Playbook,
    Sends,
    closed,
    data,
    sent,
    wakeup,
)
from test_resume import CHAT, SSE, Stream, refused, resume_config

from muxproxy.config import RESUME_CREDENTIALS
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    Command,
    ResumeAppend,
    ResumeFetch,
    ResumeFetchCancel,
    ResumeFetchMore,
    ResumeProbe,
    SetTimer,
)
from muxproxy.core.events import ResumedHead, ResumeFetched, ResumeProbed
from muxproxy.core.streams.resumebind import binding

NAMES = [name.encode() for name in RESUME_CREDENTIALS]

STORE = "redis://127.0.0.1:6379/0"
TOKEN = b"A" * 22
HEAD = ResumedHead(
    status=200, headers=((b"content-type", b"text/event-stream"), (b"x-up", b"1")), version="1.1"
)
AUTHORIZED = [*SSE, ("Authorization", "Bearer k")]
C = TypeVar("C", bound=Command)


class Takes(Generic[C]):
    """The next command is a ``kind``; it is kept (``cmd``) for the test to look into."""

    def __init__(self, kind: type[C]) -> None:
        self.kind = kind
        self._cmd: C | None = None

    def take(self, queue: list[Command]) -> None:
        assert queue and isinstance(queue[0], self.kind), f"expected a {self.kind}: {queue}"
        self._cmd = queue.pop(0)  # type: ignore[assignment]  # checked just above

    @property
    def cmd(self) -> C:
        assert self._cmd is not None
        return self._cmd


def stream_end(events: Sequence[Any]) -> None:
    assert [type(e) for e in events] == [h11.EndOfMessage], events


class Owner(Stream):
    """Client 1's chat stream (exchange 1) to an HTTP/1.1 backend on -1, up to the SSE head
    relayed to the client; ``store``: the head's meta goes to the store first (``meta``)."""

    def __init__(
        self, pb: Playbook, headers: Sequence[tuple[str, str]] = (), *, store: bool = True
    ) -> None:
        self.store = store
        self.meta: ResumeAppend | None = None
        super().__init__(pb, headers)
        pb.done()

    def head_arrived(self) -> None:
        """The head's meta goes to the store before the head goes to the client."""
        if self.store:
            self.pb << (meta := Takes(ResumeAppend))
            self.meta = meta.cmd
            self.token = meta.cmd.token

    def sends(
        self, chunk: bytes, relayed: bytes, appended: list[int] | None = None
    ) -> ResumeAppend | None:
        """The backend sends ``chunk``: ``appended``: the store gets one append of these
        events first; client 1 gets ``relayed`` (and writes it)."""
        pb = self.pb
        pb >> data(-1, self.backend.chunk(chunk))
        batch = None
        if appended is not None:
            pb << (append := Takes(ResumeAppend))
            batch = append.cmd
            assert [seq for seq, _ in batch.events] == appended, batch
        pb << (reply := Sends(1, self.client, self.body(relayed)))
        pb >> sent(1, len(reply.data))
        pb.done()
        return batch


def ends_in_store(append: ResumeAppend, state: str, linger: float = 30.0) -> None:
    """``append`` tells the store the stream's end ``state``, with no events."""
    assert (append.store, append.end, append.events, append.linger) == (
        STORE,
        state,
        (),
        linger,
    ), append


def ended_to_the_client(pb: Playbook, first: Stream, linger: float) -> None:
    """The backend's end, after what the store was told: the stream lingers for a resume,
    the client gets the end, the backend connection is pooled."""
    pb << SetTimer(timer=("linger", 1), at=pb.now + linger)
    pb << Sends(1, first.client, stream_end)
    pb << SetTimer(timer=("pool", -1), at=pb.now + 60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("idle", 1), at=pb.now + 75.0)
    pb.done()


def test_the_owner_appends_once_per_backend_read_with_the_meta_first_and_the_end_once() -> None:
    pb = Playbook(resume_config(store=STORE, linger=7))
    first = Owner(pb, headers=[("Authorization", "Bearer k")])
    meta = first.meta
    assert meta is not None and meta.meta is not None
    assert meta.events == () and meta.end is None and meta.store == STORE
    assert meta.meta.status == 200 and meta.meta.credential == binding(
        [(b"authorization", b"Bearer k")], NAMES
    )
    assert (b"content-type", b"text/event-stream") in meta.meta.headers
    token = meta.token

    # Three events in one read: one append of the three, no meta; a partial event: nothing.
    batch = first.sends(
        b"data: a\n\ndata: b\n\ndata: c\n\ndata: d",
        b"data: a\nid: {T}.1\n\ndata: b\nid: {T}.2\n\ndata: c\nid: {T}.3\n\n",
        [1, 2, 3],
    )
    assert batch is not None
    assert batch.events[0][1] == b"data: a\nid: %s.1\n\n" % token
    assert (batch.meta, batch.end, batch.first_seq, batch.last_seq) == (None, None, 1, 3)
    assert batch.store == STORE and batch.linger == 7
    pb >> data(-1, first.backend.chunk(b" more"))
    pb.done()  # no append, nothing to the client
    first.sends(b"\n\n", b"data: d more\nid: {T}.4\n\n", [4])

    # The end: one append with the state and no events.
    pb >> data(-1, first.backend.end())
    pb << (end := Takes(ResumeAppend))
    ends_in_store(end.cmd, "ended", linger=7)
    ended_to_the_client(pb, first, linger=7)
    pb >> closed(1)  # no append: the store has the end
    pb << CancelTimer(timer=("idle", 1))
    pb << CancelTimer(timer=("send", 1))
    pb.done()


def test_a_backend_that_breaks_is_published_broken() -> None:
    pb = Playbook(resume_config(store=STORE))
    first = Owner(pb)
    first.sends(b"data: a\n\n", b"data: a\nid: {T}.1\n\n", [1])
    pb >> closed(-1, error="reset")
    pb << (broken := Takes(ResumeAppend))
    ends_in_store(broken.cmd, "broken")
    pb << SetTimer(timer=("linger", 1), at=30.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << CloseConnection(conn=1)
    pb.done()


def test_without_a_store_nothing_is_appended() -> None:
    pb = Playbook(resume_config())
    first = Owner(pb, store=False)
    first.sends(b"data: a\n\ndata: b\n\n", b"data: a\nid: {T}.1\n\ndata: b\nid: {T}.2\n\n")
    pb >> data(-1, first.backend.end())  # no append, no fetch
    ended_to_the_client(pb, first, linger=30.0)


def test_a_token_held_here_is_served_from_memory_even_with_a_store() -> None:
    pb = Playbook(resume_config(store=STORE))
    first = Owner(pb)
    first.sends(b"data: a\n\ndata: b\n\n", b"data: a\nid: {T}.1\n\ndata: b\nid: {T}.2\n\n", [1, 2])
    pb >> closed(1)
    pb << SetTimer(timer=("linger", 1), at=30.0)
    pb << CancelTimer(timer=("send", 1))
    client = H1ClientPeer()
    pb.accept(2)
    pb >> data(2, client.request("GET", CHAT, [*SSE, ("Last-Event-ID", first.id(1).decode())]))
    pb << CancelTimer(timer=("header", 2))  # no ResumeFetch
    pb << SetTimer(timer=("send", 2), at=60.0)
    pb << (
        answer := Sends(2, client, both(h1_response(200), first.body(b"data: b\nid: {T}.2\n\n")))
    )
    pb << CancelTimer(timer=("linger", 1))
    pb >> sent(2, len(answer.data))
    pb.done()


# -- the reader's side ---------------------------------------------------------------------


def fetched(**fields: Any) -> Any:
    """What the driver feeds of the store's answer to a ``ResumeFetch``."""
    return lambda now: ResumeFetched(now=now, **fields)


def start_fetch(
    pb: Playbook,
    conn: int = 1,
    headers: Sequence[tuple[str, str]] = AUTHORIZED,
    *,
    event_id: bytes = TOKEN + b".2",
    target: str = CHAT,
) -> tuple[H1ClientPeer, ResumeFetch]:
    """A new client on ``conn`` resumes a token this core does not hold: the store is asked,
    nothing is answered before it is."""
    client = H1ClientPeer()
    pb.accept(conn)
    pb >> data(
        conn, client.request("GET", target, [*headers, ("Last-Event-ID", event_id.decode())])
    )
    pb << CancelTimer(timer=("header", conn))
    pb << (fetch := Takes(ResumeFetch))
    pb.done()
    return client, fetch.cmd


def answered(pb: Playbook, conn: int, client: H1ClientPeer, check: Check) -> Sends:
    """The client gets its answer (``check``), under a fresh send deadline."""
    pb << SetTimer(timer=("send", conn), at=pb.now + 60.0)
    pb << (answer := Sends(conn, client, check))
    return answer


def test_an_unknown_token_is_fetched_and_the_batches_make_one_response() -> None:
    pb = Playbook(resume_config(store=STORE))
    client, fetch = start_fetch(pb)
    assert (fetch.store, fetch.token, fetch.after) == (STORE, TOKEN, 2)
    assert fetch.credential == binding([(b"authorization", b"Bearer k")], NAMES)

    pb >> fetched(request=fetch.request, head=HEAD, events=(b"data: c\nid: x.3\n\n",))
    first = answered(pb, 1, client, h1_response(200, headers={b"x-up": b"1"}))
    pb << ResumeFetchMore(request=fetch.request)
    pb >> sent(1, 10_000)
    pb >> fetched(request=fetch.request, events=(b"data: d\n\n", b"data: e\n\n"))
    pb << (second := Sends(1, client))
    pb << ResumeFetchMore(request=fetch.request)
    pb >> fetched(request=fetch.request, events=(b"data: [DONE]\n\n",), state="ended")
    pb << (last := Sends(1, client))  # the fetch is over by itself: nothing to cancel
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    events = [*first.events, *second.events, *last.events]
    assert h1_body(events) == b"data: c\nid: x.3\n\ndata: d\n\ndata: e\n\ndata: [DONE]\n\n"
    assert isinstance(events[-1], h11.EndOfMessage)
    assert pb.core.resumes.resumed == 1


def test_a_broken_stream_from_the_store_ends_visibly_truncated() -> None:
    pb = Playbook(resume_config(store=STORE))
    client, fetch = start_fetch(pb)
    pb >> fetched(request=fetch.request, head=HEAD, events=(b"data: c\n\n",), state="broken")
    answered(pb, 1, client, h1_response(200, b"data: c\n\n", end=False))
    pb << CloseConnection(conn=1)
    pb.done()


def test_refusals_from_the_store_are_answered_as_those_of_memory() -> None:
    pb = Playbook(resume_config(store=STORE))
    for conn, state in enumerate(("unknown", "evicted", "invalid", "unavailable"), start=1):
        client, fetch = start_fetch(pb, conn)
        pb >> fetched(request=fetch.request, state=state)
        answer = answered(pb, conn, client, refused(f"resume_{state}"))
        pb << SetTimer(timer=("idle", conn), at=75.0)
        pb >> sent(conn, len(answer.data))
        pb.done()
    assert pb.core.resumes.refused == {
        "unknown": 1,
        "evicted": 1,
        "invalid": 1,
        "unavailable": 1,
        "lost": 0,
        "corrupt": 0,
    }
    # Without SSE in Accept: 503 for a store that cannot be read.
    client, fetch = start_fetch(pb, 9, [], event_id=TOKEN + b".1", target="/v1/x")
    pb >> fetched(request=fetch.request, state="unavailable")
    answered(pb, 9, client, h1_response(503))
    pb << CloseConnection(conn=9)
    pb.done()


def test_a_slow_client_holds_the_next_batch_back_until_it_drains() -> None:
    pb = Playbook(resume_config(store=STORE))
    client, fetch = start_fetch(pb)
    big = b"data: " + b"x" * 400_000 + b"\n\n"
    pb >> fetched(request=fetch.request, head=HEAD, events=(big,))
    out = answered(pb, 1, client, h1_response(200, big))
    pb.done()  # over its high water: no next batch yet
    pb >> sent(1, len(out.data))
    pb << ResumeFetchMore(request=fetch.request)
    pb.done()


def test_a_client_that_goes_away_cancels_its_fetch() -> None:
    pb = Playbook(resume_config(store=STORE))
    _, fetch = start_fetch(pb)
    pb >> closed(1)
    pb << ResumeFetchCancel(request=fetch.request)
    # A batch that was on its way finds nobody: ignored.
    pb >> fetched(request=fetch.request, head=HEAD, events=(b"data: a\n\n",))
    pb << ResumeFetchCancel(request=fetch.request)
    client, again = start_fetch(pb, 2)
    pb >> fetched(request=again.request, head=HEAD, events=(b"data: a\n\n",))
    answered(pb, 2, client, h1_response(200, b"data: a\n\n"))
    pb << ResumeFetchMore(request=again.request)
    pb >> closed(2)
    pb << ResumeFetchCancel(request=again.request)
    pb << CancelTimer(timer=("send", 2))
    pb.done()


def test_an_expired_linger_asks_the_store_for_a_remote_reader_before_ending_the_backend() -> None:
    pb = Playbook(resume_config(store=STORE, linger=10))
    first = Owner(pb)
    first.sends(b"data: a\n\n", b"data: a\nid: {T}.1\n\n", [1])
    pb >> closed(1)
    pb << SetTimer(timer=("linger", 1), at=10.0)
    pb << CancelTimer(timer=("send", 1))
    pb.now = 10.0
    pb >> wakeup("linger", 1)
    pb << (probe := Takes(ResumeProbe))
    pb.done()  # the backend is not closed yet
    assert probe.cmd.store == STORE and probe.cmd.token == first.token

    # Someone reads it through another process: another linger, the backend running.
    pb >> ResumeProbed(now=pb.now, stream=probe.cmd.stream, reading=True)
    pb << SetTimer(timer=("linger", 1), at=20.0)
    pb.done()
    assert pb.core.resumes.remote_reads == 1

    # Nobody now: the backend ends, as without a store.
    pb.now = 20.0
    pb >> wakeup("linger", 1)
    pb << (again := Takes(ResumeProbe))
    pb >> ResumeProbed(now=pb.now, stream=again.cmd.stream, reading=False)
    pb << (broken := Takes(ResumeAppend))
    ends_in_store(broken.cmd, "broken", linger=10)
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("linger", 1), at=30.0)
    pb.done()


def test_without_a_store_an_expired_linger_ends_the_backend_at_once() -> None:
    pb = Playbook(resume_config(linger=10))
    first = Owner(pb, store=False)
    first.sends(b"data: a\n\n", b"data: a\nid: {T}.1\n\n")
    pb >> closed(1)
    pb << SetTimer(timer=("linger", 1), at=10.0)
    pb << CancelTimer(timer=("send", 1))
    pb.now = 10.0
    pb >> wakeup("linger", 1)  # no ResumeProbe
    pb << CloseConnection(conn=-1)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("linger", 1), at=20.0)
    pb.done()


def test_a_fetched_stream_that_ended_with_nothing_left_is_answered_204() -> None:
    pb = Playbook(resume_config(store=STORE))
    client, fetch = start_fetch(pb)
    pb >> fetched(request=fetch.request, head=HEAD, events=(), state="ended")

    def no_content(events: Sequence[Any]) -> None:
        assert isinstance(events[0], h11.Response) and events[0].status_code == 204
        assert [type(e) for e in events[1:]] == [h11.EndOfMessage]

    answered(pb, 1, client, no_content)
    pb << SetTimer(timer=("idle", 1), at=75.0)  # no ResumeFetchMore
    pb.done()


def test_a_corrupt_record_is_a_clean_502_for_every_client() -> None:
    pb = Playbook(resume_config(store=STORE))
    for conn, headers in ((1, AUTHORIZED), (2, [])):
        client, fetch = start_fetch(pb, conn, headers)
        pb >> fetched(request=fetch.request, state="corrupt")
        answered(pb, conn, client, h1_response(502, end=True))
        pb << CloseConnection(conn=conn)
        pb.done()
    assert pb.core.resumes.refused["corrupt"] == 2


def test_a_stream_whose_owner_died_ends_with_the_resume_error_after_what_was_kept() -> None:
    pb = Playbook(resume_config(store=STORE))
    client, fetch = start_fetch(pb)
    pb >> fetched(request=fetch.request, head=HEAD, events=(b"data: c\n\n",))
    first = answered(pb, 1, client, h1_response(200))
    pb << ResumeFetchMore(request=fetch.request)
    pb >> sent(1, len(first.data))
    pb >> fetched(request=fetch.request, events=(b"data: d\n\n",), state="lost")
    pb << (last := Sends(1, client))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    events = [*first.events, *last.events]
    body = h1_body(events)
    assert body.startswith(b"data: c\n\ndata: d\n\nevent: error\ndata: ")
    assert b'"code": "resume_lost"' in body
    assert isinstance(events[-1], h11.EndOfMessage)  # a clean end: the page closes on it
    assert pb.core.resumes.refused["lost"] == 1
