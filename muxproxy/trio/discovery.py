"""Discovery's I/O: DNS lookups of the groups with ``discover``, on Trio, with dnspython's
async resolver; the decisions are :mod:`muxproxy.fleet.discovery`'s.

One :class:`Discovery` per replica: in the process of ``muxproxy serve``, or in the
supervisor of ``--workers N``, which hands each new set to its workers (so every worker
routes over the same servers and one lookup serves them all). Each group is looked up when
its decision says (``interval``, the TTL, backing off after failures), one lookup at a time
per group, every group in its own task so a slow name never delays another's.

What a lookup asks (RFC 1035 §3.2.2, RFC 3596 §2.1, RFC 2782): ``dns``: A and AAAA records
of the name, both asked (a name may have either or both; one type without records is no
failure while the other has some); ``srv``: SRV records, then A and AAAA records of each
target. The resolver is ``[resolver]``'s: its nameservers (with ports), ``timeout`` for a
whole lookup and ``attempts`` tries within it; no cache (a TTL-driven re-lookup wants the
DNS server's current answer, not ours).

What is applied: after each lookup that changed a set, ``apply`` gets every group's last
good set (group name -> targets); the caller makes them the configuration's servers
(``fleet.discovery.with_discovered``) and the core reconfigures (``ConfigChanged``: state
of kept servers stays, new ones ramp in, vanished ones drain). A failed lookup applies
nothing. Errors are logged at most once per :data:`ERROR_LOG_INTERVAL` per group, with the
number of failures in between; joins and departures always.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from muxproxy.config import Config
from muxproxy.config.discovery import Discover, RecordKind
from muxproxy.config.fleet import ResolverSettings
from muxproxy.core.observe.series import DISCOVERY_METRICS, PREFIX, SNAPSHOT_FORMAT
from muxproxy.fleet.discovery import (
    Answer,
    Failure,
    Known,
    LookupResult,
    Target,
    decide,
    host_port,
    srv_targets,
)

if TYPE_CHECKING:
    # dnspython is imported when a group discovers (it loads much, ``email`` included): a
    # proxy without ``discover`` never holds it (``tests/test_cli.py``).
    import dns.asyncresolver

__all__ = ["ERROR_LOG_INTERVAL", "Discovery", "lookup", "make_resolver", "with_discovery"]

log = logging.getLogger("muxproxy")

ERROR_LOG_INTERVAL = 60.0
"""Seconds between two logged lookup failures of one group (the others are counted)."""

Sets = Mapping[str, tuple[Target, ...]]
"""Group name -> its last good set."""


def make_resolver(settings: ResolverSettings) -> dns.asyncresolver.Resolver:
    """A resolver for ``[resolver]``: its nameservers, or the system's when none is set."""
    import dns.asyncresolver
    import dns.nameserver

    resolver = dns.asyncresolver.Resolver(configure=not settings.nameservers)
    if settings.nameservers:
        servers: list[str | dns.nameserver.Nameserver] = []
        for entry in settings.nameservers:
            host, _, port = entry.rpartition(":")
            servers.append(dns.nameserver.Do53Nameserver(host.strip("[]"), int(port)))
        resolver.nameservers = servers
    resolver.lifetime = settings.timeout
    resolver.timeout = settings.timeout / settings.attempts
    resolver.cache = None
    return resolver


async def lookup(resolver: dns.asyncresolver.Resolver, discover: Discover) -> Answer | Failure:
    """Ask DNS for ``discover``'s servers; never raises for what DNS answers or fails to."""
    import dns.exception
    import dns.resolver

    try:
        if discover.kind is RecordKind.SRV:
            return await _srv(resolver, discover.name)
        assert discover.port is not None
        hosts, ttl = await _addresses(resolver, discover.name)
        name = discover.name
        targets = tuple(Target(address=host_port(h, discover.port), name=name) for h in hosts)
        return Answer(targets=targets, ttl=ttl)
    except dns.resolver.NXDOMAIN:
        return Failure(result=LookupResult.NXDOMAIN, reason=f"{discover.name}: no such name")
    except dns.resolver.LifetimeTimeout:
        return Failure(
            result=LookupResult.TIMEOUT,
            reason=f"{discover.name}: no answer within {resolver.lifetime:g}s",
        )
    except dns.exception.DNSException as exc:
        return Failure(result=LookupResult.ERROR, reason=f"{discover.name}: {exc}")


async def _addresses(
    resolver: dns.asyncresolver.Resolver, name: str
) -> tuple[list[str], float | None]:
    """The A and AAAA addresses of ``name`` and their smallest TTL. Raises NXDOMAIN,
    timeouts and errors; a type without records is none of those."""
    import dns.rdatatype
    import dns.resolver

    hosts: list[str] = []
    ttl: float | None = None
    for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
        try:
            answer = await resolver.resolve(name, rdtype, search=False)
        except dns.resolver.NoAnswer:
            continue
        if answer.rrset is None:
            continue
        hosts += [record.address for record in answer.rrset]
        ttl = answer.rrset.ttl if ttl is None else min(ttl, answer.rrset.ttl)
    return hosts, ttl


async def _srv(resolver: dns.asyncresolver.Resolver, name: str) -> Answer:
    import dns.rdatatype
    import dns.resolver

    try:
        answer = await resolver.resolve(name, dns.rdatatype.SRV, search=False)
    except dns.resolver.NoAnswer:
        return Answer(targets=())
    assert answer.rrset is not None
    ttl: float = answer.rrset.ttl
    records = [(r.priority, r.weight, r.port, r.target.to_text()) for r in answer.rrset if r.port]
    addresses: dict[str, list[str]] = {}
    for target in {record[3] for record in records}:
        try:
            addresses[target], target_ttl = await _addresses(resolver, target)
        except dns.resolver.NXDOMAIN:
            continue  # one target gone: the others are still an answer
        if target_ttl is not None:
            ttl = min(ttl, target_ttl)
    return Answer(targets=srv_targets(records, addresses), ttl=ttl)


Lookup = Callable[[Discover], Awaitable[Answer | Failure]]


class Discovery:
    """The lookups of every discovering group of the configuration ``config()`` returns.

    ``apply(sets)`` is awaited after each change with every group's last good set.
    ``config`` is read again before each lookup, so a reload's ``discover`` tables apply
    from the next lookup on (:meth:`wake` makes it now).
    """

    def __init__(
        self,
        config: Callable[[], Config],
        apply: Callable[[Sets], Awaitable[None]],
        *,
        lookup_with: Lookup | None = None,
    ) -> None:
        self._config = config
        self._apply = apply
        self._lookup = lookup_with
        self._resolver_settings: ResolverSettings | None = None
        self._resolver: dns.asyncresolver.Resolver | None = None
        self.known: dict[str, Known] = {}
        self.names: dict[str, str] = {}
        """Group -> the name it looked up last."""
        self.lookups: Counter[tuple[str, str]] = Counter()
        """(group, result) -> lookups so far."""
        self._due: dict[str, float] = {}
        self._wake = trio.Event()
        self._logged_at: dict[str, float] = {}
        self._unlogged: Counter[str] = Counter()

    # -- what it knows ---------------------------------------------------------------------

    def sets(self) -> dict[str, tuple[Target, ...]]:
        """Each group's last good set (groups not yet answered are absent)."""
        return {g: k.targets for g, k in self.known.items() if k.last_success is not None}

    def groups(self) -> dict[str, Discover]:
        return {
            name: group.discover
            for name, group in self._config().upstreams.items()
            if group.discover is not None
        }

    def status(self, now: float) -> dict[str, dict[str, Any]]:
        """Per discovering group, for ``/status``: the name looked up, the addresses, the
        age of the last good lookup and the last error (with its age)."""
        out: dict[str, dict[str, Any]] = {}
        for name, discover in self.groups().items():
            known = self.known.get(name, Known())
            out[name] = {
                "name": discover.name,
                "records": discover.kind.value,
                "addresses": [m.target.address for m in known.members],
                "last_success_age": _age(now, known.last_success),
                "last_error": known.last_error,
                "last_error_age": _age(now, known.last_error_at),
                "failures": known.failures,
                "next_lookup_in": _age(self._due.get(name), now),
            }
        return out

    def snapshot(self, now: float) -> dict[str, Any]:
        """The metrics of discovery, as a core snapshot holds them (``trio/metrics.py``)."""
        groups = self.groups()
        servers = [[[g], len(self.known.get(g, Known()).members)] for g in groups]
        ages = [
            [[g], round(now - k.last_success, 3)]
            for g in groups
            if (k := self.known.get(g)) is not None and k.last_success is not None
        ]
        lookups = [[list(key), n] for key, n in sorted(self.lookups.items())]
        samples = {
            "discovery_lookups_total": lookups,
            "discovery_servers": servers,
            "discovery_last_success_age_seconds": ages,
        }
        metrics = {}
        for name, values in samples.items():
            kind, labels, help_text = DISCOVERY_METRICS[name]
            metrics[PREFIX + name] = {
                "type": kind,
                "help": help_text,
                "labels": list(labels),
                "samples": values,
            }
        return {"format": SNAPSHOT_FORMAT, "metrics": metrics}

    # -- running ---------------------------------------------------------------------------

    def wake(self) -> None:
        """The configuration changed: look up every group now."""
        self._due.clear()
        woken, self._wake = self._wake, trio.Event()
        woken.set()

    async def first_round(self) -> None:
        """Look up every group once, together (bounded by the resolver's timeout), and
        apply what came back: called before serving, so the first requests have servers."""
        groups = self.groups()
        if not groups:
            return
        async with trio.open_nursery() as nursery:
            for name, discover in groups.items():
                nursery.start_soon(self._look_up, name, discover)
        if self.sets():
            await self._apply(self.sets())

    async def run(self) -> None:
        """Look up each group when due, until cancelled."""
        async with trio.open_nursery() as nursery:
            running: dict[str, trio.CancelScope] = {}
            while True:
                groups = self.groups()
                for name in list(running):
                    if name not in groups:
                        running.pop(name).cancel()
                        self.known.pop(name, None)
                for name in groups:
                    if name not in running:
                        running[name] = await nursery.start(self._group_loop, name)
                await self._wake.wait()

    async def _group_loop(
        self, name: str, *, task_status: trio.TaskStatus[trio.CancelScope]
    ) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            while True:
                discover = self.groups().get(name)
                if discover is None:
                    return
                due = self._due.get(name, -math.inf)
                if trio.current_time() >= due:
                    if await self._look_up(name, discover):
                        await self._apply(self.sets())
                    continue
                with trio.move_on_at(due):
                    await self._wake.wait()

    async def _look_up(self, name: str, discover: Discover) -> bool:
        """One lookup of ``name``'s group and its decision; True when its set changed."""
        if self.names.get(name) not in (None, discover.name):
            log.info("muxproxy: discovery: %s now looks up %s", name, discover.name)
        self.names[name] = discover.name
        outcome = await self._ask(discover)
        now = trio.current_time()
        decision = decide(self.known.get(name, Known()), outcome, now, discover.interval)
        self.known[name] = decision.known
        self._due[name] = decision.next_lookup
        self.lookups[(name, decision.result.value)] += 1
        if isinstance(outcome, Failure) or decision.result is not LookupResult.OK:
            self._log_failure(name, decision.known, now)
            return False
        change = decision.change
        if change.joined or change.left:
            log.info(
                "muxproxy: discovery: %s (%s): %d servers; joined: %s; left: %s",
                name,
                discover.name,
                len(decision.known.members),
                ", ".join(change.joined) or "none",
                ", ".join(change.left) or "none",
            )
        return bool(change)

    async def _ask(self, discover: Discover) -> Answer | Failure:
        if self._lookup is not None:
            return await self._lookup(discover)
        settings = self._config().resolver
        if self._resolver is None or settings != self._resolver_settings:
            self._resolver, self._resolver_settings = make_resolver(settings), settings
        # The resolver's lifetime bounds it; this bounds a resolver that would not stop.
        with trio.move_on_after(settings.timeout * 2 + 1):
            return await lookup(self._resolver, discover)
        return Failure(result=LookupResult.TIMEOUT, reason=f"{discover.name}: no answer")

    def _log_failure(self, name: str, known: Known, now: float) -> None:
        last = self._logged_at.get(name)
        if last is not None and now - last < ERROR_LOG_INTERVAL:
            self._unlogged[name] += 1
            return
        self._logged_at[name] = now
        more = self._unlogged.pop(name, 0)
        kept = len(known.members)
        log.warning(
            "muxproxy: discovery: %s: lookup failed: %s; keeping the last good set (%d servers)%s",
            name,
            known.last_error,
            kept,
            f"; {more} more failures since the last report" if more else "",
        )


def with_discovery(status: dict[str, Any], groups: Mapping[str, Any]) -> dict[str, Any]:
    """``status`` (``ProxyCore.status()``'s shape) with each discovering group's
    :meth:`Discovery.status` as its ``discovery``."""
    for name, entry in groups.items():
        group = status.setdefault("groups", {}).get(name)
        if isinstance(group, dict):
            group["discovery"] = entry
    return status


def _age(now: float | None, then: float | None) -> float | None:
    return None if now is None or then is None else round(now - then, 3)
