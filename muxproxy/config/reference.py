"""The configuration reference: every key ``muxproxy check`` accepts, with its type, default,
meaning and an example, built from the code that checks a configuration.

Nothing here is written twice:

- the keys of each table are the :class:`~.checker.Key` mappings the loader checks that table
  with (:mod:`.loading`, :mod:`.upstreams`, :mod:`.stickykeys`, :mod:`.admin`, :mod:`.logs`),
  so a key added there is in the reference at once;
- a key's default is its record field's default, and its text the field's docstring in
  :mod:`.records` (read with :mod:`ast`: attrs keeps no docstrings at run time);
- what a value looks like comes from the function that checks it (:data:`_VALUE_KINDS`), a
  number's range from :mod:`.ranges`; a new checking function without an entry fails.

``docs/configuration.md`` is :func:`render_markdown` (``scripts/config-reference`` writes it;
a test fails when it is out of date), ``muxproxy check --explain KEY`` prints
:func:`explain`, and :func:`placement` is the hint for a key given in the wrong table
(``first_token`` under ``[timeouts]`` belongs under ``[upstreams.NAME.timeouts]``).
"""

from __future__ import annotations

import ast
import difflib
import enum
import inspect
import itertools
import json
import re
import textwrap
from collections.abc import Iterator, Mapping
from functools import cache
from typing import Any

import attrs

from . import (
    admin,
    discovery,
    discoverykeys,
    fleet,
    fleetkeys,
    loading,
    logs,
    ranges,
    records,
    stickykeys,
    storeurl,
    upstreams,
)
from .checker import Checker, Key, alternatives

__all__ = ["Entry", "Table", "entries", "explain", "placement", "render_markdown", "tables"]


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


@attrs.frozen
class Entry:
    """One key of one table."""

    table: Table
    key: str
    kind: str
    """What its value looks like."""
    default: str
    """The default, as TOML text or a short phrase (``required``, ``not set``)."""
    doc: str
    """What it does (Markdown with ``code`` spans)."""
    example: str
    """A TOML example of the key in its table (checked to load by the reference's test)."""
    section: Table | None = None
    """The table this key holds, for a key whose value is a table of its own."""

    @property
    def path(self) -> str:
        return f"{self.table.path}.{self.key}"

    @property
    def anchor(self) -> str:
        """Dotted, unlike a table's: ``upstreams.name.timeouts`` (the key) is not
        ``upstreams-name-timeouts`` (its table)."""
        return self.path.replace("[]", "").lower()


_GROUP = "upstreams.NAME"

_TABLES = (
    Table(
        "listeners[]",
        "[[listeners]]",
        records.Listener,
        loading._LISTENER_KEYS,
        "Where clients connect: one table per listening address. At least one is required.",
        "[[listeners]]",
    ),
    Table(
        "timeouts",
        "[timeouts]",
        records.Timeouts,
        loading._TIMEOUTS_KEYS,
        "Deadlines for every group and client, in seconds. A group's own"
        " `[upstreams.NAME.timeouts]` win over `connect`, `response_head` and `read`.",
        "[timeouts]",
    ),
    Table(
        "limits",
        "[limits]",
        records.Limits,
        loading._LIMITS_KEYS,
        "Bounds on what one client, stream or process may make the proxy hold or do. Each"
        " answers an attack or a failure mode; see `docs/operations.md` for which.",
        "[limits]",
    ),
    Table(
        _GROUP,
        "[upstreams.NAME]",
        records.Upstream,
        upstreams._UPSTREAM_KEYS,
        "A group of backends (GPU servers) that serve the same model. `NAME` is yours to"
        " choose; routes name it. At least one group is required.",
        "[upstreams.gpus]",
    ),
    Table(
        f"{_GROUP}.servers[]",
        "upstreams.NAME.servers = [{ address = ... }]",
        records.Server,
        upstreams._SERVER_KEYS,
        'One backend of a group: a `"host:port"` string, or an inline table with `address`'
        " and any of these keys.",
        "[upstreams.gpus]",
    ),
    Table(
        f"{_GROUP}.discover",
        "upstreams.NAME.discover = { dns = ..., port = ... }",
        discovery.Discover,
        upstreams._DISCOVER_KEYS,
        "The group's servers found in DNS instead of listed (`docs/fleet.md`): `dns` (A and"
        " AAAA records, with `port`) or `srv` (SRV records), and the settings of a server"
        " (`servers[]`) that every discovered one gets.",
        "[upstreams.gpus]",
    ),
    Table(
        f"{_GROUP}.sticky",
        "[upstreams.NAME.sticky]",
        records.Sticky,
        stickykeys._STICKY_KEYS,
        "Session stickiness: requests of one conversation go to one server, whose KV cache"
        " holds it (`docs/balancing.md`).",
        "[upstreams.gpus.sticky]",
    ),
    Table(
        f"{_GROUP}.sticky.cookie",
        "[upstreams.NAME.sticky.cookie]",
        records.StickyCookie,
        stickykeys._COOKIE_KEYS,
        "A cookie naming the chosen server by an opaque id, like nginx's `sticky cookie`.",
        "[upstreams.gpus.sticky.cookie]",
    ),
    Table(
        f"{_GROUP}.next_upstream",
        "[upstreams.NAME.next_upstream]",
        records.NextUpstream,
        upstreams._NEXT_UPSTREAM_KEYS,
        "Failover: when a request is tried again on the next server. Only before any byte"
        " of the response reached the client, so a retry is never seen.",
        "[upstreams.gpus.next_upstream]",
    ),
    Table(
        f"{_GROUP}.health_check",
        "[upstreams.NAME.health_check]",
        records.HealthCheck,
        upstreams._HEALTH_CHECK_KEYS,
        "Active health checks: a periodic `GET` to every server of the group.",
        "[upstreams.gpus.health_check]",
    ),
    Table(
        f"{_GROUP}.timeouts",
        "[upstreams.NAME.timeouts]",
        records.GroupTimeouts,
        upstreams._GROUP_TIMEOUTS_KEYS,
        "This group's deadlines, in seconds; a key not set here falls back to `[timeouts]`.",
        "[upstreams.gpus.timeouts]",
    ),
    Table(
        f"{_GROUP}.prefix",
        "[upstreams.NAME.prefix]",
        records.PrefixAffinity,
        upstreams._PREFIX_KEYS,
        'What `affinity = "prefix"` keys on (`docs/balancing.md`).',
        "[upstreams.gpus.prefix]",
    ),
    Table(
        f"{_GROUP}.load_report",
        "[upstreams.NAME.load_report]",
        records.LoadReporting,
        upstreams._LOAD_REPORT_KEYS,
        "Poll each server's Prometheus endpoint for the engine's own load: vLLM's"
        " `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`;"
        " SGLang's `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`.",
        "[upstreams.gpus.load_report]",
    ),
    Table(
        f"{_GROUP}.queue",
        "[upstreams.NAME.queue]",
        records.AdmissionQueue,
        upstreams._QUEUE_KEYS,
        "Admission control: where requests wait, fairly between tenants, while every"
        " candidate server is full (`max_streams`, `max_waiting`).",
        "[upstreams.gpus.queue]",
    ),
    Table(
        f"{_GROUP}.rate_limit",
        "[upstreams.NAME.rate_limit]",
        records.RateLimit,
        upstreams._RATE_LIMIT_KEYS,
        "Per-tenant budgets, refilled over a minute. A request over budget gets 429 with"
        " `Retry-After` and OpenAI-style `x-ratelimit-*` headers.",
        "[upstreams.gpus.rate_limit]",
    ),
    Table(
        "routes[]",
        "[[routes]]",
        records.Route,
        loading._ROUTE_KEYS,
        "Which group serves a request, by the longest matching path prefix. With a single"
        ' group and no routes, everything goes to it (`prefix = "/"`).',
        "[[routes]]",
    ),
    Table(
        "routes[].resume",
        "[[routes]] resume = { ... }",
        records.Resume,
        loading._RESUME_KEYS,
        "`resume = true` (these defaults) or a table: SSE streams that survive a reconnect"
        " with `Last-Event-ID` (`docs/resume.md`).",
        "[[routes]]",
    ),
    Table(
        "log",
        "[log]",
        records.LogSettings,
        logs._LOG_KEYS,
        "The access log (one line per request, on by default) and the error log.",
        "[log]",
    ),
    Table(
        "admin",
        "[admin]",
        records.AdminSettings,
        admin._ADMIN_KEYS,
        "The admin API (`docs/operations.md`): status, runtime weights, drain, reload,"
        " Prometheus `/metrics`. Without this table there is no admin listener.",
        "[admin]",
    ),
    Table(
        "resolver",
        "[resolver]",
        fleet.ResolverSettings,
        fleetkeys.RESOLVER_KEYS,
        "The DNS servers that groups with `discover` ask (`docs/fleet.md`).",
        "[resolver]",
    ),
    Table(
        "fleet",
        "[fleet]",
        fleet.FleetSettings,
        fleetkeys.FLEET_KEYS,
        "One runtime state, session memory and set of budgets for every replica, through"
        " Redis (`docs/fleet.md`). Without this table each replica keeps its own.",
        "[fleet]",
    ),
)

_SUB_TABLES = {
    f"{_GROUP}.servers": f"{_GROUP}.servers[]",
    f"{_GROUP}.discover": f"{_GROUP}.discover",
    f"{_GROUP}.sticky": f"{_GROUP}.sticky",
    f"{_GROUP}.sticky.cookie": f"{_GROUP}.sticky.cookie",
    f"{_GROUP}.next_upstream": f"{_GROUP}.next_upstream",
    f"{_GROUP}.health_check": f"{_GROUP}.health_check",
    f"{_GROUP}.timeouts": f"{_GROUP}.timeouts",
    f"{_GROUP}.prefix": f"{_GROUP}.prefix",
    f"{_GROUP}.load_report": f"{_GROUP}.load_report",
    f"{_GROUP}.queue": f"{_GROUP}.queue",
    f"{_GROUP}.rate_limit": f"{_GROUP}.rate_limit",
    "routes[].resume": "routes[].resume",
}
"""Keys whose value is a table of its own: key path -> that table's path."""

_BYTES = frozenset(
    {
        "limits.stream_buffer",
        "limits.max_request_head",
        "limits.max_request_body",
        "limits.h2_connection_window",
        "limits.connection_buffer",
        "limits.resume_memory",
        f"{_GROUP}.sticky.body_limit",
        f"{_GROUP}.next_upstream.replay_buffer",
        f"{_GROUP}.prefix.length",
        "routes[].resume.window",
    }
)
"""Integer keys that count bytes."""


def _choices(values: Any) -> str:
    return "one of " + alternatives([v.value if isinstance(v, enum.Enum) else v for v in values])


_VALUE_KINDS: dict[Any, str] = {
    Checker.seconds: "seconds (a positive number)",
    Checker.positive_int: "a positive integer",
    Checker.count: "an integer >= 0",
    Checker.boolean: "true or false",
    Checker.string: "a string",
    Checker.file: "a file path (relative to the configuration file's directory)",
    Checker.address: '"host:port" ("[::1]:port" for IPv6)',
    Checker.listen_address: '"host:port" (port 0: any free port)',
    loading.trusted_proxies: 'an array of CIDRs or addresses, e.g. ["10.0.0.0/8"]',
    Checker.prefix: 'a path prefix starting with "/"',
    Checker.name: "the name of an upstream group",
    upstreams.servers: 'an array of "host:port" strings or { address = ... } tables',
    upstreams.discover: "a table",
    discoverykeys.lookup_name: 'a DNS name, e.g. "vllm.llm.svc.cluster.local"',
    discoverykeys.duration_or_zero: 'seconds (a number >= 0; 0: off) or "30s", "500ms", "2m"',
    upstreams.weight: "an integer >= 0 (0 drains the server)",
    upstreams.max_fails: "an integer >= 0 (0: never taken out)",
    upstreams.server_protocol: _choices(upstreams.SERVER_PROTOCOLS),
    upstreams.max_connections: "an integer >= 1",
    upstreams.balance: _choices(records.Balance),
    stickykeys.sticky: "a table",
    stickykeys.sources: 'an array of "kind:name" strings (cookie, header, query, body)',
    stickykeys.source: '"kind:name" (cookie, header, query or body), e.g. "header:Authorization"',
    stickykeys.sticky_cookie: "a table",
    stickykeys.cookie_name: "a cookie name (an RFC 9110 token)",
    stickykeys.cookie_domain: 'a domain, e.g. "example.com"',
    stickykeys.cookie_path: 'a path starting with "/"',
    stickykeys.same_site: _choices(stickykeys._SAME_SITE),
    upstreams.next_upstream: "a table",
    upstreams.conditions: "an array, each "
    + _choices(sorted(records.CONDITIONS, key=lambda c: (c.startswith("http_"), c))),
    upstreams.health_check: "a table",
    upstreams.request_path: 'a request path starting with "/"',
    upstreams.status_code: "an HTTP status code, 100..599",
    upstreams.group_timeouts: "a table",
    upstreams.set_headers: "a table of header names to value templates",
    upstreams.affinity: _choices(records.AffinityMode),
    upstreams.prefix_affinity: "a table",
    upstreams.prompt_source: _choices(records.PROMPT_SOURCES),
    upstreams.load_factor: "a number >= 1",
    upstreams.balance_gap: "an integer >= 1",
    upstreams.fraction: "a fraction in (0, 1]",
    upstreams.load_reporting: "a table",
    upstreams.seconds_or_zero: "seconds (a number >= 0; 0: off)",
    upstreams.admission_queue: "a table",
    upstreams.rate_limit: "a table",
    loading._size: 'a size: bytes, or a string such as "256 KiB" (B, KiB, MiB, GiB)',
    storeurl.store_url: 'a Redis URL ("redis://", "rediss://", "redis+sentinel://")',
    loading._resume: "true (the defaults) or a table",
    loading._credential_headers: "a list of header names",
    loading._api: _choices(records.Api),
    logs._access: '"stderr", "off" or a file path (appended to)',
    logs._format: _choices(records.LOG_FORMATS),
    logs._level: _choices(records.LOG_LEVELS),
    admin._token: "a bearer token (letters, digits and -._~+/, RFC 6750 §2.1)",
    admin._state_file: "a file path (written by the proxy)",
    fleetkeys._store_error: _choices(fleet.StoreErrorPolicy),
    fleetkeys._nameservers: 'a list of IP addresses, each with an optional port ("10.96.0.10:53")',
}
"""What the value of a key checked by each function looks like."""

_EXAMPLES = {
    "listeners[].address": 'address = "0.0.0.0:8080"',
    "listeners[].tls_cert": 'address = "0.0.0.0:8443"\ntls_cert = "cert.pem"\ntls_key = "key.pem"',
    "listeners[].tls_key": 'address = "0.0.0.0:8443"\ntls_cert = "cert.pem"\ntls_key = "key.pem"',
    "listeners[].trusted_proxies": 'address = "0.0.0.0:8080"\n'
    'trusted_proxies = ["10.0.0.0/8", "127.0.0.1/32"]',
    f"{_GROUP}.servers": 'servers = ["10.0.0.1:8000", { address = "10.0.0.2:8000", weight = 2 }]',
    f"{_GROUP}.discover": 'discover = { dns = "vllm.llm.svc.cluster.local", port = 8000 }',
    f"{_GROUP}.slow_start": 'slow_start = "30s"',
    f"{_GROUP}.discover.dns": 'discover = { dns = "vllm.llm.svc.cluster.local", port = 8000 }',
    f"{_GROUP}.discover.srv": 'discover = { srv = "_http._tcp.vllm.llm.svc.cluster.local" }',
    f"{_GROUP}.discover.port": 'discover = { dns = "vllm.llm.svc.cluster.local", port = 8000 }',
    f"{_GROUP}.discover.tls_ca": 'discover = { dns = "vllm.llm.svc.cluster.local", port = 8443,'
    ' tls = true, tls_ca = "ca.pem" }',
    f"{_GROUP}.discover.tls_server_name": 'discover = { dns = "vllm.llm.svc.cluster.local",'
    ' port = 8443, tls = true, tls_server_name = "vllm.internal" }',
    f"{_GROUP}.discover.max_streams": "max_streams = 64",
    f"{_GROUP}.discover.max_waiting": 'discover = { dns = "vllm.llm.svc.cluster.local",'
    ' port = 8000, max_waiting = 8 }\n\n[upstreams.gpus.load_report]\npath = "/metrics"',
    f"{_GROUP}.balance": 'balance = "least_load"',
    f"{_GROUP}.sticky": '[upstreams.gpus.sticky]\nsources = ["header:X-Chat-ID"]',
    f"{_GROUP}.next_upstream": "[upstreams.gpus.next_upstream]\n"
    'on = ["error", "timeout", "http_503"]',
    f"{_GROUP}.health_check": '[upstreams.gpus.health_check]\npath = "/health"',
    f"{_GROUP}.set_headers": '[upstreams.gpus.set_headers]\n"X-Real-IP" = "$remote_addr"\n'
    '"X-User" = "$http_x_user"',
    f"{_GROUP}.timeouts": "[upstreams.gpus.timeouts]\nfirst_token = 30",
    f"{_GROUP}.affinity": 'affinity = "prefix"',
    f"{_GROUP}.prefix": '[upstreams.gpus.prefix]\nsource = "messages"',
    f"{_GROUP}.prefix.balance_gap": "balance_gap = 2",
    f"{_GROUP}.load_report": '[upstreams.gpus.load_report]\npath = "/metrics"\ninterval = 1',
    f"{_GROUP}.queue": "[upstreams.gpus.queue]\nmax = 200",
    f"{_GROUP}.tenant": 'tenant = "header:Authorization"',
    f"{_GROUP}.priority": 'priority = "header:X-Priority"',
    f"{_GROUP}.rate_limit": "[upstreams.gpus.rate_limit]\ntokens_per_minute = 100000",
    f"{_GROUP}.servers[].address": 'servers = [{ address = "10.0.0.1:8000" }]',
    f"{_GROUP}.servers[].tls_ca": 'servers = [{ address = "gpu1.internal:8443", tls = true,'
    ' tls_ca = "ca.pem" }]',
    f"{_GROUP}.servers[].tls_server_name": 'servers = [{ address = "10.0.0.1:8443", tls = true,'
    ' tls_server_name = "gpu1.internal" }]',
    f"{_GROUP}.servers[].max_streams": 'servers = [{ address = "10.0.0.1:8000",'
    " max_streams = 64 }]",
    f"{_GROUP}.servers[].max_waiting": 'servers = [{ address = "10.0.0.1:8000",'
    ' max_waiting = 8 }]\n\n[upstreams.gpus.load_report]\npath = "/metrics"',
    f"{_GROUP}.sticky.cookie": '[upstreams.gpus.sticky.cookie]\nname = "gpu"',
    f"{_GROUP}.sticky.cookie.expires": "expires = 3600",
    f"{_GROUP}.sticky.cookie.domain": 'domain = "example.com"',
    f"{_GROUP}.sticky.cookie.secret": 'secret = "a long random string"',
    f"{_GROUP}.sticky.cookie.same_site": 'same_site = "None"\nsecure = true',
    f"{_GROUP}.sticky.sources": 'sources = ["cookie:chat_id", "header:X-Chat-ID",'
    ' "body:metadata.session_id"]',
    f"{_GROUP}.timeouts.connect": "connect = 2",
    f"{_GROUP}.timeouts.response_head": "response_head = 30",
    f"{_GROUP}.timeouts.first_token": "first_token = 30",
    f"{_GROUP}.timeouts.idle": "idle = 120",
    f"{_GROUP}.load_report.timeout": "timeout = 0.5",
    f"{_GROUP}.rate_limit.tokens_per_minute": "tokens_per_minute = 100000",
    f"{_GROUP}.rate_limit.requests_per_minute": "requests_per_minute = 600",
    f"{_GROUP}.rate_limit.max_concurrent": "max_concurrent = 8",
    "routes[].prefix": 'prefix = "/v1/"\nupstream = "gpus"',
    "routes[].upstream": 'prefix = "/v1/"\nupstream = "gpus"',
    "routes[].sse_heartbeat": 'prefix = "/v1/"\nupstream = "gpus"\nsse_heartbeat = 15',
    "routes[].resume": 'prefix = "/v1/"\nupstream = "gpus"\nresume = { linger = 60 }',
    "routes[].api": 'prefix = "/v1/"\nupstream = "gpus"\napi = "openai"',
    "routes[].resume.store": 'prefix = "/v1/"\nupstream = "gpus"\n'
    'resume = { store = "redis://127.0.0.1:6379/0" }',
    "log.access": 'access = "/var/log/muxproxy-access.log"',
    "admin.token": 'token = "change-me"  # or the environment variable MUXPROXY_ADMIN_TOKEN',
    "admin.state_file": 'state_file = "muxproxy-state.json"',
    "resolver.nameservers": 'nameservers = ["10.96.0.10:53"]',
    "fleet.store": 'store = "redis://redis:6379/0"  # or the environment variable'
    " MUXPROXY_FLEET_STORE",
    "fleet.on_store_error": 'store = "redis://redis:6379/0"\non_store_error = "local"',
    "fleet.sync_interval": 'store = "redis://redis:6379/0"\nsync_interval = 5.0',
}
"""Examples of keys whose default is no example (required keys, keys not set by default,
tables), as TOML lines inside the key's table (:attr:`Table.example_head`)."""

_OWN_KEYS = "its own keys"
_PHRASES = ("required", "not set", _OWN_KEYS, "none")
"""The defaults that are no TOML value."""

_ROUTE_KEYS_IN_EXAMPLE = ('prefix = "/v1/"', 'upstream = "gpus"')


@cache
def _record_docs() -> dict[tuple[str, str], str]:
    """(class name, attribute name) -> the attribute's docstring, for :mod:`.records` and
    :mod:`.fleet`."""
    body = [
        *ast.parse(inspect.getsource(records)).body,
        *ast.parse(inspect.getsource(fleet)).body,
        *ast.parse(inspect.getsource(discovery)).body,
    ]
    docs: dict[tuple[str, str], str] = {}
    for node in body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for statement, following in itertools.pairwise(body):
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                name = statement.target.id
            elif (
                isinstance(statement, ast.Assign)
                and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name)
            ):
                name = statement.targets[0].id
            else:
                continue
            if (
                isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[(node.name, name)] = inspect.cleandoc(following.value.value)
    return docs


_DATA_REFERENCE = re.compile(r":(?:data|class|func|mod|attr):`~?\.?([A-Za-z_.]+)`")


_NONE = re.compile(r'(\A|\. |; |, |\()?(?<!")\bNone\b(?!")')


def _markdown(text: str) -> str:
    """A docstring as Markdown: ``code`` spans, :data:`NAMES` spelled out, lines joined
    into paragraphs."""

    def spell(match: re.Match[str]) -> str:
        value = getattr(records, match[1], None)
        if isinstance(value, tuple | frozenset) and all(isinstance(v, str) for v in value):
            return alternatives(sorted(value) if isinstance(value, frozenset) else value)
        return f"`{match[1]}`"

    text = _DATA_REFERENCE.sub(spell, text).replace("``", "`")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    # Python's None is a key left out of the file (SameSite's "None" is a value, quoted).
    paragraphs = [_NONE.sub(_not_set, p) for p in paragraphs]
    return "\n\n".join(p for p in paragraphs if p)


def _not_set(match: re.Match[str]) -> str:
    before = match[1] or ""
    return before + ("Not set" if before in ("", ". ") else "not set")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return json.dumps(value.value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:g}" if value != int(value) or abs(value) >= 1e16 else str(int(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, frozenset | tuple | list):
        items = sorted(value, key=lambda c: (str(c).startswith("http_"), str(c)))
        return "[" + ", ".join(_toml(item) for item in items) + "]"
    raise TypeError(f"no TOML spelling for {value!r}")


def _size_note(value: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= size and value % size == 0:
            return f" ({value // size} {unit})"
    return ""


def _default(table: Table, key: str, field: attrs.Attribute[Any] | None, path: str) -> str:
    spec = table.keys[key]
    if spec.required is not None:
        return "required"
    if field is None or field.default is attrs.NOTHING:
        return "required"
    default = field.default
    if path in _SUB_TABLES:
        return _OWN_KEYS if default is not None else "not set"
    if default is None:
        return "not set"
    if path == f"{_GROUP}.set_headers" and default == ():
        return "none"
    text = _toml(default)
    if isinstance(default, int) and not isinstance(default, bool) and path in _BYTES:
        text += _size_note(default)
    return text


def _example(table: Table, key: str, default: str, path: str) -> str:
    line = _EXAMPLES.get(path)
    if line is None:
        if default in _PHRASES:
            raise LookupError(f"{path}: no example; add one to _EXAMPLES")
        line = f"{key} = {default.split(' (')[0]}"
    if line.startswith("["):  # a table of its own, with its heading
        return line
    head = table.example_head
    if table.path == "routes[]" and not line.startswith("prefix"):
        line = "\n".join([*_ROUTE_KEYS_IN_EXAMPLE, line])
    if table.path == "routes[].resume":
        if not line.startswith("prefix"):
            line = "\n".join([*_ROUTE_KEYS_IN_EXAMPLE, f"resume = {{ {line} }}"])
    elif table.path.endswith(".servers[]") and not line.startswith("servers"):
        line = f'servers = [{{ address = "10.0.0.1:8000", {line} }}]'
    elif table.path.endswith(".discover") and not line.startswith("discover"):
        line = f'discover = {{ dns = "vllm.llm.svc.cluster.local", port = 8000, {line} }}'
    return f"{head}\n{line}"


@cache
def tables() -> tuple[Table, ...]:
    return _TABLES


@cache
def entries() -> tuple[Entry, ...]:
    """Every key of every table, in the order of :data:`_TABLES` and of their keys."""
    docs = _record_docs()
    by_path = {table.path: table for table in _TABLES}
    out = []
    for table in _TABLES:
        fields = {field.name: field for field in attrs.fields(table.record)}
        for key, spec in table.keys.items():
            path = f"{table.path}.{key}"
            kind = _VALUE_KINDS.get(spec.parse)
            if kind is None:
                raise LookupError(f"{path}: checked by {spec.parse!r}, which has no value kind")
            if path in _BYTES:
                kind = kind.replace("a positive integer", "bytes (a positive integer)")
            kind = ranges.described(path, kind)
            doc = docs.get((table.record.__name__, key))
            if doc is None:
                raise LookupError(f"{path}: {table.record.__name__}.{key} has no docstring")
            default = _default(table, key, fields.get(key), path)
            section = by_path.get(_SUB_TABLES.get(path, ""))
            out.append(
                Entry(
                    table=table,
                    key=key,
                    kind=kind,
                    default=default,
                    doc=_markdown(doc),
                    example=_example(table, key, default, path),
                    section=section,
                )
            )
    return tuple(out)


# -- placement hints and --explain --


_GROUP_IN_PATH = re.compile(r'\Aupstreams\.("(?:[^"\\]|\\.)*"|[A-Za-z0-9_-]+)')
_INDEX = re.compile(r"\[[0-9]*\]")


def _pattern(path: str) -> tuple[str, str | None]:
    """A concrete key path as its table pattern, and the group name it had:
    ``upstreams.gpus.servers[1]`` -> (``upstreams.NAME.servers[]``, ``gpus``)."""
    group = None
    match = _GROUP_IN_PATH.match(path)
    if match is not None:
        group = match[1]
        path = _GROUP + path[match.end() :]
    return _INDEX.sub("[]", path), group


def placement(key: str, path: str) -> str | None:
    """Where ``key``, unknown in the table at ``path``, belongs instead; None when it is in no
    other table, or in too many for a pointer to help (``path``, ``name``)."""
    here, group = _pattern(path)
    homes = [table for table in _TABLES if key in table.keys and table.path != here]
    if not here.startswith(_GROUP):  # a listener's "port" is no DNS lookup's
        homes = [table for table in homes if not table.path.endswith(".discover")]
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


def lookup(query: str) -> list[Entry] | list[Table]:
    """The entries (or the table) that ``query`` names: a key path, concrete
    (``upstreams.gpus.servers[0].weight``) or as the reference writes it, a table's path, or
    a bare key name (every table's key of that name)."""
    pattern, _ = _pattern(query.strip().strip("[]"))
    everything = entries()
    exact = [entry for entry in everything if entry.path == pattern]
    if exact:
        return exact
    table = [
        table for table in _TABLES if table.path.replace("[]", "") == pattern.replace("[]", "")
    ]
    if table:
        return table
    return [entry for entry in everything if entry.key == pattern]


def explain(query: str) -> str | None:
    """The reference's text for ``query`` (see :func:`lookup`), or None when it names
    nothing."""
    found = lookup(query)
    if not found:
        return None
    parts = []
    for item in found:
        if isinstance(item, Table):
            parts.append(_explain_table(item))
        else:
            parts.append(_explain_entry(item))
    return "\n\n".join(parts)


def suggestions(query: str) -> list[str]:
    """Key paths close to ``query``, for a query that names nothing."""
    pattern, _ = _pattern(query.strip())
    paths = [entry.path for entry in entries()]
    keys = sorted({entry.key for entry in entries()})
    close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.6)
    close += difflib.get_close_matches(pattern.rpartition(".")[2], keys, n=3, cutoff=0.7)
    return list(dict.fromkeys(close))


def _plain(text: str) -> str:
    return text.replace("`", "")


def _wrap(text: str, indent: str) -> list[str]:
    lines = []
    for paragraph in text.split("\n\n"):
        lines.extend(
            textwrap.wrap(_plain(paragraph), 92, initial_indent=indent, subsequent_indent=indent)
            or [indent]
        )
        lines.append("")
    return lines[:-1]


def _explain_entry(entry: Entry) -> str:
    lines = [
        f"{entry.path}  (in {entry.table.heading})",
        f"  type:     {entry.kind}",
        f"  default:  {entry.default}",
        "",
        *_wrap(entry.doc, "  "),
        "",
        "  example:",
        *(f"    {line}" for line in entry.example.splitlines()),
    ]
    if entry.section is not None:
        lines += ["", _explain_table(entry.section)]
    return "\n".join(lines)


def _explain_table(table: Table) -> str:
    lines = [table.heading, *_wrap(table.summary, "  "), ""]
    for entry in entries():
        if entry.table is table:
            lines.append(f"  {entry.key:<24} {entry.default:<20} {entry.kind}")
    return "\n".join(lines)


# -- docs/configuration.md --

_INTRO = """\
# Configuration reference

Every key `muxproxy check` accepts, with its type, its default and what it does. This file is
generated from the code that checks a configuration (`muxproxy/config/reference.py`) by
`scripts/config-reference`; a test fails when it is out of date, so it is always the truth
of the code. `muxproxy check --explain KEY` prints one entry in a terminal
(`muxproxy check --explain first_token`, `--explain upstreams.gpus.sticky`).

A configuration is one TOML file, checked whole before it is used: `muxproxy check --config
FILE` names every problem with its key and the fix, and a reload with a bad file keeps the
running configuration. Durations are seconds (a number, `0.5` is half a second); sizes are
bytes (an integer). A key left out takes its default. A key in the wrong table gets a
pointer to the right one (`timeouts.first_token: unknown key; "first_token" belongs in
[upstreams.NAME.timeouts]`).

The smallest configuration:

```toml
[[listeners]]
address = "0.0.0.0:8080"

[upstreams.gpus]
servers = ["10.0.0.1:8000", "10.0.0.2:8000"]
```

`muxproxy serve --listen HOST:PORT --upstream HOST:PORT ...` runs the same thing without a
file. The environment variable `MUXPROXY_ADMIN_TOKEN`, when set, is the admin token and wins
over `[admin] token`; `MUXPROXY_FLEET_STORE`, when set, is the fleet's store and wins over
`[fleet] store` (a URL with a password then comes from a Secret, not the file).
"""


def render_markdown() -> str:
    """``docs/configuration.md``."""
    out = [_INTRO, "## Tables\n"]
    for table in _TABLES:
        out.append(f"- [`{table.heading}`](#{table.anchor}): {table.summary.split('. ')[0]}")
    out.append("")
    everything = entries()
    for table in _TABLES:
        out += [f'<a id="{table.anchor}"></a>', "", f"## `{table.heading}`", "", table.summary]
        out += ["", "| key | type | default |", "|---|---|---|"]
        mine = [entry for entry in everything if entry.table is table]
        for entry in mine:
            out.append(
                f"| [`{entry.key}`](#{entry.anchor}) | {entry.kind} | {_md_default(entry)} |"
            )
        out.append("")
        for entry in mine:
            out += [f'<a id="{entry.anchor}"></a>', "", f"### `{entry.path}`", ""]
            out += [f"**Type:** {entry.kind}. **Default:** {_md_default(entry)}.", "", entry.doc]
            out += ["", "```toml", entry.example, "```", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def _md_default(entry: Entry) -> str:
    if entry.section is not None and entry.default == _OWN_KEYS:
        return f"[its own keys](#{entry.section.anchor})"
    return entry.default if entry.default in _PHRASES else f"`{entry.default}`"


def iter_examples() -> Iterator[tuple[Entry, str]]:
    """(entry, its example as a complete TOML document) for every entry: the example in a
    minimal configuration (a listener and the group ``gpus``), for tests to load."""
    for entry in entries():
        yield entry, _document(entry)


_MINIMAL_LISTENER = '[[listeners]]\naddress = "127.0.0.1:0"\n'
_MINIMAL_GROUP = '[upstreams.gpus]\nservers = ["127.0.0.1:9001"]\n'


def _document(entry: Entry) -> str:
    example = entry.example
    table = entry.table
    if table.path == "listeners[]":
        return f"{example}\n\n{_MINIMAL_GROUP}"
    if table.path == _GROUP or table.path.endswith((".servers[]", ".discover")):
        if (
            "servers = " in example or "discover = " in example
        ):  # the example sets the group's servers itself
            return f"{_MINIMAL_LISTENER}\n{example}\n"
        if example.startswith("[upstreams.gpus]\n"):  # a key of the group: add its servers
            return f"{_MINIMAL_LISTENER}\n{_MINIMAL_GROUP}{example.partition(chr(10))[2]}\n"
    return f"{_MINIMAL_LISTENER}\n{_MINIMAL_GROUP}\n{example}\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
