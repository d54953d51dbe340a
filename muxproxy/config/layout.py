"""The layout of a configuration file: its tables, the keys each takes, and where a key given
in the wrong table belongs.

Each :class:`Table` holds the :class:`~.checker.Key` mapping the loader checks that table with
(:mod:`.sections`, :mod:`.upstreams`, :mod:`.stickykeys`, :mod:`.admin`, :mod:`.logs`,
:mod:`.fleetkeys`), so a key added there is here at once; the record its keys become gives
the reference their defaults and docstrings (:mod:`.keydocs`).

:func:`placement` is the hint for a key given in the wrong table (``first_token`` under
``[timeouts]`` belongs under ``[upstreams.NAME.timeouts]``). :mod:`.loading` hands it to its
:class:`~.checker.Checker`, so the imports run one way: checker, then the checking modules,
then this layout, then the loading that reads it, and the reference (:mod:`.keydocs`,
:mod:`.reference`) above it all. Nothing below imports this module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from typing import Any

import attrs

from muxproxy.config.admin import _ADMIN_KEYS
from muxproxy.config.checker import Key
from muxproxy.config.discovery import Discover
from muxproxy.config.extensionkeys import EXTENSION_KEYS
from muxproxy.config.extensions import ExtensionConfig
from muxproxy.config.fleet import FleetSettings, ResolverSettings
from muxproxy.config.fleetkeys import FLEET_KEYS, RESOLVER_KEYS
from muxproxy.config.kveventkeys import KV_EVENTS_KEYS
from muxproxy.config.kvevents import KvEvents
from muxproxy.config.logs import _LOG_KEYS
from muxproxy.config.logsettings import LogSettings
from muxproxy.config.modelkeys import ALIAS_KEYS, TARGET_KEYS
from muxproxy.config.queue import AdmissionQueue
from muxproxy.config.queuekeys import _QUEUE_KEYS
from muxproxy.config.records import (
    AdminSettings,
    GroupTimeouts,
    HealthCheck,
    Limits,
    Listener,
    LoadReporting,
    ModelAlias,
    ModelTarget,
    NextUpstream,
    PrefixAffinity,
    RateLimit,
    Resume,
    Route,
    Server,
    Sticky,
    StickyCookie,
    Timeouts,
    Upstream,
)
from muxproxy.config.sections import (
    LIMITS_KEYS,
    LISTENER_KEYS,
    RESUME_KEYS,
    ROUTE_KEYS,
    TIMEOUTS_KEYS,
)
from muxproxy.config.stickykeys import _COOKIE_KEYS, _STICKY_KEYS
from muxproxy.config.telemetry import TelemetrySettings
from muxproxy.config.telemetrykeys import TELEMETRY_KEYS
from muxproxy.config.upstreams import (
    _DISCOVER_KEYS,
    _GROUP_TIMEOUTS_KEYS,
    _HEALTH_CHECK_KEYS,
    _LOAD_REPORT_KEYS,
    _NEXT_UPSTREAM_KEYS,
    _PREFIX_KEYS,
    _RATE_LIMIT_KEYS,
    _SERVER_KEYS,
    _UPSTREAM_KEYS,
)

__all__ = ["GROUP", "SUB_TABLES", "TABLES", "Table", "placement", "table_pattern", "tables"]


@attrs.frozen
class Table:
    """One kind of table in a configuration file."""

    path: str
    """Its key path as :func:`explain` takes it: ``upstreams.NAME.sticky``; ``[]`` marks an
    array of tables (``listeners[]``, ``upstreams.NAME.servers[]``)."""
    heading: str
    """How it is written in a file: ``[upstreams.NAME.sticky]``, ``[[listeners]]``."""
    record: type[Any]
    """The record its keys become (:mod:`.records`): defaults and docstrings."""
    keys: Mapping[str, Key]
    """What the loader checks its keys with."""
    summary: str
    example_head: str
    """The lines an example of one of its keys starts with (the table heading, or the
    array element it sits in)."""

    @property
    def anchor(self) -> str:
        return self.path.replace("[]", "").replace(".", "-").lower()


GROUP = "upstreams.NAME"

TABLES = (
    Table(
        "listeners[]",
        "[[listeners]]",
        Listener,
        LISTENER_KEYS,
        "Where clients connect: one table per listening address. At least one is required.",
        "[[listeners]]",
    ),
    Table(
        "timeouts",
        "[timeouts]",
        Timeouts,
        TIMEOUTS_KEYS,
        "Deadlines for every group and client, in seconds. A group's own"
        " `[upstreams.NAME.timeouts]` win over `connect`, `response_head` and `read`.",
        "[timeouts]",
    ),
    Table(
        "limits",
        "[limits]",
        Limits,
        LIMITS_KEYS,
        "Bounds on what one client, stream or process may make the proxy hold or do. Each"
        " answers an attack or a failure mode; see `docs/operations.md` for which.",
        "[limits]",
    ),
    Table(
        GROUP,
        "[upstreams.NAME]",
        Upstream,
        _UPSTREAM_KEYS,
        "A group of backends (GPU servers) that serve the same model. `NAME` is yours to"
        " choose; routes name it. At least one group is required.",
        "[upstreams.gpus]",
    ),
    Table(
        f"{GROUP}.servers[]",
        "upstreams.NAME.servers = [{ address = ... }]",
        Server,
        _SERVER_KEYS,
        'One backend of a group: a `"host:port"` string, or an inline table with `address`'
        " and any of these keys.",
        "[upstreams.gpus]",
    ),
    Table(
        f"{GROUP}.discover",
        "upstreams.NAME.discover = { dns = ..., port = ... }",
        Discover,
        _DISCOVER_KEYS,
        "The group's servers found in DNS instead of listed (`docs/fleet.md`): `dns` (A and"
        " AAAA records, with `port`) or `srv` (SRV records), and the settings of a server"
        " (`servers[]`) that every discovered one gets.",
        "[upstreams.gpus]",
    ),
    Table(
        f"{GROUP}.sticky",
        "[upstreams.NAME.sticky]",
        Sticky,
        _STICKY_KEYS,
        "Session stickiness: requests of one conversation go to one server, whose KV cache"
        " holds it (`docs/balancing.md`).",
        "[upstreams.gpus.sticky]",
    ),
    Table(
        f"{GROUP}.sticky.cookie",
        "[upstreams.NAME.sticky.cookie]",
        StickyCookie,
        _COOKIE_KEYS,
        "A cookie naming the chosen server by an opaque id, like nginx's `sticky cookie`.",
        "[upstreams.gpus.sticky.cookie]",
    ),
    Table(
        f"{GROUP}.next_upstream",
        "[upstreams.NAME.next_upstream]",
        NextUpstream,
        _NEXT_UPSTREAM_KEYS,
        "Failover: when a request is tried again on the next server. Only before any byte"
        " of the response reached the client, so a retry is never seen.",
        "[upstreams.gpus.next_upstream]",
    ),
    Table(
        f"{GROUP}.health_check",
        "[upstreams.NAME.health_check]",
        HealthCheck,
        _HEALTH_CHECK_KEYS,
        "Active health checks: a periodic `GET` to every server of the group.",
        "[upstreams.gpus.health_check]",
    ),
    Table(
        f"{GROUP}.timeouts",
        "[upstreams.NAME.timeouts]",
        GroupTimeouts,
        _GROUP_TIMEOUTS_KEYS,
        "This group's deadlines, in seconds; a key not set here falls back to `[timeouts]`.",
        "[upstreams.gpus.timeouts]",
    ),
    Table(
        f"{GROUP}.prefix",
        "[upstreams.NAME.prefix]",
        PrefixAffinity,
        _PREFIX_KEYS,
        'What `affinity = "prefix"` keys on (`docs/balancing.md`).',
        "[upstreams.gpus.prefix]",
    ),
    Table(
        f"{GROUP}.load_report",
        "[upstreams.NAME.load_report]",
        LoadReporting,
        _LOAD_REPORT_KEYS,
        "Poll each server's Prometheus endpoint for the engine's own load: vLLM's"
        " `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`;"
        " SGLang's `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`.",
        "[upstreams.gpus.load_report]",
    ),
    Table(
        f"{GROUP}.kv_events",
        "[upstreams.NAME.kv_events]",
        KvEvents,
        KV_EVENTS_KEYS,
        "Follow each engine's KV-cache events (vLLM's `--kv-events-config`) and place a"
        " prompt on the engine holding the most of it, within the bounds of `affinity ="
        ' "prefix"` (`docs/balancing.md`).',
        "[upstreams.gpus.kv_events]",
    ),
    Table(
        f"{GROUP}.queue",
        "[upstreams.NAME.queue]",
        AdmissionQueue,
        _QUEUE_KEYS,
        "Admission control: where requests wait, fairly between tenants, while every"
        " candidate server is full (`max_streams`, `max_waiting`).",
        "[upstreams.gpus.queue]",
    ),
    Table(
        f"{GROUP}.rate_limit",
        "[upstreams.NAME.rate_limit]",
        RateLimit,
        _RATE_LIMIT_KEYS,
        "Per-tenant budgets, refilled over a minute. A request over budget gets 429 with"
        " `Retry-After` and OpenAI-style `x-ratelimit-*` headers.",
        "[upstreams.gpus.rate_limit]",
    ),
    Table(
        "routes[]",
        "[[routes]]",
        Route,
        ROUTE_KEYS,
        "Which group serves a request, by the longest matching path prefix. With a single"
        ' group and no routes, everything goes to it (`prefix = "/"`).',
        "[[routes]]",
    ),
    Table(
        "routes[].resume",
        "[[routes]] resume = { ... }",
        Resume,
        RESUME_KEYS,
        "`resume = true` (these defaults) or a table: SSE streams that survive a reconnect"
        " with `Last-Event-ID` (`docs/resume.md`).",
        "[[routes]]",
    ),
    Table(
        "models.NAME",
        "[models.NAME]",
        ModelAlias,
        ALIAS_KEYS,
        "A model alias: a name clients send in the body's `model` that the proxy resolves to"
        " one of its targets by weight, sticky per conversation (`docs/models.md`).",
        '[models."chat-default"]',
    ),
    Table(
        "models.NAME.targets[]",
        "[models.NAME] targets = [{ ... }]",
        ModelTarget,
        TARGET_KEYS,
        "One model an alias stands for, and its share of new conversations.",
        '[models."chat-default"]',
    ),
    Table(
        "log",
        "[log]",
        LogSettings,
        _LOG_KEYS,
        "The access log (one line per request, on by default) and the error log.",
        "[log]",
    ),
    Table(
        "admin",
        "[admin]",
        AdminSettings,
        _ADMIN_KEYS,
        "The admin API (`docs/operations.md`): status, runtime weights, drain, reload,"
        " Prometheus `/metrics`. Without this table there is no admin listener.",
        "[admin]",
    ),
    Table(
        "resolver",
        "[resolver]",
        ResolverSettings,
        RESOLVER_KEYS,
        "The DNS servers that groups with `discover` ask (`docs/fleet.md`).",
        "[resolver]",
    ),
    Table(
        "fleet",
        "[fleet]",
        FleetSettings,
        FLEET_KEYS,
        "One runtime state, session memory and set of budgets for every replica, through"
        " Redis (`docs/fleet.md`). Without this table each replica keeps its own.",
        "[fleet]",
    ),
    Table(
        "extensions[]",
        "[[extensions]]",
        ExtensionConfig,
        EXTENSION_KEYS,
        "Extension hooks (`docs/extending.md`): Python classes that may answer, rewrite or"
        " route a request, pick its server and see its events. They run in configuration"
        " order.",
        "[[extensions]]",
    ),
    Table(
        "telemetry",
        "[telemetry]",
        TelemetrySettings,
        TELEMETRY_KEYS,
        "OpenTelemetry (`docs/telemetry.md`): a span per request and the GenAI metrics, sent"
        " to a collector over OTLP/HTTP. Needs the optional extra `otel`. Without this"
        " table nothing is exported.",
        "[telemetry]",
    ),
)

SUB_TABLES = {
    f"{GROUP}.servers": f"{GROUP}.servers[]",
    f"{GROUP}.discover": f"{GROUP}.discover",
    f"{GROUP}.sticky": f"{GROUP}.sticky",
    f"{GROUP}.sticky.cookie": f"{GROUP}.sticky.cookie",
    f"{GROUP}.next_upstream": f"{GROUP}.next_upstream",
    f"{GROUP}.health_check": f"{GROUP}.health_check",
    f"{GROUP}.timeouts": f"{GROUP}.timeouts",
    f"{GROUP}.prefix": f"{GROUP}.prefix",
    f"{GROUP}.load_report": f"{GROUP}.load_report",
    f"{GROUP}.kv_events": f"{GROUP}.kv_events",
    f"{GROUP}.queue": f"{GROUP}.queue",
    f"{GROUP}.rate_limit": f"{GROUP}.rate_limit",
    "routes[].resume": "routes[].resume",
    "models.NAME.targets": "models.NAME.targets[]",
}
"""Keys whose value is a table of its own: key path -> that table's path."""


@cache
def tables() -> tuple[Table, ...]:
    return TABLES


# -- placement hints and --explain --


_GROUP_IN_PATH = re.compile(r'\Aupstreams\.("(?:[^"\\]|\\.)*"|[A-Za-z0-9_-]+)')
_INDEX = re.compile(r"\[[0-9]*\]")


def table_pattern(path: str) -> tuple[str, str | None]:
    """A concrete key path as its table pattern, and the group name it had:
    ``upstreams.gpus.servers[1]`` -> (``upstreams.NAME.servers[]``, ``gpus``)."""
    group = None
    match = _GROUP_IN_PATH.match(path)
    if match is not None:
        group = match[1]
        path = GROUP + path[match.end() :]
    return _INDEX.sub("[]", path), group


def placement(key: str, path: str) -> str | None:
    """Where ``key``, unknown in the table at ``path``, belongs instead; None when it is in no
    other table, or in too many for a pointer to help (``path``, ``name``)."""
    here, group = table_pattern(path)
    homes = [table for table in TABLES if key in table.keys and table.path != here]
    if not here.startswith(GROUP):  # a listener's "port" is no DNS lookup's, nor an engine's
        homes = [table for table in homes if not table.path.endswith((".discover", ".kv_events"))]
    if not here.startswith("models."):  # a server's "weight" is no alias target's
        homes = [table for table in homes if not table.path.startswith("models.")]
    if not homes or len(homes) > 2:
        return None
    places = " or ".join(_place(table, group, key) for table in homes)
    return f'"{key}" belongs in {places}'


def _place(table: Table, group: str | None, key: str) -> str:
    heading = table.heading.replace("NAME", group) if group is not None else table.heading
    if table.path.endswith(".servers[]"):
        name = group if group is not None else "NAME"
        return f'a server\'s table: upstreams.{name}.servers = [{{ address = "...", {key} = ... }}]'
    return heading
