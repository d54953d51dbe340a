"""The record of a group's ``discover`` table: its servers found in DNS, not listed.

A leaf module (no import from the rest of :mod:`muxproxy.config`), so :mod:`.records` can
name :class:`Discover` in :class:`~muxproxy.config.records.Upstream`; the checks are in
:mod:`.discoverykeys`, the decision (a DNS answer against the servers known) in
:mod:`muxproxy.fleet.discovery`, the lookups in :mod:`muxproxy.trio.discovery`.

A discovered server has the settings a listed one has (``servers[]``), except ``address``
(from the answer) and ``backup`` (from SRV priorities): the keys are in the same table, so
``discover = { dns = "vllm.llm.svc.cluster.local", port = 8000, protocol = "h2" }``.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["Discover", "RecordKind"]


class RecordKind(enum.Enum):
    """What a ``discover`` table looks up."""

    ADDRESS = "dns"
    """A and AAAA records (RFC 1035 §3.4.1, RFC 3596): every address, at ``port``."""
    SRV = "srv"
    """SRV records (RFC 2782): targets with their ports, weights and priorities."""


@attrs.frozen(kw_only=True)
class Discover:
    """``upstreams.NAME.discover``: the group's servers are what a DNS name resolves to."""

    dns: str | None = None
    """A name whose A and AAAA records are the servers (a Kubernetes headless Service:
    ``vllm.llm.svc.cluster.local``); needs ``port``. Exactly one of ``dns`` and ``srv``."""
    srv: str | None = None
    """A name whose SRV records are the servers (``_http._tcp.vllm.llm.svc.cluster.local``):
    each target's addresses at the record's port, with the record's weight (0 counts as 1);
    targets of a priority above the lowest are backups (RFC 2782)."""
    port: int | None = None
    """The servers' port, with ``dns`` (SRV records carry their own)."""
    interval: float = 5.0
    """Seconds between lookups; a record's TTL, when shorter, re-resolves sooner (never
    more often than once a second)."""
    weight: int = 1
    """With ``dns``: each address's weight (``servers[].weight``)."""
    max_fails: int = 1
    """As ``servers[].max_fails``, for each discovered server."""
    fail_timeout: float = 10.0
    """As ``servers[].fail_timeout``, for each discovered server."""
    protocol: str = "h1"
    """As ``servers[].protocol``: ``"h1"`` or ``"h2"``, for each discovered server."""
    max_connections: int = 4
    """As ``servers[].max_connections``, for each discovered server."""
    tls: bool = False
    """As ``servers[].tls``, for each discovered server."""
    tls_ca: str | None = None
    """As ``servers[].tls_ca``, for each discovered server."""
    tls_server_name: str | None = None
    """As ``servers[].tls_server_name``; None: the name looked up (``dns``) or the SRV
    record's target (an address is no name a certificate holds)."""
    max_streams: int | None = None
    """As ``servers[].max_streams``, for each discovered server."""
    max_waiting: int | None = None
    """As ``servers[].max_waiting``, for each discovered server."""

    @property
    def kind(self) -> RecordKind:
        return RecordKind.ADDRESS if self.dns is not None else RecordKind.SRV

    @property
    def name(self) -> str:
        """The name looked up."""
        name = self.dns if self.dns is not None else self.srv
        assert name is not None, "the loader requires dns or srv"
        return name
