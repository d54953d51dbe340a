"""The I/O of the shared memory of sessions: the fleet store (Redis), and the relay of the
workers of one host (``fleet/sessions.py`` is what is shared, and why; ``docs/fleet.md``).

What it obeys, and why:

- **Never on the request path.** A lookup is the routing memory's own (``Affinity``); what
  it remembers leaves in batches (``SessionsRemembered``, at most every ``SHARE_DELAY``) to
  a bounded queue, and what others remembered comes back as ``SessionsLearned``. A
  conversation's next turn comes seconds after the last one; the memory follows within
  tens of milliseconds, asynchronously, so no request waits for Redis.
- **Layout in the store** (under ``muxproxy:fleet:``), per group: ``sessions:{<group>}``, a
  hash of key hash (16 hex digits) -> ``"<wall time> <address>"``, and
  ``sessions:{<group>}:at``, a sorted set of the same fields by time, which finds the
  expired ones. The group is in braces, a Redis Cluster hash tag, so both keys share a slot.
  One Lua script (``EVALSHA``) per group and batch writes the entries that are newer than
  what the store holds (newest wins, as in every process), drops up to ``PRUNE`` expired
  ones, lets both keys expire ``session_idle`` after the last write (a group no replica
  serves any more goes away) and publishes the batch on ``muxproxy:fleet:sessions``, all
  atomically: a replica that loads the hash and one that reads the channel see the same.
- **Learning.** Each replica subscribes to the channel (before it loads, so nothing written
  in between is missed) and ignores its own messages (each bridge has a random origin id);
  on connecting and on every reconnect it loads the live entries of its groups
  (``HSCAN``, at most ``affinity.DEFAULT_LIMIT`` per group): a replica that starts, or comes
  back from a partition, knows the conversations under way.
- **Redis down.** Serving goes on with the local memory (and the workers' relay). A failed
  write or read is counted (``muxproxy_sessions_store_errors_total``) and logged at most once
  per ``LOG_EVERY`` seconds (``fleet_sessions_store_error``); what could not be written is
  kept (bounded, newest per key) and written on return, before the store is loaded again.
- **Workers of one host** (``serve --workers N``): the supervisor bridges, not each worker.
  Workers send their batches over their control channels; the supervisor keeps the host's
  memory (:class:`~muxproxy.fleet.sessions.SessionMemory`), relays each batch to the other
  workers, and is the one replica of the host toward the store. Why the supervisor: one
  connection and one subscription per host instead of N (Redis fans every message out to
  every subscriber); the memory a worker started later needs (a rolling restart, a
  replacement) is already there, handed over in its payload before it accepts; and a
  worker's code is the same with a store or without.
- **Nothing read is trusted.** Entries from a channel, the store or a worker are checked
  (``entries_from_wire``); bad ones are dropped and counted as ignored.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from muxproxy.config import Config
from muxproxy.core.commands import Log, SessionsRemembered
from muxproxy.core.events import SessionsLearned
from muxproxy.core.observe.series import METRICS, SNAPSHOT_FORMAT
from muxproxy.core.observe.series import PREFIX as PREFIX_METRICS
from muxproxy.fleet.sessions import (
    SessionEntry,
    SessionMemory,
    chunks,
    entries_from_wire,
    entries_to_wire,
    message_from_wire,
    stored_item,
)
from muxproxy.routing.affinity import DEFAULT_LIMIT
from muxproxy.trio.redis import client_of, keep_serving, redacted, store_errors

if TYPE_CHECKING:
    import coredis

    from muxproxy.core.proxy import ProxyCore
    from muxproxy.trio.channel import Channel, Message
    from muxproxy.trio.driver import Driver

PREFIX = "muxproxy:fleet:"
CHANNEL = PREFIX + "sessions"
"""Where every batch written is published."""
QUEUE = 256
"""Batches waiting for the store's writer; past it the batch waits in the backlog."""
PRUNE = 512
"""Expired entries one write drops at most (bounded work per script call)."""
SCAN_COUNT = 1000
"""Entries one ``HSCAN`` asks for while loading."""
OP_TIMEOUT = 3.0
"""Seconds one Redis round trip may take before the store counts as down."""
RECONNECT_DELAY = 1.0
"""Seconds between two attempts to reach a store that is down."""
LOG_EVERY = 10.0
"""Seconds between two ``fleet_sessions_store_error`` log lines."""
RELAYS_IN_FLIGHT = 32
"""Batches on their way to one worker; past it, a worker that does not read misses them."""

_LEARN = f"""
local taken = 0
for i = 4, #ARGV, 3 do
  local held = redis.call('ZSCORE', KEYS[2], ARGV[i])
  if not held or tonumber(held) < tonumber(ARGV[i + 1]) then
    redis.call('ZADD', KEYS[2], ARGV[i + 1], ARGV[i])
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1] .. ' ' .. ARGV[i + 2])
    taken = taken + 1
  end
end
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[1], 'LIMIT', 0, {PRUNE})
if #old > 0 then
  redis.call('ZREM', KEYS[2], unpack(old))
  redis.call('HDEL', KEYS[1], unpack(old))
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('PUBLISH', '{CHANNEL}', ARGV[3])
return taken
"""
"""KEYS: the group's hash and sorted set. ARGV: the oldest time kept, the keys' expiry
(ms), the message to publish, then (key, time, address) per entry."""


def hash_key(group: str) -> str:
    return f"{PREFIX}sessions:{{{group}}}"


def times_key(group: str) -> str:
    return f"{PREFIX}sessions:{{{group}}}:at"


def idle_times(config: Config) -> dict[str, float]:
    """Each group's ``sticky.session_idle``: how long its entries live anywhere."""
    return {name: group.sticky.session_idle for name, group in config.upstreams.items()}


def shifted(entries: Iterable[SessionEntry], offset: float) -> list[SessionEntry]:
    """``entries`` with ``offset`` added to their times: from the core's monotonic clock to
    wall-clock time (``time.time() - trio.current_time()``) or back (its negation)."""
    return [attrs.evolve(entry, at=entry.at + offset) for entry in entries]


class ServingProcess(Protocol):
    """What the memory's bridges see of a process that serves (``trio/server.py``'s
    ``ProxyServer``, which starts them: a protocol, so neither imports the other)."""

    @property
    def config(self) -> Config: ...
    @property
    def core(self) -> ProxyCore: ...
    @property
    def driver(self) -> Driver | None: ...


def learn(server: ServingProcess, entries: Sequence[SessionEntry]) -> None:
    """Sessions remembered by another worker or replica, with wall-clock times, into
    ``server``'s routing memories (``SessionsLearned``: the newest win)."""
    if not entries:
        return
    driver = server.driver
    now = trio.current_time()
    event = SessionsLearned(now=now, entries=tuple(shifted(entries, now - time.time())))
    if driver is None:
        server.core.handle(event)  # before ``run``: it emits nothing
    else:
        driver.feed(event)


def wall_offset() -> float:
    """Add it to a time of the core's clock (``trio.current_time()``) for the wall time."""
    return time.time() - trio.current_time()


@attrs.define
class StoreState:
    """What ``status`` says of the store."""

    up: bool = False
    errors: int = 0
    written: int = 0
    """Entries written to the store."""
    received: int = 0
    """Entries received from the channel or loaded, before newest-wins."""
    loads: int = 0
    """Times the live entries were loaded (the start, and each reconnect)."""
    last_error: str | None = None

    def as_status(self) -> dict[str, Any]:
        return attrs.asdict(self)


class StoreSessions:
    """The bridge between this replica's memory of sessions and the fleet store's.

    ``on_learned`` gets entries from elsewhere (wall-clock times), ``log`` the error lines;
    ``publish`` queues this replica's own (wall-clock times). ``run`` until cancelled."""

    def __init__(
        self,
        url: str,
        idle: Mapping[str, float],
        on_learned: Callable[[list[SessionEntry]], None],
        log: Callable[[Log], None],
    ) -> None:
        self.url = url
        self.idle = dict(idle)
        self.on_learned = on_learned
        self.log = log
        self.origin = os.urandom(8).hex()
        """This bridge's id in the messages it publishes: its own come back and are skipped."""
        self.state = StoreState()
        self.on_error: Callable[[], None] | None = None
        """Called on each failure counted (the core's counter, where a process has one)."""
        self._send, self._receive = trio.open_memory_channel[list[SessionEntry]](QUEUE)
        self._backlog = SessionMemory(self.idle, DEFAULT_LIMIT)
        """What could not be written (the store down, the queue full): written on return."""
        self._logged_at = -math.inf
        self._unlogged = 0

    def reconfigure(self, idle: Mapping[str, float]) -> None:
        self.idle = dict(idle)
        self._backlog.reconfigure(self.idle)

    def publish(self, entries: list[SessionEntry]) -> None:
        """Queue ``entries`` for the store; never blocks (a full queue keeps them in the
        backlog, written on the next batch or reconnect)."""
        if not self.state.up:
            self._backlog.learn(entries, time.time())
            return
        try:
            self._send.send_nowait(entries)
        except trio.WouldBlock:
            self._backlog.learn(entries, time.time())

    async def run(self) -> None:
        """Hold a connection, a subscription and the writer; again after a failure."""
        await keep_serving(
            self._serve,
            lambda exc: self.failed("connection", exc),
            errors=store_errors(),
            delay=RECONNECT_DELAY,
            reset=self._went_down,
        )

    def _went_down(self) -> None:
        self.state.up = False

    async def _serve(self) -> None:
        from coredis.retry import NoRetryPolicy

        async with client_of(self.url) as client:
            script = client.register_script(_LEARN)
            pubsub = client.pubsub(
                channels=[CHANNEL], ignore_subscribe_messages=True, retry_policy=NoRetryPolicy()
            )
            async with pubsub, trio.open_nursery() as nursery:
                nursery.start_soon(self._listen, pubsub)
                # Up from here: what is remembered meanwhile is queued behind the backlog.
                self.state.up = True
                with trio.fail_after(OP_TIMEOUT * 10):
                    await self._write_backlog(script)
                    await self._load(client)
                async for entries in self._receive:
                    await self._write(script, entries)

    async def _listen(self, pubsub: Any) -> None:
        async for message in pubsub:
            if message.get("type") != "message":
                continue
            try:
                origin, entries, _ = message_from_wire(message["data"])
            except ValueError:
                self.state.errors += 1
                continue
            if origin == self.origin:
                continue
            self.state.received += len(entries)
            if entries:
                self.on_learned(entries)

    async def _load(self, client: coredis.Redis[bytes]) -> None:
        self.state.loads += 1
        now = time.time()
        for group, idle in self.idle.items():
            cursor, loaded = 0, 0
            while True:
                cursor, fields = await client.hscan(hash_key(group), cursor, count=SCAN_COUNT)
                items = []
                for field, value in fields.items():
                    item = stored_item(group, field, value)
                    if item is not None and now - item[3] <= idle:
                        items.append(item)
                entries, _ = entries_from_wire(items)
                loaded += len(entries)
                self.state.received += len(entries)
                if entries:
                    self.on_learned(entries)
                if cursor == 0 or loaded >= DEFAULT_LIMIT:
                    break

    async def _write_backlog(self, script: Any) -> None:
        pending = self._backlog.live(time.time())
        self._backlog = SessionMemory(self.idle, DEFAULT_LIMIT)
        for part in chunks(pending):
            await self._write(script, part, keep=False)

    async def _write(self, script: Any, entries: list[SessionEntry], *, keep: bool = True) -> None:
        by_group: dict[str, list[SessionEntry]] = {}
        for entry in entries:
            if entry.group in self.idle:
                by_group.setdefault(entry.group, []).append(entry)
        now = time.time()
        for group, mine in by_group.items():
            idle = self.idle[group]
            message = json.dumps({"origin": self.origin, "entries": entries_to_wire(mine)})
            args: list[str | int] = [repr(now - idle), math.ceil(idle * 1000), message]
            for entry in mine:
                args += [f"{entry.key:016x}", repr(entry.at), entry.address]
            try:
                with trio.fail_after(OP_TIMEOUT):
                    await script(keys=[hash_key(group), times_key(group)], args=args)
            except Exception:
                if keep:
                    self._backlog.learn(mine, now)
                raise
            self.state.written += len(mine)

    def failed(self, what: str, exc: BaseException) -> None:
        """Count a failure; log it unless one was logged within ``LOG_EVERY`` seconds."""
        self.state.errors += 1
        self.state.last_error = f"{what}: {exc!r}"
        if self.on_error is not None:
            self.on_error()
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY:
            self._unlogged += 1
            return
        fields: dict[str, Any] = {"store": redacted(self.url), "what": what, "error": repr(exc)}
        if self._unlogged:
            fields["more"] = self._unlogged
        self._logged_at, self._unlogged = now, 0
        self.log(Log(event="fleet_sessions_store_error", fields=fields))


# -- one process: the server's own bridge -------------------------------------------------


def attach_store(server: ServingProcess, nursery: trio.Nursery) -> StoreSessions:
    """Share ``server``'s memory of sessions through ``[fleet] store`` (one process serving
    alone; workers go through their supervisor): start the bridge in ``nursery``."""
    config = server.config
    assert config.fleet is not None and server.driver is not None
    driver = server.driver
    core = server.core

    def log(line: Log) -> None:
        driver.sink(line, time.time())

    store = StoreSessions(
        config.fleet.store, idle_times(config), lambda entries: learn(server, entries), log
    )

    def counted() -> None:
        core.sessions.store_errors += 1

    def remembered(command: SessionsRemembered) -> None:
        store.publish(shifted(command.entries, wall_offset()))

    store.on_error = counted
    core.sessions.store_status = store.state.as_status
    core.sessions.enable()
    driver.on_sessions = remembered
    nursery.start_soon(store.run)
    return store


# -- workers: the supervisor's relay ------------------------------------------------------


class RelayPeer(Protocol):
    """A worker as the relay sees it (``process/workerproc.py``'s ``Worker``)."""

    @property
    def pid(self) -> int: ...

    @property
    def live(self) -> bool: ...

    @property
    def channel(self) -> Channel: ...


class SessionRelay:
    """The supervisor's side: the host's memory, the relay between its workers, and (with
    ``[fleet] store``) the host's one bridge to the store. Times are wall-clock."""

    def __init__(
        self, config: Callable[[], Config], workers: Callable[[], Sequence[RelayPeer]]
    ) -> None:
        """``config``: the configuration in force (a reload changes the groups' idle
        times, read again when it changes); ``workers``: the live workers."""
        self._config = config
        self._seen = config()
        self.memory = SessionMemory(idle_times(self._seen), DEFAULT_LIMIT)
        self.workers = workers
        self.relayed = 0
        """Entries sent on to workers."""
        self.dropped = 0
        """Batches not sent to a worker that had ``RELAYS_IN_FLIGHT`` unread already."""
        self.ignored = 0
        """Entries from a worker that did not pass the checks."""
        self.store: StoreSessions | None = None
        if self._seen.fleet is not None:
            self.store = StoreSessions(
                self._seen.fleet.store, idle_times(self._seen), self.from_store, _log_line
            )
        self._nursery: trio.Nursery | None = None
        self._in_flight: dict[int, int] = {}

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        if self.store is not None:
            nursery.start_soon(self.store.run)

    def _follow_config(self) -> None:
        config = self._config()
        if config is not self._seen:
            self._seen = config
            self.memory.reconfigure(idle_times(config))
            if self.store is not None:
                self.store.reconfigure(idle_times(config))

    def snapshot(self) -> list[list[Any]]:
        """The live memory, as a worker that starts now is given it (its payload)."""
        return entries_to_wire(self.memory.live(time.time()))

    def from_worker(self, sender: RelayPeer, message: Message) -> None:
        """A worker's batch: remember it, send it on to the others and to the store."""
        self._follow_config()
        entries, refused = entries_from_wire(message.get("entries"))
        self.ignored += refused
        taken = self.memory.learn(entries, time.time())
        if taken:
            self._relay(taken, sender)
            if self.store is not None:
                self.store.publish(taken)

    def from_store(self, entries: list[SessionEntry]) -> None:
        """Entries of other replicas: remember them and send them to every worker."""
        self._follow_config()
        taken = self.memory.learn(entries, time.time())
        if taken:
            self._relay(taken, None)

    def _relay(self, entries: list[SessionEntry], sender: RelayPeer | None) -> None:
        nursery = self._nursery
        if nursery is None:
            return
        message = {"type": "sessions", "entries": entries_to_wire(entries)}
        for worker in self.workers():
            if worker is sender or not worker.live:
                continue
            if self._in_flight.get(worker.pid, 0) >= RELAYS_IN_FLIGHT:
                self.dropped += 1
                continue
            self._in_flight[worker.pid] = self._in_flight.get(worker.pid, 0) + 1
            self.relayed += len(entries)
            nursery.start_soon(self._send, worker, message)

    async def _send(self, worker: RelayPeer, message: Message) -> None:
        try:
            await worker.channel.send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # it is exiting; the supervisor's watcher sees to it
        finally:
            left = self._in_flight.get(worker.pid, 1) - 1
            if left > 0:
                self._in_flight[worker.pid] = left
            else:
                self._in_flight.pop(worker.pid, None)

    def status(self) -> dict[str, Any]:
        """The supervisor's part of ``/status``'s ``sessions``."""
        out: dict[str, Any] = {
            "host_remembered": len(self.memory),
            "relayed": self.relayed,
            "relays_dropped": self.dropped,
        }
        if self.store is not None:
            out["store"] = self.store.state.as_status()
        return out

    def snapshot_metrics(self) -> dict[str, Any]:
        """The supervisor's own measurements (a snapshot, ``core/observe/series.py``'s format): the
        failures of its bridge to the store, which the workers' snapshots cannot count."""
        name = PREFIX_METRICS + "sessions_store_errors_total"
        kind, labels, help_text = METRICS["sessions_store_errors_total"]
        errors = 0 if self.store is None else self.store.state.errors
        metric = {"type": kind, "help": help_text, "labels": list(labels)}
        return {"format": SNAPSHOT_FORMAT, "metrics": {name: {**metric, "samples": [[[], errors]]}}}


def _log_line(line: Log) -> None:
    """A supervisor's error-log line for ``line`` (it has no access log)."""
    text = " ".join(f"{key}={value}" for key, value in line.fields.items())
    logging.getLogger("muxproxy").warning("muxproxy: %s: %s", line.event, text)
