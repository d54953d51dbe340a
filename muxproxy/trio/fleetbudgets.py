"""Fleet-wide budgets, the driver's side: the store's round trips for
``core/exchange/fleetadmit.py``.

What it obeys, and why (the scripts and their rules are ``fleet/budgets.py``):

- **One round trip per admission.** ``BudgetReserve`` is one ``EVALSHA`` of ``RESERVE``
  (tokens, request and lease in one script), answered to the core as ``BudgetAnswered``
  within ``RESERVE_TIMEOUT``: a store that is slower, down, or that answers what no script
  returns is an error, and ``on_store_error`` decides in the core. While the store is known
  to be down (a failure in the last ``DOWN_FOR`` seconds, until a heartbeat succeeds) a
  reservation is answered as an error at once, without a try: a store that stopped
  answering must not cost every request the timeout.
- **Nothing else on a request's path.** ``BudgetSettle`` goes through a bounded queue to one
  writer per store, which sends what has gathered as one pipeline (at most ``SETTLE_BATCH``
  scripts); a full queue drops the settle, counted (its lease expires by itself, its tokens
  stay charged: the budget errs towards refusing).
- **Heartbeat.** Every ``HEARTBEAT`` seconds one pipeline announces this process in the
  replica registry (``ANNOUNCE``, which answers how many are present) and renews the leases
  it holds (``RENEW``, one per tenant). A process that dies stops both: it leaves the count
  within ``REPLICA_TTL`` and its tenants' slots within ``LEASE_TTL``.
- **Each process is its own client.** Under ``muxproxy serve --workers N`` every worker
  holds its own client and announces itself: the reservation is on the admission's path,
  and a hop through the supervisor's control channel would add a round trip of its own to
  it; and since each worker also enforces its own share when the store is away, the
  registry counts the processes that enforce, which is the number a budget must be divided
  by (one replica of two workers and one of one: a third each).
- **Failures degrade the budgets only.** Every store error is counted
  (``muxproxy_fleet_budget_store_errors_total``) and logged at most once per ``LOG_EVERY``
  seconds (``fleet_budget_store_error``, with the operation and the error); the return of
  the store is logged once (``fleet_budget_store_recovered``). ``coredis`` reconnects by
  itself; a client that fails as a whole is made again after ``RECONNECT_DELAY``.
"""

from __future__ import annotations

import math
import os
import secrets
import socket
from typing import TYPE_CHECKING, Any

import coredis
import trio
from coredis.exceptions import RedisError

from muxproxy.core.commands import BudgetReserve, BudgetSettle, Log
from muxproxy.core.events import BudgetAnswered
from muxproxy.fleet.budgets import (
    ANNOUNCE,
    HEARTBEAT,
    LEASE_TTL,
    RENEW,
    REPLICA_TTL,
    REPLICAS,
    RESERVE,
    RESERVE_TIMEOUT,
    SETTLE,
    BadReply,
    Verdict,
    bucket_keys,
    limits_of,
    read_reply,
    replicas_of,
    reserve_args,
    settle_args,
)
from muxproxy.trio.redis import client_of, keep_serving, redacted

if TYPE_CHECKING:
    from coredis.commands.script import Script

    from muxproxy.trio.storehost import StoreHost

SETTLE_QUEUE = 8192
"""Settles waiting for a store's writer; past it they are dropped (and counted)."""
SETTLE_BATCH = 256
"""Most settles in one pipeline."""
OP_TIMEOUT = 2.0
"""Seconds a settle batch or a heartbeat may take."""
DOWN_FOR = 1.0
"""Seconds after a failure in which reservations are answered as errors without a try
(a successful heartbeat ends it sooner)."""
RECONNECT_DELAY = 1.0
LOG_EVERY = 10.0
"""Seconds between two ``fleet_budget_store_error`` lines of one store."""

_ERRORS = (RedisError, OSError, trio.TooSlowError, BadReply)


def replica_id() -> str:
    """This process's name in the registry: host, pid and a random part (a pid is reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class _Store:
    """One fleet store (by URL): its client, its scripts, this process's leases there."""

    def __init__(self, budgets: FleetBudgets, url: str) -> None:
        self.budgets = budgets
        self.url = url
        self.client: coredis.Redis[bytes] | None = None
        self.ready = trio.Event()
        self.scripts: dict[str, Script[bytes]] = {}
        self.send, self.receive = trio.open_memory_channel[BudgetSettle](SETTLE_QUEUE)
        self.leases: dict[str, dict[str, None]] = {}
        """Lease set key -> the members held here (renewed by the heartbeat)."""
        self.replicas = 1
        """The replicas seen at the last heartbeat (at least this one)."""
        self.down_until = -math.inf
        self.down = False
        """A failure was logged and no success came since (for the recovery's log line)."""
        self.logged_at = -math.inf
        self.unlogged = 0

    # -- the client's life -----------------------------------------------------------------

    async def run(self) -> None:
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
            self.scripts = {
                name: client.register_script(text)
                for name, text in (
                    ("reserve", RESERVE),
                    ("settle", SETTLE),
                    ("renew", RENEW),
                    ("announce", ANNOUNCE),
                )
            }
            self.client = client
            self.ready.set()
            nursery.start_soon(self._heartbeat, client)
            await self._write_settles(client)

    async def _heartbeat(self, client: coredis.Redis[bytes]) -> None:
        me: list[Any] = [self.budgets.me, REPLICA_TTL]
        while True:
            try:
                with trio.fail_after(OP_TIMEOUT):
                    async with client.pipeline(transaction=False) as pipe:
                        seen: Any = self.scripts["announce"]([REPLICAS], me, client=pipe)
                        for key, members in list(self.leases.items()):
                            if members:
                                self.scripts["renew"]([key], [LEASE_TTL, *members], client=pipe)
                    count = await seen
                self.replicas = replicas_of(count)
                self.budgets.driver.core.measurements.fleet_replicas = self.replicas
                self.recovered()
            except _ERRORS as exc:
                self.failed("heartbeat", exc)
            await trio.sleep(HEARTBEAT)

    async def _write_settles(self, client: coredis.Redis[bytes]) -> None:
        async for first in self.receive:
            batch = [first]
            while len(batch) < SETTLE_BATCH:
                try:
                    batch.append(self.receive.receive_nowait())
                except trio.WouldBlock:
                    break
            try:
                with trio.fail_after(OP_TIMEOUT):
                    async with client.pipeline(transaction=False) as pipe:
                        for command in batch:
                            keys, args = self._settle_of(command)
                            self.scripts["settle"](keys, args, client=pipe)
            except _ERRORS as exc:
                self.failed(f"settle ({len(batch)} dropped)", exc)

    # -- reservations and settles ------------------------------------------------------------

    def member(self, request: int) -> str:
        return f"{self.budgets.me}:{request}"

    async def reserve(self, command: BudgetReserve) -> None:
        ask = command.ask
        bucket, leases = bucket_keys(ask.group, ask.tenant)
        verdict: Verdict | None = None
        error = ""
        if trio.current_time() < self.down_until:
            error = "the store is down (a recent operation failed)"
        else:
            member = self.member(ask.request) if ask.leased else ""
            try:
                with trio.fail_after(RESERVE_TIMEOUT):
                    await self.ready.wait()
                    reply: object = await self.scripts["reserve"](
                        [bucket, leases], reserve_args(ask.budget, ask.tokens, member)
                    )
                verdict = read_reply(reply)
            except _ERRORS as exc:
                error = _describe(exc)
                self.failed("reserve", exc)
            else:
                if verdict.reserved and member:
                    self.leases.setdefault(leases, {})[member] = None
        self.budgets.driver.feed(
            BudgetAnswered(
                now=trio.current_time(),
                store=command.store,
                ask=ask,
                verdict=verdict,
                error=error,
                replicas=self.replicas,
            )
        )

    def settle(self, command: BudgetSettle) -> None:
        ask = command.ask
        if ask.leased:
            _, leases = bucket_keys(ask.group, ask.tenant)
            held = self.leases.get(leases)
            if held is not None:
                held.pop(self.member(ask.request), None)
                if not held:
                    del self.leases[leases]
        try:
            self.send.send_nowait(command)
        except trio.WouldBlock as exc:
            self.failed("settle (queue full, dropped)", exc)

    def _settle_of(self, command: BudgetSettle) -> tuple[list[str], list[Any]]:
        ask = command.ask
        tpm, rpm, _ = limits_of(ask.budget)
        member = self.member(ask.request) if ask.leased else ""
        return list(bucket_keys(ask.group, ask.tenant)), settle_args(
            tpm, rpm, command.correction, member
        )

    # -- failures ----------------------------------------------------------------------------

    def failed(self, what: str, exc: BaseException) -> None:
        """Count a failed operation, mark the store down for ``DOWN_FOR`` seconds, and log
        it, at most once per ``LOG_EVERY`` seconds."""
        driver = self.budgets.driver
        driver.core.measurements.fleet_store_errors += 1
        now = trio.current_time()
        self.down_until = now + DOWN_FOR
        self.down = True
        if now - self.logged_at < LOG_EVERY:
            self.unlogged += 1
            return
        self.logged_at = now
        fields = {"store": redacted(self.url), "operation": what, "error": _describe(exc)}
        if self.unlogged:
            fields["unlogged_before"] = str(self.unlogged)
        self.unlogged = 0
        driver.log(Log(event="fleet_budget_store_error", fields=fields))

    def recovered(self) -> None:
        self.down_until = -math.inf
        if self.down:
            self.down = False
            fields = {"store": redacted(self.url), "replicas": str(self.replicas)}
            self.budgets.driver.log(Log(event="fleet_budget_store_recovered", fields=fields))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return f"no answer within {RESERVE_TIMEOUT * 1000:.0f} ms"
    return repr(exc)[:200]


class FleetBudgets:
    """The driver's fleet stores for budgets, by URL, started on their first command."""

    def __init__(self, driver: StoreHost) -> None:
        self.driver = driver
        self.me = replica_id()
        self.stores: dict[str, _Store] = {}

    def start(self, url: str) -> None:
        """Begin the heartbeat of ``url`` now (this replica counts from its start)."""
        self._store(url)

    def _store(self, url: str) -> _Store:
        store = self.stores.get(url)
        if store is None:
            store = self.stores[url] = _Store(self, url)
            self.driver.nursery.start_soon(store.run)
        return store

    def reserve(self, command: BudgetReserve) -> None:
        self.driver.nursery.start_soon(self._store(command.store).reserve, command)

    def settle(self, command: BudgetSettle) -> None:
        self._store(command.store).settle(command)
