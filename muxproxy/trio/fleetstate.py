"""The fleet's runtime state through Redis: every replica applies every change within a second.

The I/O half of :mod:`muxproxy.fleet.state` (the document, its layout, the scripts and the
decisions are there). One :class:`FleetSync` runs per replica: in a single ``muxproxy serve``
process beside its ``ProxyServer``, or in the supervisor of ``--workers N``, whose ``apply``
sends the state to every worker as the "runtime" message. Theory of operation:

- **Follow.** It subscribes to :data:`~muxproxy.fleet.state.CHANNEL` *before* it reads the
  document, so that no change falls between the read and the subscription; each message
  carries the whole document and is applied as :func:`~muxproxy.fleet.state.decide` says,
  without a read: a change reaches every replica in one publish (well within a second).
- **Reconcile.** It reads the document again every ``[fleet] sync_interval`` seconds and on
  every (re)connection, so a message lost to a broken connection is never lost for long; the
  read is also the liveness check of the store (a partition shows as a read that times out,
  within :data:`OP_TIMEOUT`). A store found empty is seeded with this replica's state.
- **Change.** :meth:`FleetSync.commit` computes the change on the newest document it holds and
  writes it with the compare-and-set script; on a conflict it reads the store, computes the
  change again and retries (:data:`CAS_ATTEMPTS`). It answers once the store has the change:
  then the state is saved to the state file and applied here (the other replicas get it
  from the publish). While the store cannot be reached a change raises
  :class:`StoreUnavailable` (the admin API's 503): a change applied here alone would split the
  fleet, and would be undone at the next reconciliation anyway.
- **Never the proxy.** Serving does not depend on the store: while it is down the replica
  keeps the last state it applied, and says so (``/status``'s ``fleet``, the metrics
  ``muxproxy_fleet_store_up`` and ``muxproxy_fleet_sync_age_seconds``, a log line at most
  every :data:`LOG_EVERY` seconds with the reason). It connects again every
  :data:`RECONNECT_DELAY` seconds and reconciles as soon as it can.
- **One at a time.** Applying a document, a reconciliation and a change hold one lock, so the
  state applied, the one saved and :attr:`FleetSync.held` never disagree.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import attrs
import coredis
import trio
from coredis.exceptions import RedisError

from muxproxy.config.fleet import FleetSettings
from muxproxy.config.runtime import RuntimeState, save_state
from muxproxy.core.observe.series import GAUGE, METRICS, PREFIX, SNAPSHOT_FORMAT
from muxproxy.fleet.state import (
    CAS_SCRIPT,
    CHANNEL,
    SEED_SCRIPT,
    STATE_KEY,
    FleetDocument,
    Step,
    StoreUnavailable,
    cas_outcome,
    decide,
    document_from_hash,
    document_from_message,
)
from muxproxy.trio.excgroups import leaves

# The one way a store URL (redis://, rediss://, redis+sentinel://) becomes a client.
from muxproxy.trio.redis import client_of

__all__ = ["CAS_ATTEMPTS", "FleetSync", "StoreUnavailable", "shown_url"]

log = logging.getLogger("muxproxy.fleet")

OP_TIMEOUT = 3.0
"""Seconds one round trip to the store may take before the store counts as unreachable."""
RECONNECT_DELAY = 0.5
"""Seconds between two attempts to reach a store that is down: short, since a replica that
is back must reconcile quickly; a connection attempt costs the store next to nothing."""
CAS_ATTEMPTS = 5
"""Tries of one change against concurrent ones before it is refused (each retry follows a
read that gave the newest version: five losses in a row mean a storm of changes)."""
LOG_EVERY = 10.0
"""Seconds between two log lines about a store that stays unreachable."""

Apply = Callable[[RuntimeState], Awaitable[None]]
_ERRORS = (
    RedisError,
    OSError,
    trio.TooSlowError,
    # coredis's connection raises these (anyio's) when it was closed under a command, and
    # its subscription's clean-up does when it is cancelled with its connection gone.
    anyio.ClosedResourceError,
    anyio.BrokenResourceError,
)


class FleetSync:
    """This replica's side of the fleet's runtime state (see the module header).

    ``state``: what the replica runs with before its first sync (its state file's).
    ``apply``: makes a state the replica's (its server's, or every worker's). ``state_file``:
    where each state applied is saved (asked each time: a reload may change it).
    """

    def __init__(
        self,
        settings: FleetSettings,
        state: RuntimeState,
        *,
        apply: Apply,
        state_file: Callable[[], str | None],
    ) -> None:
        self.settings = settings
        self.held = FleetDocument.unsynced(state)
        """The document applied here last."""
        self.up = False
        """Whether the store answered the last round trip."""
        self.last_error: str | None = None
        """Why the store was last unreachable (None: it never was)."""
        self.synced_at: float | None = None
        """``trio.current_time()`` of the last read or message that agreed with the store."""
        self._apply = apply
        self._state_file = state_file
        self._client: coredis.Redis[bytes] | None = None
        self._lock = trio.Lock()
        self._started_at: float | None = None
        self._logged_at = -math.inf
        self._down_since: float | None = None

    # -- what it shows ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``/status``'s ``fleet``: the store (no password), whether it is up, the version
        applied here, seconds since the last sync (None before the first) and the last error."""
        return {
            "store": shown_url(self.settings.store),
            "up": self.up,
            "version": self.held.version,
            "synced_age_seconds": self._sync_age(),
            "last_error": self.last_error,
        }

    def snapshot(self) -> dict[str, Any]:
        """The fleet's metrics as a measurements snapshot (``muxproxy.core.observe.series``)."""
        age = self._sync_age()
        if age is None:  # never synced: as old as the process's wait for the store
            now = trio.current_time()
            age = 0.0 if self._started_at is None else now - self._started_at
        values = {
            "fleet_store_up": 1 if self.up else 0,
            "fleet_sync_age_seconds": round(age, 3),
            "fleet_state_version": self.held.version,
        }
        metrics: dict[str, Any] = {}
        for name, value in values.items():
            kind, labels, help_text = METRICS[name]
            assert kind == GAUGE and not labels
            metrics[PREFIX + name] = {
                "type": kind,
                "help": help_text,
                "labels": [],
                "merge": "sum",
                "samples": [[[], value]],
            }
        return {"format": SNAPSHOT_FORMAT, "metrics": metrics}

    def _sync_age(self) -> float | None:
        if self.synced_at is None:
            return None
        return round(trio.current_time() - self.synced_at, 3)

    # -- following the store ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow the store until cancelled; started at once (serving never waits for it)."""
        self._started_at = trio.current_time()
        task_status.started()
        while True:
            try:
                async with client_of(self.settings.store) as client:
                    await self._follow(client)
            except* _ERRORS as group:
                self._went_down(leaves(group)[0])
            except* ValueError as group:  # a bad document: said, and read again later
                self._went_down(leaves(group)[0], what="holds a bad record")
            await trio.sleep(RECONNECT_DELAY)

    async def _follow(self, client: coredis.Redis[bytes]) -> None:
        # retry_policy=None: a lost connection ends the subscription with an error, and the
        # reconnection is ours, followed by a reconciliation.
        async with client.pubsub(
            channels=[CHANNEL], retry_policy=None, ignore_subscribe_messages=True
        ) as pubsub:
            with trio.fail_after(OP_TIMEOUT):
                await self._reconcile(client)
            self._came_up()
            self._client = client
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._listen, client, pubsub)
                    while True:
                        await trio.sleep(self.settings.sync_interval)
                        with trio.fail_after(OP_TIMEOUT):
                            await self._reconcile(client)
            finally:
                # Before the client closes: no change may start on a client going away. `up`
                # stays until run() knows why (the subscription's own task group may cancel
                # this one before its error surfaces), so /status never shows down without why.
                self._client = None

    async def _listen(self, client: coredis.Redis[bytes], pubsub: Any) -> None:
        while True:
            message = await pubsub.get_message()
            if message is None or message.get("type") != "message":
                continue
            try:
                document = document_from_message(message["data"])
            except ValueError as exc:
                channel = CHANNEL.decode()
                log.warning("muxproxy: fleet store: a message on %s ignored: %s", channel, exc)
                continue
            async with self._lock:
                step = decide(self.held, document)
                if step is Step.APPLY:
                    await self._adopt(document)
                elif step is Step.SEED:
                    with trio.fail_after(OP_TIMEOUT):
                        await self._reconcile_locked(client)
                self.synced_at = trio.current_time()

    async def _reconcile(self, client: coredis.Redis[bytes]) -> None:
        async with self._lock:
            await self._reconcile_locked(client)

    async def _reconcile_locked(self, client: coredis.Redis[bytes]) -> None:
        """Read the document; apply it, or seed the store and read again (at most twice: a
        seed that lost to another replica's is read back, and that one is applied)."""
        for _ in range(3):
            stored = document_from_hash(await client.hgetall(STATE_KEY))
            step = decide(self.held, stored)
            if step is Step.APPLY:
                assert stored is not None
                await self._adopt(stored)
            if step is not Step.SEED:
                break
            await self._seed(client)
        self.synced_at = trio.current_time()

    async def _seed(self, client: coredis.Redis[bytes]) -> None:
        held = self.held
        lineage = secrets.token_hex(8)
        script = client.register_script(SEED_SCRIPT)
        written: Any = await script(
            keys=[STATE_KEY], args=[held.version, lineage, held.state_json(), CHANNEL]
        )
        if written == 1:
            # The store has what this replica runs: a new lineage, nothing to apply.
            self.held = attrs.evolve(held, lineage=lineage, seeded=True)
            log.warning(
                "muxproxy: fleet store %s seeded with this replica's runtime state, version %d"
                " (it held none, restarted empty, or an older replica's)",
                shown_url(self.settings.store),
                held.version,
            )

    async def _adopt(self, document: FleetDocument) -> None:
        """Save ``document``'s state (when there is a state file) and apply it here."""
        path = self._state_file()
        if path is not None:
            try:
                await trio.to_thread.run_sync(save_state, path, document.state)
            except OSError as exc:
                # The store holds the state; the file is what a restart without it reads.
                log.error("muxproxy: fleet: cannot write the state file %r: %s", path, exc)
        await self._apply(document.state)
        self.held = document

    # -- changing it -----------------------------------------------------------------------

    async def commit(self, change: Callable[[RuntimeState], RuntimeState]) -> int:
        """Make ``change`` (the new state from the newest one) the fleet's; returns the
        version the store gave it, once the store has it and this replica applied it.

        ``change`` may raise (an ``AdminError`` for a change that is not valid on the newest
        state): nothing is written then. Raises :class:`StoreUnavailable` when the store
        cannot be reached or kept changing under this one.
        """
        client = self._client
        if client is None or not self.up:
            raise StoreUnavailable(self._why_down())
        async with self._lock:
            script = client.register_script(CAS_SCRIPT)
            try:
                with trio.fail_after(OP_TIMEOUT):
                    for _ in range(CAS_ATTEMPTS):
                        held = self.held
                        state = change(held.state)
                        written = FleetDocument(
                            version=held.version, lineage=held.lineage, state=state
                        )
                        reply: Any = await script(
                            keys=[STATE_KEY],
                            args=[held.version, held.lineage, written.state_json(), CHANNEL],
                        )
                        status, version = cas_outcome(reply)
                        if status == 1:
                            await self._adopt(
                                FleetDocument(version=version, lineage=held.lineage, state=state)
                            )
                            self.synced_at = trio.current_time()
                            return version
                        # Another version, or an empty store: read (seed) and compute again.
                        await self._reconcile_locked(client)
            except _ERRORS as exc:
                self._went_down(exc)
                raise StoreUnavailable(self._why_down()) from None
            except ValueError as exc:
                raise StoreUnavailable(
                    self._why_down(f"answered what is not ours: {exc}")
                ) from None
            except RuntimeError:
                # coredis: the client's pool exited under this change (the connection to the
                # store was lost, and the client with it, between two round trips).
                raise StoreUnavailable(self._why_down("lost: the connection closed")) from None
        raise StoreUnavailable(
            f"the fleet's state changed {CAS_ATTEMPTS} times while this change was being made;"
            " nothing changed, try again"
        )

    # -- the store's health ----------------------------------------------------------------

    def _came_up(self) -> None:
        was_down = self._down_since is not None
        self.up = True
        self._down_since = None
        if was_down:
            log.warning(
                "muxproxy: fleet store %s reachable again; state reconciled (version %d)",
                shown_url(self.settings.store),
                self.held.version,
            )

    def _went_down(self, exc: BaseException, what: str = "unreachable") -> None:
        if trio.current_effective_deadline() == -math.inf:
            return  # cancelled: the replica is stopping, and the connection with it
        now = trio.current_time()
        self.up = False
        self.last_error = f"{what}: {_reason(exc)}"
        if self._down_since is None:
            self._down_since = now
        if now - self._logged_at >= LOG_EVERY:
            self._logged_at = now
            log.warning(
                "muxproxy: fleet store %s %s; serving on with the last state (version %d),"
                " admin changes refused until it is back",
                shown_url(self.settings.store),
                self.last_error,
                self.held.version,
            )

    def _why_down(self, why: str | None = None) -> str:
        store = shown_url(self.settings.store)
        why = why or self.last_error or "not connected"
        return (
            f"the fleet store {store} is {why}; nothing changed (a change made on this replica"
            " alone would split the fleet)"
        )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return f"no answer within {OP_TIMEOUT:g}s"
    return str(exc) or type(exc).__name__


def shown_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for ``/status`` and the logs)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    at = netloc.rfind("@")
    if at < 0:
        return url
    user, colon, _password = netloc[:at].partition(":")
    userinfo = f"{user}:***" if colon else "***"
    return f"{scheme}{sep}{userinfo}{netloc[at:]}{slash}{path}"
