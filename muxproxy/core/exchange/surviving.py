"""How an exchange's stream outlives its client (resume) or its backend (continuation).

What it obeys:

- Resume (``resume.py``, WHATWG HTML §9.2.4): a committed SSE response of unknown length on
  a route with ``resume`` is made resumable; its events are numbered and kept
  (``sseids.py``), bounded by the window. A client that goes away from a stream whose
  request is whole leaves it lingering (``readers.Nobody``): the backend runs on into the
  kept events. A client that comes back (``replay.py``) reads the rest through its own
  connection (``readers.ResumedClient``), which then holds the backend back as its first
  client's did. A window that overflows while nobody reads ends the backend, which is what
  stops the GPU.
- Continuation (``continuation.py``, ``continuing.py``): on a ``continue_on_failure`` route
  a chat completion's answer is followed as it streams; a backend that fails mid-answer is
  replaced by the next server, asked to finish it, within ``next_upstream.tries``. An answer
  whose last token came ends as the engine would have ended it.

It sees the exchange through ``exchangeports.Outliving`` alone: it swaps the exchange's
client through ``hand_to`` and its backend through ``release_upstream`` and
``continue_with``, and keeps its records in the exchange's ``Survival`` (``survival.py``).
Functions, not an object per exchange: an exchange whose route keeps nothing pays nothing.
"""

from __future__ import annotations

from muxproxy.config import Resume
from muxproxy.core.commands import Log
from muxproxy.core.exchange.continuing import ContinuedStream
from muxproxy.core.exchange.exchangeports import Outliving
from muxproxy.core.exchange.heads import backend_fields
from muxproxy.core.messages import ResponseHead
from muxproxy.core.observe.access import backend_ids
from muxproxy.core.ports import Phase, RequestPhase
from muxproxy.core.streams.continuation import AnswerSoFar, FollowedAnswer, wants_continuation
from muxproxy.core.streams.prefill import MessagesSoFar, wants_prefill
from muxproxy.core.streams.readers import Nobody, ResumedClient
from muxproxy.core.streams.resume import RESUME_TOKEN, Reader, State
from muxproxy.core.streams.resumebind import binding_of
from muxproxy.core.streams.sseids import EventStamper
from muxproxy.core.timers import ExchangeTimer
from muxproxy.routing.llmrequest import parse_json_body


def commit(exchange: Outliving, response: ResponseHead) -> None:
    """An SSE response of unknown length goes out (``response``, the client's head): follow
    its answer (``continue_on_failure``; before the request body is let go) and make it
    resumable (``resume``: its token goes in ``response``)."""
    route = exchange.route
    if route is None:
        return
    if route.continue_on_failure:
        keep_answer(exchange)
    if route.resume is not None and not exchange.fx.shutting_down:
        response.headers.append((RESUME_TOKEN, open_resume(exchange, route.resume)))


# -- continuation -------------------------------------------------------------------------


def keep_answer(exchange: Outliving) -> None:
    """Follow the answer, if the request is a chat completion kept whole."""
    upload = exchange.upload
    if upload.phase is not RequestPhase.COMPLETE or not upload.body.replayable:
        return
    document = parse_json_body(upload.body.prefix())
    if wants_continuation(exchange.head.target, document):
        assert isinstance(document, dict)
        exchange.survive().answer = AnswerSoFar(document)
    elif wants_prefill(exchange.head.target, document):
        assert isinstance(document, dict)
        exchange.survive().answer = MessagesSoFar(document)


def continue_answer(exchange: Outliving, reason: str) -> bool:
    """The backend failed mid-answer: ask the next server to finish it, or end it here if
    only its end was lost. False: it cannot be continued (not followed, cut inside an event
    after its finish, no try left)."""
    answer, failover, group = exchange.answer, exchange.failover, exchange.group
    assert answer is not None and failover is not None and group is not None
    if not answer.continuable and not answer.exhausted:
        return False
    # Counted against the server (passive health), so that the next try goes elsewhere.
    failover.failed("error", reason)
    if answer.exhausted:
        _end_answer(exchange, answer)
        return True
    if not failover.allows_continuation():
        return False
    failover.failed_mid_stream()
    exchange.deadlines.end_attempt()
    exchange.release_upstream(close=True)
    failover.leave()
    request_id = exchange.request_id
    failover.count_retry("continuation", reason, request_id)
    body = answer.continuation_body()
    head = exchange.head
    fields = [
        field
        for field in backend_fields(
            head, exchange.client, group, session_key=failover.session_key, has_body=True
        )
        if field[0] not in (b"content-length", b"transfer-encoding")
    ]
    fields.append((b"content-length", str(len(body)).encode("ascii")))
    fields = backend_ids(fields, exchange)
    stream = ContinuedStream(
        exchange, exchange.host.pool, answer.splicer(), (head.target, fields, body)
    )
    exchange.continue_with(stream)
    exchange.survive().continuations += 1
    failover.attempt(user=stream)
    # The connect is bounded by the read timeout (``timeouts.read``): this exchange's
    # ``connect`` timer belongs to its phases before the head.
    exchange.fx.cancel_timer((ExchangeTimer.CONNECT, exchange.ident))
    exchange.deadlines.watch_reading(group)
    return True


def _end_answer(exchange: Outliving, answer: FollowedAnswer) -> None:
    """The backend failed after the answer's last token or its finish: end the stream as the
    engine would have, with no backend (``AnswerSoFar.ending``)."""
    assert exchange.failover is not None
    exchange.failover.failed_mid_stream()
    exchange.deadlines.end_attempt()
    exchange.release_upstream(close=True)
    ending = answer.ending()
    if ending:
        exchange.response_body(ending)
    exchange.response_end([])


# -- resumable streams (``resume.py``, ``readers.py``, ``replay.py``) ----------------------


def open_resume(exchange: Outliving, settings: Resume) -> bytes:
    """Make the response resumable; returns its token (``RESUME_TOKEN``)."""
    survival = exchange.survive()
    group, head, backend_head = exchange.group, exchange.head, survival.backend_head
    assert group is not None and backend_head is not None
    stream = survival.resumable = exchange.host.resumes.open(
        settings,
        binding_of(settings, group, head),
        backend_head,
        exchange.upstream_version or "1.1",
        exchange,
    )
    survival.stamper = EventStamper(stream.token, limit=settings.window)
    return stream.token


def keep(exchange: Outliving, data: bytes) -> bytes:
    """Follow the answer (continuation) and number its events (resume); the bytes for the
    client (b"" when there are none now, or the backend was ended)."""
    answer = exchange.answer
    if answer is not None:
        answer.feed(data)
    if exchange.stamper is not None:
        data = _stamp(exchange, data)
    return data


def _stamp(exchange: Outliving, data: bytes) -> bytes:
    """``data`` with the events it completed numbered and kept; b"" when the backend was
    ended (the window overflowed while the client was away)."""
    stamper, stream, survival = exchange.stamper, exchange.resumable, exchange.survival
    assert stamper is not None and stream is not None and survival is not None
    out, events = stamper.feed(data)
    store = exchange.host.resumes
    for seq, event in events:
        if not store.append(stream, seq, event):
            exchange.abandon("resume window overflowed, or memory limit, while the client was away")
            return b""
    if stream.store is not None:
        store.publish(stream, events)
    if not stamper.stamping:
        # The backend's own ids (its resume is its own), or an event over the window.
        survival.stamper = survival.resumable = None
        if stream.reader is None and stream.attached:
            store.forget(stream)
        else:
            store.ended(stream, State.BROKEN)
    return out


def may_linger(exchange: Outliving) -> bool:
    """The client went away: may the stream go on without it?"""
    stream = exchange.resumable
    return (
        stream is not None
        and stream.attached
        and exchange.phase is Phase.STREAMING
        and exchange.upstream is not None
        and exchange.upload.phase is RequestPhase.COMPLETE
        and not exchange.fx.shutting_down
    )


def linger(exchange: Outliving, reason: str) -> None:
    """The client went away from a resumable stream: keep the backend running into the kept
    events for ``linger`` seconds (``ResumeStore.unread``)."""
    stream = exchange.resumable
    assert stream is not None
    old = exchange.hand_to(Nobody(exchange.client.conn))  # the window bounds what it may send
    stream.detach()
    exchange.host.resumes.unread(stream)
    exchange.fx.emit(
        Log(
            event="resume_linger",
            fields={"request_id": exchange.request_id.decode("latin-1"), "reason": reason},
        )
    )
    old.exchange_finished(exchange)


def take_reader(exchange: Outliving, reader: Reader) -> None:
    """``reader`` resumed the stream: from now on the response goes to its client. The first
    client, or an earlier reader, is cut (it may not know yet that it is gone)."""
    stream = exchange.resumable
    assert stream is not None
    attached = stream.attached
    old = exchange.hand_to(ResumedClient(reader))  # its connection holds the backend back
    if attached:
        stream.detach()
        old.abort(exchange.stream)
        old.exchange_finished(exchange)
    previous = stream.read_by(reader)
    exchange.host.resumes.read(stream)
    if previous is not None:
        previous.taken_over()


def reader_left(exchange: Outliving) -> None:
    """The resumed client went away too: linger again."""
    stream = exchange.resumable
    if stream is None or exchange.phase is Phase.DONE:
        return
    exchange.hand_to(Nobody(exchange.client.conn))
    stream.read_by(None)
    exchange.host.resumes.unread(stream)


def end(exchange: Outliving) -> None:
    """The backend's response ended: the events it completed go out, and a resumable stream
    keeps them for a late reader as one that ended."""
    stamper, stream = exchange.stamper, exchange.resumable
    if stamper is not None:
        rest = stamper.flush()
        if rest:
            exchange.client.send_body(exchange.stream, rest)
    if stream is not None:
        exchange.host.resumes.ended(stream, State.ENDED)


def let_go(exchange: Outliving) -> None:
    """The exchange ends (or fault isolation drops it): a stream it owns keeps its events for
    a late reader, as one whose backend failed, and no longer names it."""
    stream = exchange.resumable
    if stream is not None and stream.owner is exchange:
        exchange.host.resumes.ended(stream, State.BROKEN)
