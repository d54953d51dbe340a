"""Resume through a shared store (``resume.store``) in the sans-IO core, with bytes only.

The owner's side: ``ResumeAppend`` commands, one per backend read that completed events (never
one per event), the meta with the first only, the end once. The reader's side: a resume of a
token this core does not hold becomes a ``ResumeFetch``, and the ``ResumeFetched`` batches the
driver would feed become one SSE response (or a refusal), the next batch asked for only while
the client keeps up.
"""

from __future__ import annotations

import h11
from playbook import H1ClientPeer, Playbook
from resume_setup import SSE, Stream, body_of, closes, linger_timer, resume, resume_config

from muxproxy.config import RESUME_CREDENTIALS
from muxproxy.core.commands import (
    Command,
    ResumeAppend,
    ResumeFetch,
    ResumeFetchCancel,
    ResumeFetchMore,
    ResumeProbe,
)
from muxproxy.core.events import ResumedHead, ResumeFetched, ResumeProbed
from muxproxy.core.streams.resumebind import binding

NAMES = [name.encode() for name in RESUME_CREDENTIALS]

STORE = "redis://127.0.0.1:6379/0"
TOKEN = b"A" * 22
HEAD = ResumedHead(
    status=200, headers=((b"content-type", b"text/event-stream"), (b"x-up", b"1")), version="1.1"
)


def appends(commands: list[Command]) -> list[ResumeAppend]:
    return [c for c in commands if isinstance(c, ResumeAppend)]


def fetches(commands: list[Command]) -> list[ResumeFetch]:
    return [c for c in commands if isinstance(c, ResumeFetch)]


def more(commands: list[Command]) -> list[Command]:
    return [c for c in commands if isinstance(c, ResumeFetchMore | ResumeFetchCancel)]


def test_the_owner_appends_once_per_backend_read_with_the_meta_first_and_the_end_once() -> None:
    pb = Playbook(resume_config(store=STORE, linger=7))
    opened = len(appends(pb.log))
    first = Stream(pb, headers=[("Authorization", "Bearer k")])
    (meta,) = appends(pb.log)[opened:]
    assert meta.meta is not None and meta.events == () and meta.end is None
    assert meta.meta.status == 200 and meta.meta.credential == binding(
        [(b"authorization", b"Bearer k")], NAMES
    )
    assert (b"content-type", b"text/event-stream") in meta.meta.headers
    token = meta.token

    # Three events in one read: one append of the three, no meta; a partial event: nothing.
    (batch,) = appends(first.send(b"data: a\n\ndata: b\n\ndata: c\n\ndata: d"))
    assert [seq for seq, _ in batch.events] == [1, 2, 3]
    assert batch.events[0][1] == b"data: a\nid: %s.1\n\n" % token
    assert (batch.meta, batch.end, batch.first_seq, batch.last_seq) == (None, None, 1, 3)
    assert batch.store == STORE and batch.linger == 7
    assert appends(first.send(b" more")) == []
    (done,) = appends(first.send(b"\n\n"))
    assert [seq for seq, _ in done.events] == [4]

    # The end: one append with the state and no events.
    end = appends(pb.receive(first.up, first.backend.end()))
    assert [(a.end, a.events) for a in end] == [("ended", ())]
    assert appends(pb.closed(1)) == []


def test_a_backend_that_breaks_is_published_broken() -> None:
    pb = Playbook(resume_config(store=STORE))
    first = Stream(pb)
    first.send(b"data: a\n\n")
    broken = appends(pb.closed(first.up, error="reset"))
    assert [(a.end, a.events) for a in broken] == [("broken", ())]


def test_without_a_store_nothing_is_appended() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb)
    first.send(b"data: a\n\ndata: b\n\n")
    pb.receive(first.up, first.backend.end())
    assert appends(pb.log) == [] and fetches(pb.log) == []


def test_a_token_held_here_is_served_from_memory_even_with_a_store() -> None:
    pb = Playbook(resume_config(store=STORE))
    first = Stream(pb)
    first.send(b"data: a\n\ndata: b\n\n")
    pb.closed(1)
    client, commands = resume(pb, 2, first.last_id().replace(b".2", b".1"))
    assert fetches(commands) == []
    assert b"data: b" in body_of(client, pb, 2, commands)


def fetched(pb: Playbook, request: int, **fields: object) -> list[Command]:
    return pb.feed(ResumeFetched(now=pb.now, request=request, **fields))  # type: ignore[arg-type]


def start_fetch(pb: Playbook, conn: int = 1) -> tuple[H1ClientPeer, ResumeFetch]:
    client, commands = resume(pb, conn, TOKEN + b".2", [*SSE, ("Authorization", "Bearer k")])
    (fetch,) = fetches(commands)
    assert pb.take(conn, commands) == b""  # nothing is answered before the store is
    return client, fetch


def test_an_unknown_token_is_fetched_and_the_batches_make_one_response() -> None:
    pb = Playbook(resume_config(store=STORE))
    client, fetch = start_fetch(pb)
    assert (fetch.store, fetch.token, fetch.after) == (STORE, TOKEN, 2)
    assert fetch.credential == binding([(b"authorization", b"Bearer k")], NAMES)

    first = fetched(pb, fetch.request, head=HEAD, events=(b"data: c\nid: x.3\n\n",))
    assert more(first) == [ResumeFetchMore(request=fetch.request)]
    events = client.events(pb.take(1, first))
    pb.sent(1, 10_000)
    assert isinstance(events[0], h11.Response) and events[0].status_code == 200
    assert (b"x-up", b"1") in events[0].headers.raw_items()
    second = fetched(pb, fetch.request, events=(b"data: d\n\n", b"data: e\n\n"))
    assert more(second) == [ResumeFetchMore(request=fetch.request)]
    last = fetched(pb, fetch.request, events=(b"data: [DONE]\n\n",), state="ended")
    assert more(last) == []  # the fetch is over by itself: nothing to cancel
    events += client.events(pb.take(1, second) + pb.take(1, last))
    body = b"".join(e.data for e in events if isinstance(e, h11.Data))
    assert body == b"data: c\nid: x.3\n\ndata: d\n\ndata: e\n\ndata: [DONE]\n\n"
    assert any(isinstance(e, h11.EndOfMessage) for e in events)
    assert pb.core.resumes.resumed == 1


def test_a_broken_stream_from_the_store_ends_visibly_truncated() -> None:
    pb = Playbook(resume_config(store=STORE))
    client, fetch = start_fetch(pb)
    commands = fetched(pb, fetch.request, head=HEAD, events=(b"data: c\n\n",), state="broken")
    events = client.events(pb.take(1, commands))
    assert not any(isinstance(e, h11.EndOfMessage) for e in events)
    assert any(c.__class__.__name__ == "CloseConnection" for c in commands)


def test_refusals_from_the_store_are_answered_as_those_of_memory() -> None:
    pb = Playbook(resume_config(store=STORE))
    for conn, state in enumerate(("unknown", "evicted", "invalid", "unavailable"), start=1):
        client, fetch = start_fetch(pb, conn)
        commands = fetched(pb, fetch.request, state=state)
        body = body_of(client, pb, conn, commands)
        assert b'"code": "resume_%s"' % state.encode() in body
    assert pb.core.resumes.refused == {
        "unknown": 1,
        "evicted": 1,
        "invalid": 1,
        "unavailable": 1,
        "lost": 0,
        "corrupt": 0,
    }
    # Without SSE in Accept: 503 for a store that cannot be read.
    client = H1ClientPeer()
    pb.accept(9)
    commands = pb.receive(
        9, client.request("GET", "/v1/x", [("Last-Event-ID", (TOKEN + b".1").decode())])
    )
    (fetch,) = fetches(commands)
    events = client.events(pb.take(9, fetched(pb, fetch.request, state="unavailable")))
    assert isinstance(events[0], h11.Response) and events[0].status_code == 503


def test_a_slow_client_holds_the_next_batch_back_until_it_drains() -> None:
    pb = Playbook(resume_config(store=STORE))
    _, fetch = start_fetch(pb)
    big = b"data: " + b"x" * 400_000 + b"\n\n"
    commands = fetched(pb, fetch.request, head=HEAD, events=(big,))
    assert more(commands) == []  # over its high water: no next batch yet
    out = pb.take(1, commands)
    drained = pb.sent(1, len(out))
    assert more(drained) == [ResumeFetchMore(request=fetch.request)]


def test_a_client_that_goes_away_cancels_its_fetch() -> None:
    pb = Playbook(resume_config(store=STORE))
    _, fetch = start_fetch(pb)
    assert more(pb.closed(1)) == [ResumeFetchCancel(request=fetch.request)]
    # A batch that was on its way finds nobody: ignored.
    assert fetched(pb, fetch.request, head=HEAD, events=(b"data: a\n\n",)) == [
        ResumeFetchCancel(request=fetch.request)
    ]
    _, again = start_fetch(pb, 2)
    fetched(pb, again.request, head=HEAD, events=(b"data: a\n\n",))
    assert more(pb.closed(2)) == [ResumeFetchCancel(request=again.request)]


def probes(commands: list[Command]) -> list[ResumeProbe]:
    return [c for c in commands if isinstance(c, ResumeProbe)]


def test_an_expired_linger_asks_the_store_for_a_remote_reader_before_ending_the_backend() -> None:
    pb = Playbook(resume_config(store=STORE, linger=10))
    first = Stream(pb)
    first.send(b"data: a\n\n")
    timer = linger_timer(pb.closed(1))
    pb.now = 10.0
    expired = pb.wakeup(*timer.timer)
    (probe,) = probes(expired)
    assert probe.store == STORE and not closes(expired, first.up)

    # Someone reads it through another process: another linger, the backend running.
    kept = pb.feed(ResumeProbed(now=pb.now, stream=probe.stream, reading=True))
    assert linger_timer(kept).at == 20.0 and not closes(kept, first.up)
    assert pb.core.resumes.remote_reads == 1

    # Nobody now: the backend ends, as without a store.
    pb.now = 20.0
    (again,) = probes(pb.wakeup(*timer.timer))
    ended = pb.feed(ResumeProbed(now=pb.now, stream=again.stream, reading=False))
    assert closes(ended, first.up)
    assert [a.end for a in appends(ended)] == ["broken"]


def test_without_a_store_an_expired_linger_ends_the_backend_at_once() -> None:
    pb = Playbook(resume_config(linger=10))
    first = Stream(pb)
    first.send(b"data: a\n\n")
    timer = linger_timer(pb.closed(1))
    pb.now = 10.0
    expired = pb.wakeup(*timer.timer)
    assert probes(expired) == [] and closes(expired, first.up)


def test_a_fetched_stream_that_ended_with_nothing_left_is_answered_204() -> None:
    pb = Playbook(resume_config(store=STORE))
    client, fetch = start_fetch(pb)
    last = fetched(pb, fetch.request, head=HEAD, events=(), state="ended")
    assert more(last) == []
    events = client.events(pb.take(1, last))
    assert isinstance(events[0], h11.Response) and events[0].status_code == 204
    assert [type(e) for e in events[1:]] == [h11.EndOfMessage]


def test_a_corrupt_record_is_a_clean_502_for_every_client() -> None:
    pb = Playbook(resume_config(store=STORE))
    for conn, headers in ((1, [*SSE, ("Authorization", "Bearer k")]), (2, [])):
        client, commands = resume(pb, conn, TOKEN + b".2", headers)
        (fetch,) = fetches(commands)
        answer = fetched(pb, fetch.request, state="corrupt")
        (response, *rest) = client.events(pb.take(conn, answer))
        assert isinstance(response, h11.Response) and response.status_code == 502
        assert isinstance(rest[-1], h11.EndOfMessage)
    assert pb.core.resumes.refused["corrupt"] == 2


def test_a_stream_whose_owner_died_ends_with_the_resume_error_after_what_was_kept() -> None:
    pb = Playbook(resume_config(store=STORE))
    client, fetch = start_fetch(pb)
    first = fetched(pb, fetch.request, head=HEAD, events=(b"data: c\n\n",))
    pb.sent(1, len(pb.take(1, first)))
    last = fetched(pb, fetch.request, events=(b"data: d\n\n",), state="lost")
    events = client.events(pb.take(1, first) + pb.take(1, last))
    body = b"".join(e.data for e in events if isinstance(e, h11.Data))
    assert body.startswith(b"data: c\n\ndata: d\n\nevent: error\ndata: ")
    assert b'"code": "resume_lost"' in body
    assert isinstance(events[-1], h11.EndOfMessage)  # a clean end: the page closes on it
    assert pb.core.resumes.refused["lost"] == 1
