"""Resumable SSE streams: the events kept per stream, and the table a reconnect looks them up in.

What it obeys, and why:

- **Ids.** A resumable stream is named by a token of 128 random bits (``secrets``; base64url,
  22 characters) and its events by ``<token>.<seq>``, seq counting from 1 (``sseids.py``
  writes them). WHATWG HTML §9.2.4: a client that reconnects sends the last id it saw as
  ``Last-Event-ID``; it gets the events after it. The token is unguessable, but the token
  alone opens nothing: a resume must carry the same credentials as the request that began
  the stream (``resumebind.py``), and one that does not is answered as an unknown token, so
  an id tells a stranger nothing, not even that the stream exists.
- **Bounded memory.** A stream keeps the last ``window`` bytes of its events (the events
  themselves, as they were sent), dropping the oldest; a resume from before them is refused
  (``Lookup.EVICTED``). While no client reads a stream (it *lingers*), the window must not
  drop an event the client may not have had: the first that would be dropped ends the
  backend at once (``Resumable.append`` says so). A lingering stream is ended after
  ``linger`` seconds without a client, and an ended one is forgotten ``linger`` seconds
  after its end, so a client that never returns costs at most ``linger``.
- **Shared.** With ``store`` (a Redis URL) the owner also publishes each backend read's
  events (``ResumeAppend``, one command per read) and the end; a resume of a token this
  process does not hold is answered from the store (``replay.py``, ``ResumeFetch``). A
  stream whose linger expires asks the store first whether a client follows it through
  another process (``ResumeProbe``); if one does it lingers on (``probed``). The store's I/O
  is the driver's: nothing here waits for it, and without ``store`` nothing is emitted.
- **One reader.** A stream is read by one client at a time: a reconnect takes the stream
  over from whoever read it (its old connection may not have noticed yet that it is dead).

Pure: the clock is the ``now`` passed in; the timer is set through ``Effects``.
"""

from __future__ import annotations

import base64
import enum
import re
import secrets
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from muxproxy.config import Resume
from muxproxy.core.commands import ResumeAppend, ResumeMeta, ResumeProbe
from muxproxy.core.messages import ResponseHead
from muxproxy.core.ports import ClientStream, ExchangeClient
from muxproxy.core.timers import ResumeTimer

if TYPE_CHECKING:
    from muxproxy.core.effects import Effects

TOKEN_BITS = 128
RESUME_TOKEN = b"x-resume-token"
"""The response field that names a resumable stream's token: a client that counts the events
it read (each numbered event is one, comments are not) can resume without parsing ids, as
``<token>.<count>``; the OpenAI SDK's ``Stream.response.headers`` shows it."""
_ID = re.compile(rb"\A([A-Za-z0-9_-]{22})\.([0-9]{1,18})\Z")

EVENT_OVERHEAD = 100
"""Bytes of bookkeeping per kept event beyond its own (its ``bytes`` object and tuple):
what ``Resumable.cost`` counts, so the accounted size is the memory used (a test checks)."""
STREAM_OVERHEAD = 2048
"""Bytes per resumable stream beyond its events (the record, its deque and the table entry)."""


def new_token() -> bytes:
    """128 random bits, base64url without padding (22 characters)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(TOKEN_BITS // 8)).rstrip(b"=")


def parse_event_id(value: bytes | None) -> tuple[bytes, int] | None:
    """``(token, seq)`` of a ``Last-Event-ID`` the proxy wrote; None: not one of ours."""
    if value is None:
        return None
    match = _ID.match(value.strip())
    return None if match is None else (match[1], int(match[2]))


class State(enum.Enum):
    LIVE = "live"
    """The backend stream runs."""
    ENDED = "ended"
    """The backend sent the whole response: the events kept are all there is."""
    BROKEN = "broken"
    """The backend failed mid-stream (or was cut): what is kept ends unfinished."""


class Lookup(enum.Enum):
    """Why a resume cannot be served (its reason in the client's error event)."""

    UNKNOWN = "unknown"
    """No such stream here (or not with these credentials), or forgotten after ``linger``."""
    EVICTED = "evicted"
    """The events after the client's id are no longer kept (the window moved past them)."""
    INVALID = "invalid"
    """The id names an event the stream never sent."""
    UNAVAILABLE = "unavailable"
    """The shared store (``Resume.store``) could not be reached."""
    LOST = "lost"
    """(From the shared store.) The process that held the stream died before its end (its
    lease expired, ``resume.lease``): what the store held is all there is."""
    CORRUPT = "corrupt"
    """(From the shared store.) The stored record failed its checks (``storedrecords.py``)."""


class Reader(ClientStream, Protocol):
    """Whoever reads a resumable stream now (``replay.ReplayExchange``), as the stream and its
    owner see it: an exchange of its own client, to whose connection the owner writes
    (``readers.ResumedClient``)."""

    client: ExchangeClient

    def taken_over(self) -> None:
        """Another client resumed the stream: stop reading it."""

    def owner_finished(self) -> None:
        """The owner's backend stream ended (its end or abort went to our client)."""


class Owner(Protocol):
    """The exchange whose backend feeds the stream, as the table and a resume see it."""

    def take_reader(self, reader: Reader) -> None:
        """``reader`` resumed the stream: the rest of the response goes to its client."""

    def abandon(self, reason: str) -> None:
        """No client came back in time (or the window overflowed): end the backend."""


class Resumable:
    """One stream's kept events and who writes and reads them."""

    def __init__(
        self,
        ident: int,
        token: bytes,
        credential: bytes,
        settings: Resume,
        head: ResponseHead,
        version: str,
    ) -> None:
        self.ident = ident
        self.token = token
        self.credential = credential
        self.window = settings.window
        self.linger = settings.linger
        self.lease = settings.lease
        self.store = settings.store
        """The shared store's URL, or None: this process only."""
        self.published_end = False
        """The store was told the stream's end."""
        self.probing = False
        """A ``ResumeProbe`` is out: its linger expired, and the store is asked whether a
        client of another process follows it."""
        self.head = head
        """The backend's response head, from which a resume's head is made."""
        self.version = version
        """The backend's HTTP version (for the resume's ``Via``)."""
        self.events: deque[tuple[int, bytes]] = deque()
        self.size = 0
        """Bytes of the events kept."""
        self.last_seq = 0
        self.state = State.LIVE
        self.owner: Owner | None = None
        self.reader: Reader | None = None
        self.attached = True
        """The first client still reads the stream (through the owner itself)."""

    def detach(self) -> None:
        """The first client went away (its owner's backend may run on)."""
        self.attached = False

    def read_by(self, reader: Reader | None) -> Reader | None:
        """``reader`` reads the stream from now on (None: nobody, it lingers); the first
        client no longer does. Returns the reader before it."""
        previous = self.reader
        self.reader = reader
        self.attached = False
        return previous

    @property
    def lingering(self) -> bool:
        return self.state is State.LIVE and not self.attached and self.reader is None

    @property
    def cost(self) -> int:
        """The memory the stream holds, as accounted (see ``EVENT_OVERHEAD``)."""
        return STREAM_OVERHEAD + self.size + EVENT_OVERHEAD * len(self.events)

    def append(self, seq: int, event: bytes) -> bool:
        """Keep ``event``; False when keeping it dropped an event while the stream lingers,
        so a returning client could no longer have them all: the stream is lost."""
        events = self.events
        events.append((seq, event))
        self.size += len(event)
        self.last_seq = seq
        kept = True
        while self.size > self.window and len(events) > 1:
            _, dropped = events.popleft()
            self.size -= len(dropped)
            kept = kept and not self.lingering
        return kept

    def after(self, seq: int) -> Iterator[bytes] | Lookup:
        """The events after ``seq``, or why they cannot be had."""
        if seq > self.last_seq:
            return Lookup.INVALID
        first = self.events[0][0] if self.events else self.last_seq + 1
        if seq + 1 < first:
            return Lookup.EVICTED
        return (event for number, event in self.events if number > seq)


class ResumeStore:
    """The resumable streams of this process, by token (one per ``ProxyCore``)."""

    def __init__(self, fx: Effects) -> None:
        self.fx = fx
        self.streams: dict[bytes, Resumable] = {}
        self.by_ident: dict[int, Resumable] = {}
        self._next = 0
        self.resumed = 0
        """Resumes served (counted for ``/metrics``)."""
        self.refused: dict[str, int] = {member.value: 0 for member in Lookup}
        """Resumes refused, by ``Lookup`` reason."""
        self.held_bytes = 0
        """``Resumable.cost`` of every stream kept (``limits.resume_memory`` bounds it)."""
        self.shed = 0
        """Streams let go to stay under ``limits.resume_memory``."""
        self.remote_reads = 0
        """Linger expiries put off because a client followed through another process."""
        self.store_errors = 0
        """Appends to and reads of a shared store that failed or were dropped (counted by the
        driver, which does that I/O)."""

    def open(
        self, settings: Resume, credential: bytes, head: ResponseHead, version: str, owner: Owner
    ) -> Resumable:
        self._next += 1
        token = new_token()
        stream = Resumable(self._next, token, credential, settings, head, version)
        stream.owner = owner
        self.streams[token] = stream
        self.by_ident[stream.ident] = stream
        self.held_bytes += stream.cost
        if stream.store is not None:
            meta = ResumeMeta(
                credential=credential,
                status=head.status,
                headers=tuple(head.headers),
                version=version,
            )
            self._publish(stream, (), meta=meta)
        return stream

    def publish(self, stream: Resumable, events: list[tuple[int, bytes]]) -> None:
        """The events one backend read completed, for the shared store (``stream.store``)."""
        if events:
            self._publish(stream, events)

    def _publish(
        self,
        stream: Resumable,
        events: list[tuple[int, bytes]] | tuple[()],
        *,
        end: State | None = None,
        meta: ResumeMeta | None = None,
    ) -> None:
        assert stream.store is not None
        kept = stream.events
        self.fx.emit(
            ResumeAppend(
                store=stream.store,
                token=stream.token,
                events=tuple(events),
                first_seq=kept[0][0] if kept else stream.last_seq + 1,
                last_seq=stream.last_seq,
                end=None if end is None else end.value,
                linger=stream.linger,
                lease=stream.lease,
                meta=meta,
            )
        )
        if end is not None:
            stream.published_end = True

    def find(self, token: bytes, credential: bytes) -> Resumable | None:
        stream = self.streams.get(token)
        if stream is None or not secrets.compare_digest(stream.credential, credential):
            return None
        return stream

    def append(self, stream: Resumable, seq: int, event: bytes) -> bool:
        """Keep ``event`` of ``stream``; False when ``stream`` is lost (its window overflowed
        while nobody read it, or it was let go for ``limits.resume_memory``): its owner ends
        its backend."""
        before = stream.cost
        kept = stream.append(seq, event)
        self.held_bytes += stream.cost - before
        if self.held_bytes > self.fx.config.limits.resume_memory:
            self._shed(stream)
        return kept and stream.token in self.streams

    def _shed(self, current: Resumable) -> None:
        """Over ``limits.resume_memory``: let go of unread streams, oldest first."""
        budget = self.fx.config.limits.resume_memory
        for stream in list(self.streams.values()):
            if self.held_bytes <= budget:
                return
            if stream.reader is not None or (stream.attached and stream.state is State.LIVE):
                continue  # read now: never cut for memory
            self.shed += 1
            owner = stream.owner
            self.forget(stream)
            if owner is not None and stream is not current:
                owner.abandon("resume memory limit: an unread stream let go")

    def refuse(self, why: Lookup) -> None:
        self.refused[why.value] += 1

    def states(self) -> dict[str, int]:
        """How many streams are read, lingering, or ended (for ``/metrics``)."""
        counts = {"read": 0, "lingering": 0, "ended": 0}
        for stream in self.streams.values():
            if stream.state is not State.LIVE:
                counts["ended"] += 1
            elif stream.lingering:
                counts["lingering"] += 1
            else:
                counts["read"] += 1
        return counts

    def unread(self, stream: Resumable) -> None:
        """Nobody reads ``stream`` now: keep it for ``linger`` seconds (its backend running, if
        it still runs), then forget it."""
        self.fx.set_timer((ResumeTimer.LINGER, stream.ident), self.fx.now + stream.linger)

    def read(self, stream: Resumable) -> None:
        """A client reads ``stream`` again: no expiry while it does."""
        self.fx.cancel_timer((ResumeTimer.LINGER, stream.ident))

    def ended(self, stream: Resumable, state: State) -> None:
        """The backend stream is over: keep its events for ``linger`` seconds from now, for a
        client that has not read them all."""
        stream.state = state
        stream.owner = None
        if stream.store is not None and not stream.published_end:
            self._publish(stream, (), end=state)
        if stream.reader is None:
            self.unread(stream)

    def expired(self, ident: int) -> None:
        """The ``linger`` timer of a stream nobody read."""
        stream = self.by_ident.get(ident)
        if stream is None or stream.reader is not None:
            return
        owner = stream.owner
        if stream.store is not None and owner is not None and not stream.probing:
            # A client may follow it through another process: the store knows.
            stream.probing = True
            self.fx.emit(ResumeProbe(store=stream.store, token=stream.token, stream=ident))
            return
        self._let_go(stream)

    def _let_go(self, stream: Resumable) -> None:
        owner = stream.owner
        self.forget(stream)
        if owner is not None:
            owner.abandon("client gone; resume linger expired")

    def probed(self, ident: int, reading: bool) -> None:
        """The store's answer to ``ResumeProbe``: a remote reader keeps the stream (and its
        backend) for another ``linger``; none ends it as its expiry does."""
        stream = self.by_ident.get(ident)
        if stream is None or not stream.probing:
            return
        stream.probing = False
        if stream.reader is not None or stream.owner is None:
            return  # a client came back here, or the backend ended (its end set the timer)
        if reading:
            self.remote_reads += 1
            self.unread(stream)
            return
        self._let_go(stream)

    def forget(self, stream: Resumable) -> None:
        self.fx.cancel_timer((ResumeTimer.LINGER, stream.ident))
        if stream.store is not None and not stream.published_end:
            self._publish(stream, (), end=State.BROKEN)  # its backend is ended unfinished
        if self.streams.pop(stream.token, None) is not None:
            self.held_bytes -= stream.cost
        self.by_ident.pop(stream.ident, None)

    def abandon_all(self, reason: str) -> None:
        """Stopping: nobody can come back to a lingering stream here; end their backends."""
        for stream in list(self.streams.values()):
            if stream.lingering and stream.owner is not None:
                owner = stream.owner
                self.forget(stream)
                owner.abandon(reason)
