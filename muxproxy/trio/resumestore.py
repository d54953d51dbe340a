"""The shared resume store: resumable SSE streams kept in Redis, for other workers and replicas.

What it obeys, and why (``docs/resume.md``; the core's side is ``core/streams/resume.py`` and
``core/exchange/replay.py``, which stay pure: this module does all the I/O, with ``coredis``):

- **Layout.** Per stream token two keys: ``muxproxy:resume:{<token>}:events``, a Redis Stream
  whose entry ids are ``0-<seq>`` (``XADD`` with explicit ids, so an entry's id *is* its
  event number and a resume reads ``XRANGE 0-<after+1> +``), trimmed with ``XTRIM MINID
  0-<first_seq>`` to what the owner's own window holds (so Redis holds as many bytes per
  stream as the owner does); and ``muxproxy:resume:{<token>}:meta``, a hash: ``credential``
  (``resumebind.binding_of``, a hash), ``status``, ``headers`` (JSON, each field as latin-1
  strings), ``version``, ``state`` (``live``, ``ended``, ``broken``), ``first`` and ``last``
  (the seqs the stream holds). One append is one ``MULTI``/``EXEC``: events and meta change
  together, so a reader that sees ``state = ended`` finds every event in the stream. The
  token is in braces, a Redis Cluster hash tag, so that a stream's keys share one slot.
- **Expiry.** While live both keys expire ``linger + LIVE_MARGIN`` seconds after the last
  append (a dead owner's keys go away by themselves); at the end, ``linger`` seconds after it.
- **Remote readers.** A fetch that follows a live stream marks
  ``muxproxy:resume:{<token>}:reader`` (``SET ... PX READER_TTL_MS``, renewed as it goes);
  an owner whose linger expired asks for that mark (``ResumeProbe``, ``EXISTS``) before it
  ends the backend, so a client resumed elsewhere keeps the generation running.
- **The owner's lease.** While a stream is live its owner holds
  ``muxproxy:resume:{<token>}:owner`` (``SET ... PX resume.lease``, with each append and
  renewed every second by ``_Store._renew``; deleted in the end's transaction). A fetch that
  finds the stream ``live`` without it (one transaction) knows the owner died (SIGKILL, a
  crash): it ends at once with what the store holds, state ``lost``, instead of waiting for
  an end nobody will write.
- **Nothing read is trusted.** Every meta hash, entry id and event is checked
  (``core/streams/storedrecords.py``) before use; a bad record is logged
  (``resume_store_bad_record``, with the token and the reason) and the resume is ``corrupt``
  (a 502), never relayed.
- **Never block the core.** Appends go through a bounded queue to one task per store; a full
  queue or a failed write drops the append, counted (``ProxyCore.resumes.store_errors``,
  ``muxproxy_resume_store_errors_total``) and logged at most once per ``LOG_EVERY`` seconds.
  ``coredis`` connects again by itself when Redis is back.
- **Sentinel.** A ``redis+sentinel://`` store (``config/storeurl.py``) is the primary that its
  Sentinels name for the service (``coredis.Sentinel(...).primary_for``); coredis asks them
  for it at each new connection, so after a failover the store follows the primary.
- **A fetch** (a resume of a token not held here) checks the credential against the meta
  hash (``hmac.compare_digest``; a mismatch is ``unknown``, as a missing stream), then feeds
  ``ResumeFetched`` batches of at most ``BATCH`` events, waiting after each for the core's
  ``ResumeFetchMore`` (the core asks once the client's buffer is under its high water: a
  slow client holds the reads back). Between batches it waits on ``XREAD BLOCK`` for new
  entries, until the meta state says the stream is over and no entry is left, or the core
  cancels it (``ResumeFetchCancel``: the client went away). A store that cannot be read is
  ``unavailable``.
"""

from __future__ import annotations

import hmac
import json
import math
from typing import TYPE_CHECKING, Any

import coredis
import trio
from coredis.exceptions import ConnectionError as StoreConnectionError
from coredis.exceptions import RedisError
from coredis.tokens import PureToken

from muxproxy.core.commands import (
    Log,
    ResumeAppend,
    ResumeFetch,
    ResumeFetchCancel,
    ResumeFetchMore,
    ResumeProbe,
)
from muxproxy.core.events import ResumedHead, ResumeFetched, ResumeProbed
from muxproxy.core.streams.storedrecords import (
    BadRecord,
    StoredMeta,
    stored_event,
    stored_meta,
    stored_seq,
    stored_state,
)
from muxproxy.trio.redis import client_of, keep_serving, redacted

if TYPE_CHECKING:
    from muxproxy.trio.storehost import StoreHost

APPEND_QUEUE = 4096
"""Appends waiting for a store's writer; past it they are dropped (and counted): a store
that is slow or down must cost bounded memory, never a blocked event loop."""
BATCH = 256
"""Most events of one ``ResumeFetched`` (one ``XRANGE ... COUNT``)."""
BLOCK_MS = 1000
"""How long one ``XREAD BLOCK`` waits for a live stream's next entry before the fetch looks
at the stream's state again."""
OP_TIMEOUT = 3.0
"""Seconds one Redis round trip may take before the store counts as unavailable."""
LIVE_MARGIN = 60.0
"""Seconds beyond ``linger`` a live stream's keys outlive its last append (a backend may be
silent a while between tokens); an owner that died leaves them for at most this long."""
GRACE = 2.0
"""Seconds a fetch waits for the owner's append of an event the client already has (the
owner sends it to its client before its append reaches Redis) before calling it invalid."""
RECONNECT_DELAY = 1.0
"""Seconds before a store client that failed as a whole is made again."""
READER_TTL_MS = 5000
"""How long a fetch's mark on ``muxproxy:resume:{<token>}:reader`` lasts; it renews it at least
every ``BLOCK_MS`` (and every second while its client is behind), so an owner whose linger
expires (``ResumeProbe``) sees a reader that follows the stream from another process."""
LEASE_IDLE = 1.0
"""Seconds the lease renewer sleeps while this process owns no live stream."""
READER_RENEW = 1.0
"""Seconds between renewals of the mark while the fetch waits for its client."""
LOG_EVERY = 10.0
"""Seconds between two ``resume_store_error`` log lines of one store."""

_ERRORS = (RedisError, OSError, trio.TooSlowError)
_LIVE, _ENDED, _BROKEN = b"live", b"ended", b"broken"


def events_key(token: bytes) -> bytes:
    return b"muxproxy:resume:{%s}:events" % token


def meta_key(token: bytes) -> bytes:
    return b"muxproxy:resume:{%s}:meta" % token


def reader_key(token: bytes) -> bytes:
    return b"muxproxy:resume:{%s}:reader" % token


def lease_key(token: bytes) -> bytes:
    return b"muxproxy:resume:{%s}:owner" % token


def _entry_id(seq: int) -> str:
    return f"0-{seq}"


class _Store:
    """One Redis (by URL): its client, and the writer of its appends."""

    def __init__(self, stores: ResumeStores, url: str) -> None:
        self.stores = stores
        self.url = url
        self.send, self.receive = trio.open_memory_channel[ResumeAppend](APPEND_QUEUE)
        self.client: coredis.Redis[bytes] | None = None
        self.ready = trio.Event()
        self.logged_at = -math.inf
        self.unlogged = 0
        self.owned: dict[bytes, float] = {}
        """The live streams this process owns here, with their lease (``resume.lease``):
        the renewer keeps their leases while the process lives."""

    async def run(self) -> None:
        """Hold a client and write the queued appends, one transaction each; a client that
        fails as a whole is replaced after ``RECONNECT_DELAY`` (each command already
        reconnects by itself)."""
        await keep_serving(
            self._serve,
            lambda exc: self.failed("connection", exc),
            errors=_ERRORS,
            delay=RECONNECT_DELAY,
            reset=self._reset,
        )

    def _reset(self) -> None:
        self.client = None
        self.ready = trio.Event()

    async def _serve(self) -> None:
        async with client_of(self.url) as client, trio.open_nursery() as nursery:
            self.client = client
            self.ready.set()
            nursery.start_soon(self._renew, client)
            async for command in self.receive:
                try:
                    with trio.fail_after(OP_TIMEOUT):
                        await self._write(client, command)
                except _ERRORS as exc:
                    self.failed("append", exc)

    async def _renew(self, client: coredis.Redis[bytes]) -> None:
        """Renew the lease of every live stream owned here, every third of the shortest
        lease: a process that dies (SIGKILL, a crash) stops renewing, and its leases run out
        within ``resume.lease`` seconds, which tells readers elsewhere (``_follow``)."""
        while True:
            period = min(LEASE_IDLE, min(self.owned.values(), default=LEASE_IDLE) / 3)
            await trio.sleep(period)
            if not self.owned:
                continue
            try:
                with trio.fail_after(OP_TIMEOUT):
                    async with client.pipeline(transaction=False) as pipe:
                        for token, lease in list(self.owned.items()):
                            pipe.set(lease_key(token), b"1", px=math.ceil(lease * 1000))
            except _ERRORS as exc:
                self.failed("lease", exc)

    async def _write(self, client: coredis.Redis[bytes], command: ResumeAppend) -> None:
        events, meta = events_key(command.token), meta_key(command.token)
        fields: dict[bytes, Any] = {b"first": command.first_seq, b"last": command.last_seq}
        if command.meta is not None:
            head = command.meta
            fields[b"credential"] = head.credential
            fields[b"status"] = head.status
            fields[b"version"] = head.version
            fields[b"headers"] = json.dumps(
                [[name.decode("latin-1"), value.decode("latin-1")] for name, value in head.headers]
            )
            fields[b"state"] = _LIVE
        if command.end is not None:
            fields[b"state"] = command.end.encode("ascii")
        ttl = math.ceil(command.linger if command.end else command.linger + LIVE_MARGIN)
        async with client.pipeline(transaction=True) as pipe:
            if command.end is None:
                pipe.set(lease_key(command.token), b"1", px=math.ceil(command.lease * 1000))
            else:
                pipe.delete([lease_key(command.token)])  # with the end, in one transaction
            for seq, data in command.events:
                pipe.xadd(events, {b"d": data}, identifier=_entry_id(seq))
            if command.events:
                # MINID takes a stream id (``0-<seq>``); the stub says int.
                pipe.xtrim(events, PureToken.MINID, _entry_id(command.first_seq))  # type: ignore[arg-type]
            pipe.hset(meta, fields)
            pipe.expire(events, ttl)
            pipe.expire(meta, ttl)

    def failed(self, what: str, exc: BaseException) -> None:
        """Count a failed append or read; log it, at most once per ``LOG_EVERY`` seconds."""
        core = self.stores.driver.core
        core.resumes.store_errors += 1
        now = trio.current_time()
        if now - self.logged_at < LOG_EVERY:
            self.unlogged += 1
            return
        self.logged_at = now
        fields = {"store": redacted(self.url), "operation": what, "error": repr(exc)}
        if self.unlogged:
            fields["unlogged_before"] = str(self.unlogged)
        self.unlogged = 0
        self.stores.driver.log(Log(event="resume_store_error", fields=fields))


class _Fetch:
    """One resume answered from a store: its task's scope and the core's go-ahead."""

    __slots__ = ("command", "granted", "scope", "wake")

    def __init__(self, command: ResumeFetch) -> None:
        self.command = command
        self.scope = trio.CancelScope()
        self.granted = False
        self.wake = trio.Event()


class ResumeStores:
    """The driver's shared resume stores, by URL, started on their first command."""

    def __init__(self, driver: StoreHost) -> None:
        self.driver = driver
        self.stores: dict[str, _Store] = {}
        self.fetches: dict[int, _Fetch] = {}

    def _store(self, url: str) -> _Store:
        store = self.stores.get(url)
        if store is None:
            store = self.stores[url] = _Store(self, url)
            self.driver.nursery.start_soon(store.run)
        return store

    # -- commands --------------------------------------------------------------------------

    def append(self, command: ResumeAppend) -> None:
        store = self._store(command.store)
        # The core's view of what it owns, whether or not this append reaches Redis: a
        # dropped end must not leave a lease renewed forever.
        if command.end is not None:
            store.owned.pop(command.token, None)
        elif command.meta is not None:
            store.owned[command.token] = command.lease
        try:
            store.send.send_nowait(command)
        except trio.WouldBlock as exc:
            store.failed("append (queue full, dropped)", exc)

    def fetch(self, command: ResumeFetch) -> None:
        fetch = self.fetches[command.request] = _Fetch(command)
        self.driver.nursery.start_soon(self._run_fetch, self._store(command.store), fetch)

    def more(self, command: ResumeFetchMore) -> None:
        fetch = self.fetches.get(command.request)
        if fetch is not None:
            fetch.granted = True
            fetch.wake.set()

    def probe(self, command: ResumeProbe) -> None:
        self.driver.nursery.start_soon(self._run_probe, self._store(command.store), command)

    async def _run_probe(self, store: _Store, command: ResumeProbe) -> None:
        reading = False
        try:
            with trio.fail_after(OP_TIMEOUT):
                await store.ready.wait()
                client = store.client
                if client is None:
                    raise StoreConnectionError("the store's client is being made again")
                reading = await client.exists([reader_key(command.token)]) > 0
        except _ERRORS as exc:
            store.failed("probe", exc)  # none known: the backend ends, as without a store
        self.driver.feed(
            ResumeProbed(now=trio.current_time(), stream=command.stream, reading=reading)
        )

    def cancel(self, command: ResumeFetchCancel) -> None:
        fetch = self.fetches.pop(command.request, None)
        if fetch is not None:
            fetch.scope.cancel()

    # -- a fetch ---------------------------------------------------------------------------

    async def _run_fetch(self, store: _Store, fetch: _Fetch) -> None:
        request = fetch.command.request
        with fetch.scope:
            try:
                await self._follow(store, fetch)
            except _ERRORS as exc:
                store.failed("fetch", exc)
                self._deliver_last(fetch, None, (), "unavailable")
            except Exception as exc:
                # A bug of ours, or a meta hash we did not write: this resume alone ends
                # (the driver's fault isolation, one client's stream instead of the proxy).
                if self.driver.raise_errors:
                    raise
                self.driver.core.counters["internal_errors"] += 1
                self.driver.log(
                    Log(
                        event="internal_error",
                        fields={"where": "driver: resume fetch", "error": repr(exc)},
                    )
                )
                self._deliver_last(fetch, None, (), "unavailable")
        self.fetches.pop(request, None)

    async def _follow(self, store: _Store, fetch: _Fetch) -> None:
        command = fetch.command
        with trio.fail_after(OP_TIMEOUT):
            await store.ready.wait()
        client = store.client
        if client is None:
            raise StoreConnectionError("the store's client is being made again")
        try:
            await self._follow_checked(client, fetch)
        except BadRecord as bad:
            # Not ours, or damaged: never relayed (``core/streams/storedrecords.py``).
            self.driver.log(
                Log(
                    event="resume_store_bad_record",
                    fields={
                        "stream": command.token.decode("ascii"),
                        "store": redacted(store.url),
                        "reason": bad.reason,
                    },
                )
            )
            self._deliver_last(fetch, None, (), "corrupt")

    async def _meta(self, client: coredis.Redis[bytes], token: bytes) -> StoredMeta | None:
        """The stream's meta hash, checked; None: no such stream (or it expired)."""
        with trio.fail_after(OP_TIMEOUT):
            fields = await client.hgetall(meta_key(token))
        return stored_meta(fields) if fields else None

    async def _follow_checked(self, client: coredis.Redis[bytes], fetch: _Fetch) -> None:
        command = fetch.command
        events, meta_of = events_key(command.token), meta_key(command.token)
        with trio.fail_after(OP_TIMEOUT):
            fields = await client.hgetall(meta_of)
        credential = fields.get(b"credential")
        if credential is None or not hmac.compare_digest(credential, command.credential):
            self._deliver_last(fetch, None, (), "unknown")
            return
        meta: StoredMeta | None = stored_meta(fields)
        cursor = command.after
        deadline = trio.current_time() + GRACE
        while meta is not None and cursor > meta.last:
            # The client may have had events whose append is still on its way.
            if meta.state != "live" or trio.current_time() > deadline:
                self._deliver_last(fetch, None, (), "invalid")
                return
            await self._wait_entry(client, events, meta.last)
            meta = await self._meta(client, command.token)
        if meta is None:
            self._deliver_last(fetch, None, (), "unknown")
            return
        if cursor + 1 < meta.first:
            self._deliver_last(fetch, None, (), "evicted")
            return
        await self._mark_reader(client, command.token)
        head: ResumedHead | None = meta.head
        while True:
            batch, cursor, gap = await self._range(client, events, cursor)
            if gap:
                self._deliver_last(fetch, None, (), "evicted")  # trimmed while we lagged
                return
            if len(batch) < BATCH:
                state = await self._state(client, command.token)
                if state != "live":
                    # Over (its keys expired: unfinished; its owner died: lost). The end's
                    # transaction held its last events: read what came since the range above.
                    rest, cursor, gap = await self._range(client, events, cursor)
                    if gap:
                        self._deliver_last(fetch, None, (), "evicted")
                    else:
                        self._deliver_last(fetch, head, batch + rest, state)
                    return
            if batch or head is not None:
                await self._deliver(client, fetch, head, batch)
                head = None
            if len(batch) < BATCH:
                await self._wait_entry(client, events, cursor)
            await self._mark_reader(client, command.token)

    async def _state(self, client: coredis.Redis[bytes], token: bytes) -> str:
        """The stream's state: ``live`` while its owner's lease holds; ``lost`` when the
        owner died with the stream live (its lease ran out, ``resume.lease``); ``broken``
        when its keys are gone. One transaction: the owner's end sets the state and drops
        the lease together."""
        with trio.fail_after(OP_TIMEOUT):
            async with client.pipeline(transaction=True) as pipe:
                state = pipe.hget(meta_key(token), b"state")
                leased = pipe.exists([lease_key(token)])
            value, owner = await state, await leased
        if value is None:
            return "broken"
        checked = stored_state(value)
        return "lost" if checked == "live" and not owner else checked

    async def _mark_reader(self, client: coredis.Redis[bytes], token: bytes) -> None:
        """Tell the owner that a client follows the stream from here (``READER_TTL_MS``)."""
        with trio.fail_after(OP_TIMEOUT):
            await client.set(reader_key(token), b"1", px=READER_TTL_MS)

    async def _range(
        self, client: coredis.Redis[bytes], key: bytes, cursor: int
    ) -> tuple[list[bytes], int, bool]:
        """The events after ``cursor`` (at most ``BATCH``), the new cursor, and whether some
        of them are missing (trimmed, or their append was lost)."""
        with trio.fail_after(OP_TIMEOUT):
            entries = await client.xrange(key, _entry_id(cursor + 1), "+", count=BATCH)
        if not entries:
            return [], cursor, False
        seqs = [stored_seq(entry.identifier) for entry in entries]
        # An append lost while Redis was away leaves a hole: never skip events silently.
        gap = seqs != list(range(cursor + 1, cursor + 1 + len(seqs)))
        batch = [stored_event(entry.field_values.get(b"d")) for entry in entries]
        return batch, seqs[-1], gap

    async def _wait_entry(self, client: coredis.Redis[bytes], key: bytes, cursor: int) -> None:
        """Until an entry after ``cursor`` is added, or ``BLOCK_MS`` passed."""
        with trio.fail_after(OP_TIMEOUT + BLOCK_MS / 1000):
            await client.xread({key: _entry_id(cursor)}, count=1, block=BLOCK_MS)

    async def _deliver(
        self,
        client: coredis.Redis[bytes],
        fetch: _Fetch,
        head: ResumedHead | None,
        batch: list[bytes],
    ) -> None:
        """Feed a live batch, then wait until the core asks for the next one (renewing the
        reader's mark meanwhile: a client that is behind still reads)."""
        fetch.granted = False
        self._feed(fetch, head, batch, "live")
        while not fetch.granted:
            fetch.wake = trio.Event()
            with trio.move_on_after(READER_RENEW):
                await fetch.wake.wait()
            if not fetch.granted:
                await self._mark_reader(client, fetch.command.token)

    def _deliver_last(
        self, fetch: _Fetch, head: ResumedHead | None, batch: list[bytes] | tuple[()], state: str
    ) -> None:
        self.fetches.pop(fetch.command.request, None)
        self._feed(fetch, head, batch, state)

    def _feed(
        self, fetch: _Fetch, head: ResumedHead | None, batch: list[bytes] | tuple[()], state: str
    ) -> None:
        """Hand the core a batch of ``fetch``'s events (``ResumeFetched``)."""
        self.driver.feed(
            ResumeFetched(
                now=trio.current_time(),
                request=fetch.command.request,
                head=head,
                events=tuple(batch),
                state=state,
            )
        )
