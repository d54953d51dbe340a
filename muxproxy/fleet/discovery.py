"""Discovery's decision: the servers a group knows, and a DNS lookup's outcome, in; the new
set, what changed and when to look again, out.

Pure (no Trio, no sockets, no clock: time is ``now``, the driver's); the lookups are
:mod:`muxproxy.trio.discovery`'s. The rules, as an operator of an engine fleet needs them:

- An answer with records is the group's servers from then on: an address that appears
  *joins* (it ramps in over the group's ``slow_start``, ``routing/router.py``), one that is
  gone *leaves* (no new conversation goes there; streams in flight finish on the router that
  began them; its remembered sessions move as a ``down`` server's do).
- A failed lookup (timeout, refused, SERVFAIL, NXDOMAIN) and an answer without records
  (NOERROR, NODATA: RFC 2308 §2.2) change nothing: the last good set stays, so a group never
  empties because DNS failed. A fleet scaled to nothing is better said by weights or drain
  than by DNS, which cannot tell it from an outage.
- The next lookup is due after the group's ``interval`` or the answer's TTL, whichever is
  shorter (RFC 1035 §3.2.1: TTL is how long a record may be cached), but never sooner than
  :data:`MIN_INTERVAL` (a TTL of 0, as some DNS servers give, must not become a busy loop).
  After a failure, sooner: :data:`MIN_INTERVAL` doubled per failure in a row, up to
  ``interval``.
- SRV records (RFC 2782): each target's addresses at the record's port; a weight of 0 counts
  as 1 (the RFC's "very small chance", not our "drained"); the lowest priority holds the
  primaries, higher ones are backups (used when no primary is usable). A target found in
  several records keeps the first one's port, weight and priority.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs

from muxproxy.config import Config, Server
from muxproxy.config.discovery import Discover

__all__ = [
    "MIN_INTERVAL",
    "Answer",
    "Change",
    "Decision",
    "Failure",
    "Known",
    "LookupResult",
    "Member",
    "Target",
    "decide",
    "host_port",
    "servers_of",
    "srv_targets",
    "with_discovered",
]

MIN_INTERVAL = 1.0
"""Seconds between two lookups of one name, at least, whatever the TTL."""


class LookupResult(enum.Enum):
    """How a lookup ended (the ``result`` label of ``muxproxy_discovery_lookups_total``)."""

    OK = "ok"
    EMPTY = "empty"
    """NOERROR without records of the type asked (RFC 2308 §2.2, NODATA)."""
    NXDOMAIN = "nxdomain"
    """The name does not exist (RFC 8020)."""
    TIMEOUT = "timeout"
    ERROR = "error"
    """Refused, SERVFAIL, no nameserver reachable, a malformed answer."""


@attrs.frozen(kw_only=True)
class Target:
    """One server an answer names."""

    address: str
    """``host:port`` (``[v6]:port``), as a listed server's."""
    weight: int | None = None
    """From an SRV record; None: the ``discover`` table's ``weight``."""
    backup: bool = False
    """An SRV record of a priority above the answer's lowest."""
    name: str | None = None
    """The name whose records gave the address (the SRV target, or the name looked up): the
    TLS server name when ``tls_server_name`` is not set."""


@attrs.frozen(kw_only=True)
class Answer:
    """A lookup that came back with records (maybe none of the type asked: :data:`EMPTY`)."""

    targets: tuple[Target, ...]
    ttl: float | None = None
    """The smallest TTL of the records, in seconds; None: not known."""


@attrs.frozen(kw_only=True)
class Failure:
    """A lookup that gave no usable answer."""

    result: LookupResult
    reason: str
    """For the log and ``/status``: what went wrong, in words."""


@attrs.frozen(kw_only=True)
class Member:
    target: Target
    joined: float
    """When it joined (the driver's clock)."""


@attrs.frozen(kw_only=True)
class Known:
    """What discovery knows of one group: its servers and how its lookups went."""

    members: tuple[Member, ...] = ()
    """The last good set, in address order."""
    last_success: float | None = None
    last_error: str | None = None
    last_error_at: float | None = None
    failures: int = 0
    """Failed lookups in a row since the last good one."""

    @property
    def targets(self) -> tuple[Target, ...]:
        return tuple(member.target for member in self.members)


@attrs.frozen(kw_only=True)
class Change:
    joined: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    """Addresses that stayed with another weight, priority or name."""

    def __bool__(self) -> bool:
        return bool(self.joined or self.left or self.changed)


@attrs.frozen(kw_only=True)
class Decision:
    known: Known
    change: Change
    result: LookupResult
    next_lookup: float
    """When to look up again (the driver's clock)."""


def decide(known: Known, outcome: Answer | Failure, now: float, interval: float) -> Decision:
    """The group's new state after ``outcome`` (see the module header for the rules)."""
    if isinstance(outcome, Failure) or not outcome.targets:
        if isinstance(outcome, Failure):
            result, reason = outcome.result, outcome.reason
        else:
            result, reason = LookupResult.EMPTY, "the answer has no records"
        failures = known.failures + 1
        state = attrs.evolve(known, last_error=reason, last_error_at=now, failures=failures)
        wait = min(interval, MIN_INTERVAL * 2 ** min(failures - 1, 16))
        return Decision(
            known=state, change=Change(), result=result, next_lookup=now + max(wait, MIN_INTERVAL)
        )
    before = {member.target.address: member for member in known.members}
    members: list[Member] = []
    joined: list[str] = []
    changed: list[str] = []
    for target in _unique(outcome.targets):
        old = before.get(target.address)
        if old is None:
            joined.append(target.address)
            members.append(Member(target=target, joined=now))
        else:
            if old.target != target:
                changed.append(target.address)
            members.append(Member(target=target, joined=old.joined))
    members.sort(key=lambda member: member.target.address)
    present = {member.target.address for member in members}
    left = sorted(address for address in before if address not in present)
    wait = interval if outcome.ttl is None else min(interval, outcome.ttl)
    state = Known(
        members=tuple(members),
        last_success=now,
        last_error=known.last_error,
        last_error_at=known.last_error_at,
        failures=0,
    )
    return Decision(
        known=state,
        change=Change(joined=tuple(sorted(joined)), left=tuple(left), changed=tuple(changed)),
        result=LookupResult.OK,
        next_lookup=now + max(wait, MIN_INTERVAL),
    )


def _unique(targets: Sequence[Target]) -> list[Target]:
    seen: dict[str, Target] = {}
    for target in targets:
        seen.setdefault(target.address, target)
    return list(seen.values())


def servers_of(discover: Discover, targets: Sequence[Target]) -> tuple[Server, ...]:
    """The servers of a group whose ``discover`` table is ``discover``, for ``targets``."""
    out = []
    for target in targets:
        server_name = discover.tls_server_name
        if server_name is None and discover.tls:
            server_name = (target.name or discover.name).removesuffix(".")
        out.append(
            Server(
                address=target.address,
                weight=discover.weight if target.weight is None else target.weight,
                backup=target.backup,
                max_fails=discover.max_fails,
                fail_timeout=discover.fail_timeout,
                protocol=discover.protocol,
                max_connections=discover.max_connections,
                tls=discover.tls,
                tls_ca=discover.tls_ca,
                tls_server_name=server_name,
                max_streams=discover.max_streams,
                max_waiting=discover.max_waiting,
            )
        )
    return tuple(out)


def with_discovered(config: Config, discovered: Mapping[str, Sequence[Target]]) -> Config:
    """``config`` with each discovering group's servers made from its last good set in
    ``discovered`` (group name -> targets); a group not in ``discovered`` is left as it is.

    A configuration read again from its file has no servers in such a group: this puts the
    set back (a reload must not empty a group until DNS answers again), built with the
    ``discover`` table as the file has it now. Groups that list their servers are as they
    are. Returns ``config`` itself when nothing changes."""
    groups = dict(config.upstreams)
    changed = False
    for name, group in config.upstreams.items():
        if group.discover is None or name not in discovered:
            continue
        servers = servers_of(group.discover, discovered[name])
        if servers != group.servers:
            groups[name] = attrs.evolve(group, servers=servers)
            changed = True
    return attrs.evolve(config, upstreams=groups) if changed else config


def srv_targets(
    records: Sequence[tuple[int, int, int, str]], addresses: Mapping[str, Sequence[str]]
) -> tuple[Target, ...]:
    """The targets of SRV ``records`` (priority, weight, port, target name), each target
    name's ``addresses`` (its A and AAAA records) at the record's port (RFC 2782)."""
    if not records:
        return ()
    lowest = min(priority for priority, _, _, _ in records)
    out: list[Target] = []
    for priority, weight, port, name in records:
        for host in addresses.get(name, ()):
            out.append(
                Target(
                    address=host_port(host, port),
                    weight=max(weight, 1),
                    backup=priority > lowest,
                    name=name,
                )
            )
    return tuple(out)


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (RFC 3986 §3.2.2)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
