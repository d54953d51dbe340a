"""What the configuration reference says of each key: what its value looks like, its default,
its text and an example, built from the code that checks a configuration.

Nothing here is written twice:

- the keys of each table are the :class:`~.checker.Key` mappings of :mod:`.layout`, so a key
  the loader checks is in the reference at once;
- a key's default is its record field's default, and its text the field's docstring in
  :mod:`.records` (read with :mod:`ast`: attrs keeps no docstrings at run time);
- what a value looks like comes from the function that checks it (:data:`_VALUE_KINDS`), a
  number's range from :mod:`.ranges`; a new checking function without an entry fails.

The data of the reference, kept apart from its renderings (:mod:`.reference`). It reads every
checking module, so it sits above them all, and above :mod:`.loading`; nothing that checks a
configuration imports it.
"""

from __future__ import annotations

import ast
import enum
import inspect
import itertools
import json
import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import attrs

from muxproxy.config import (
    admin,
    discovery,
    discoverykeys,
    extensionkeys,
    extensions,
    fleet,
    fleetkeys,
    groupmodelkeys,
    kveventkeys,
    kvevents,
    logs,
    logsettings,
    modelkeys,
    queue,
    queuekeys,
    ranges,
    records,
    routes,
    sections,
    stickykeys,
    storeurl,
    telemetry,
    telemetrykeys,
    upstreams,
)
from muxproxy.config.checker import Checker, alternatives
from muxproxy.config.layout import GROUP, SUB_TABLES, TABLES, Table

__all__ = ["OWN_KEYS", "PHRASES", "Entry", "entries", "iter_examples"]


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


_BYTES = frozenset(
    {
        "limits.stream_buffer",
        "limits.max_request_head",
        "limits.max_request_body",
        "limits.h2_connection_window",
        "limits.connection_buffer",
        "limits.resume_memory",
        f"{GROUP}.sticky.body_limit",
        f"{GROUP}.next_upstream.replay_buffer",
        f"{GROUP}.prefix.length",
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
    sections.trusted_proxies: 'an array of CIDRs or addresses, e.g. ["10.0.0.0/8"]',
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
    kveventkeys.kv_events: "a table",
    kveventkeys.kv_endpoint: '"tcp://host:port", a ZeroMQ endpoint',
    kveventkeys.topic: "a string",
    kveventkeys.stale_after: 'seconds (a number above 0) or "2s", "500ms"',
    queuekeys.seconds_or_zero: "seconds (a number >= 0; 0: off)",
    queuekeys.admission_queue: "a table",
    queuekeys.max_wait: "a table of priority classes (0..9) to seconds or durations"
    ' ("500ms", "30s", "2m"), each: range as `queue.timeout`',
    upstreams.rate_limit: "a table",
    groupmodelkeys.model_names: "an array of model names (each 1 to 256 characters, listed once)",
    sections.size: 'a size: bytes, or a string such as "256 KiB" (B, KiB, MiB, GiB)',
    storeurl.store_url: 'a Redis URL ("redis://", "rediss://", "redis+sentinel://")',
    sections.resume: "true (the defaults) or a table",
    sections.credential_headers: "a list of header names",
    sections.api: _choices(records.Api),
    modelkeys.model_patterns: 'an array of model names or globs, e.g. ["llama-3.1-70b*"]',
    modelkeys._targets: "an array of { model, weight } tables",
    modelkeys._model_name: 'a model name, e.g. "llama-v2"',
    logs._access: '"stderr", "off" or a file path (appended to)',
    logs._format: _choices(logsettings.LOG_FORMATS),
    logs._level: _choices(logsettings.LOG_LEVELS),
    admin._token: "a bearer token (letters, digits and -._~+/, RFC 6750 §2.1)",
    admin._state_file: "a file path (written by the proxy)",
    fleetkeys._store_error: _choices(fleet.StoreErrorPolicy),
    fleetkeys._nameservers: 'a list of IP addresses, each with an optional port ("10.96.0.10:53")',
    extensionkeys._module: '"package.module:Class"',
    extensionkeys._settings: "a table (its keys are the extension's)",
    extensionkeys._on_error: _choices(extensions.HookErrorPolicy),
    telemetrykeys._endpoint: 'an http(s) URL ("http://collector:4318")',
    telemetrykeys._service_name: "a string",
    telemetrykeys._headers: "a table of header names to values (never logged)",
    telemetrykeys._ratio: "a number from 0 to 1",
}
"""What the value of a key checked by each function looks like."""

_EXTENSION = '"muxproxy.extensions:Extension"'
"""The base class, which does nothing: an extension every example can load."""

_KV_EVENTS = '[upstreams.gpus]\naffinity = "prefix"\n\n[upstreams.gpus.kv_events]\n{}'
"""``kv_events`` examples: the table needs ``affinity = "prefix"`` beside it."""

_EXAMPLES = {
    "listeners[].address": 'address = "0.0.0.0:8080"',
    "listeners[].tls_cert": 'address = "0.0.0.0:8443"\ntls_cert = "cert.pem"\ntls_key = "key.pem"',
    "listeners[].tls_key": 'address = "0.0.0.0:8443"\ntls_cert = "cert.pem"\ntls_key = "key.pem"',
    "listeners[].trusted_proxies": 'address = "0.0.0.0:8080"\n'
    'trusted_proxies = ["10.0.0.0/8", "127.0.0.1/32"]',
    f"{GROUP}.servers": 'servers = ["10.0.0.1:8000", { address = "10.0.0.2:8000", weight = 2 }]',
    f"{GROUP}.discover": 'discover = { dns = "vllm.llm.svc.cluster.local", port = 8000 }',
    f"{GROUP}.slow_start": 'slow_start = "30s"',
    f"{GROUP}.discover.dns": 'discover = { dns = "vllm.llm.svc.cluster.local", port = 8000 }',
    f"{GROUP}.discover.srv": 'discover = { srv = "_http._tcp.vllm.llm.svc.cluster.local" }',
    f"{GROUP}.discover.port": 'discover = { dns = "vllm.llm.svc.cluster.local", port = 8000 }',
    f"{GROUP}.discover.tls_ca": 'discover = { dns = "vllm.llm.svc.cluster.local", port = 8443,'
    ' tls = true, tls_ca = "ca.pem" }',
    f"{GROUP}.discover.tls_server_name": 'discover = { dns = "vllm.llm.svc.cluster.local",'
    ' port = 8443, tls = true, tls_server_name = "vllm.internal" }',
    f"{GROUP}.discover.max_streams": "max_streams = 64",
    f"{GROUP}.discover.max_waiting": 'discover = { dns = "vllm.llm.svc.cluster.local",'
    ' port = 8000, max_waiting = 8 }\n\n[upstreams.gpus.load_report]\npath = "/metrics"',
    f"{GROUP}.balance": 'balance = "least_load"',
    f"{GROUP}.sticky": '[upstreams.gpus.sticky]\nsources = ["header:X-Chat-ID"]',
    f"{GROUP}.next_upstream": "[upstreams.gpus.next_upstream]\n"
    'on = ["error", "timeout", "http_503"]',
    f"{GROUP}.health_check": '[upstreams.gpus.health_check]\npath = "/health"',
    f"{GROUP}.set_headers": '[upstreams.gpus.set_headers]\n"X-Real-IP" = "$remote_addr"\n'
    '"X-User" = "$http_x_user"',
    f"{GROUP}.timeouts": "[upstreams.gpus.timeouts]\nfirst_token = 30",
    f"{GROUP}.affinity": 'affinity = "prefix"',
    f"{GROUP}.prefix": '[upstreams.gpus.prefix]\nsource = "messages"',
    f"{GROUP}.prefix.balance_gap": "balance_gap = 2",
    f"{GROUP}.load_report": '[upstreams.gpus.load_report]\npath = "/metrics"\ninterval = 1',
    f"{GROUP}.kv_events": _KV_EVENTS.format("port = 5557"),
    **{
        f"{GROUP}.kv_events.{key}": _KV_EVENTS.format(line)
        for key, line in (
            ("port", "port = 5557"),
            ("topic", 'topic = "kv-events"'),
            ("stale_after", 'stale_after = "2s"'),
            ("max_blocks", "max_blocks = 200000"),
        )
    },
    f"{GROUP}.servers[].kv_events": '[upstreams.gpus]\naffinity = "prefix"\nservers = ['
    '{ address = "10.0.0.1:8000", kv_events = "tcp://10.0.0.1:5557" }]\n\n'
    "[upstreams.gpus.kv_events]",
    f"{GROUP}.queue": "[upstreams.gpus.queue]\nmax = 200",
    f"{GROUP}.queue.max_wait": 'max_wait = { 0 = 60, 5 = "10s", 9 = "2s" }',
    f"{GROUP}.tenant": 'tenant = "header:Authorization"',
    f"{GROUP}.priority": 'priority = "header:X-Priority"',
    f"{GROUP}.rate_limit": "[upstreams.gpus.rate_limit]\ntokens_per_minute = 100000",
    f"{GROUP}.models": 'models = ["llama-3.1-70b", "llama-3.1-70b-lora-sql"]',
    f"{GROUP}.learn_models": "learn_models = true",
    f"{GROUP}.models_refresh": "learn_models = true\nmodels_refresh = 300",
    f"{GROUP}.servers[].address": 'servers = [{ address = "10.0.0.1:8000" }]',
    f"{GROUP}.servers[].tls_ca": 'servers = [{ address = "gpu1.internal:8443", tls = true,'
    ' tls_ca = "ca.pem" }]',
    f"{GROUP}.servers[].tls_server_name": 'servers = [{ address = "10.0.0.1:8443", tls = true,'
    ' tls_server_name = "gpu1.internal" }]',
    f"{GROUP}.servers[].max_streams": 'servers = [{ address = "10.0.0.1:8000", max_streams = 64 }]',
    f"{GROUP}.servers[].max_waiting": 'servers = [{ address = "10.0.0.1:8000",'
    ' max_waiting = 8 }]\n\n[upstreams.gpus.load_report]\npath = "/metrics"',
    f"{GROUP}.sticky.cookie": '[upstreams.gpus.sticky.cookie]\nname = "gpu"',
    f"{GROUP}.sticky.cookie.expires": "expires = 3600",
    f"{GROUP}.sticky.cookie.domain": 'domain = "example.com"',
    f"{GROUP}.sticky.cookie.secret": 'secret = "a long random string"',
    f"{GROUP}.sticky.cookie.same_site": 'same_site = "None"\nsecure = true',
    f"{GROUP}.sticky.sources": 'sources = ["cookie:chat_id", "header:X-Chat-ID",'
    ' "body:metadata.session_id"]',
    f"{GROUP}.timeouts.connect": "connect = 2",
    f"{GROUP}.timeouts.response_head": "response_head = 30",
    f"{GROUP}.timeouts.first_token": "first_token = 30",
    f"{GROUP}.timeouts.idle": "idle = 120",
    f"{GROUP}.load_report.timeout": "timeout = 0.5",
    f"{GROUP}.rate_limit.tokens_per_minute": "tokens_per_minute = 100000",
    f"{GROUP}.rate_limit.requests_per_minute": "requests_per_minute = 600",
    f"{GROUP}.rate_limit.max_concurrent": "max_concurrent = 8",
    "routes[].prefix": 'prefix = "/v1/"\nupstream = "gpus"',
    "routes[].upstream": 'prefix = "/v1/"\nupstream = "gpus"',
    "routes[].sse_heartbeat": 'prefix = "/v1/"\nupstream = "gpus"\nsse_heartbeat = 15',
    "routes[].resume": 'prefix = "/v1/"\nupstream = "gpus"\nresume = { linger = 60 }',
    "routes[].api": 'prefix = "/v1/"\nupstream = "gpus"\napi = "openai"',
    "routes[].resume.store": 'prefix = "/v1/"\nupstream = "gpus"\n'
    'resume = { store = "redis://127.0.0.1:6379/0" }',
    "routes[].models": 'prefix = "/v1/"\nupstream = "gpus"\nmodels = ["llama-3.1-70b*"]',
    "models.NAME.targets": 'targets = [{ model = "llama-v1", weight = 9 },'
    ' { model = "llama-v2", weight = 1 }]',
    "models.NAME.targets[].model": 'targets = [{ model = "llama-v2" }]',
    "models.NAME.targets[].weight": 'targets = [{ model = "llama-v2", weight = 1 },'
    ' { model = "llama-v1", weight = 9 }]',
    "log.access": 'access = "/var/log/muxproxy-access.log"',
    "admin.token": 'token = "change-me"  # or the environment variable MUXPROXY_ADMIN_TOKEN',
    "admin.state_file": 'state_file = "muxproxy-state.json"',
    "resolver.nameservers": 'nameservers = ["10.96.0.10:53"]',
    "fleet.store": 'store = "redis://redis:6379/0"  # or the environment variable'
    " MUXPROXY_FLEET_STORE",
    "fleet.on_store_error": 'store = "redis://redis:6379/0"\non_store_error = "local"',
    "fleet.sync_interval": 'store = "redis://redis:6379/0"\nsync_interval = 5.0',
    "extensions[].module": f"module = {_EXTENSION}",
    "extensions[].settings": f'module = {_EXTENSION}\nsettings = {{ keys = "keys.txt" }}',
    "extensions[].timeout": f"module = {_EXTENSION}\ntimeout = 1.0",
    "extensions[].on_error": f'module = {_EXTENSION}\non_error = "continue"',
    "telemetry.otlp_endpoint": 'otlp_endpoint = "http://collector:4318"',
    "telemetry.headers": 'otlp_endpoint = "http://collector:4318"\n'
    'headers = { Authorization = "Bearer change-me" }',
    "telemetry.service_name": 'otlp_endpoint = "http://collector:4318"\nservice_name = "muxproxy"',
    "telemetry.export_interval": 'otlp_endpoint = "http://collector:4318"\nexport_interval = 10.0',
    "telemetry.sample_ratio": 'otlp_endpoint = "http://collector:4318"\nsample_ratio = 1.0',
}
"""Examples of keys whose default is no example (required keys, keys not set by default,
tables), as TOML lines inside the key's table (:attr:`Table.example_head`)."""

OWN_KEYS = "its own keys"
PHRASES = ("required", "not set", OWN_KEYS, "none")
"""The defaults that are no TOML value."""

_ROUTE_KEYS_IN_EXAMPLE = ('prefix = "/v1/"', 'upstream = "gpus"')


@cache
def _record_docs() -> dict[tuple[str, str], str]:
    """(class name, attribute name) -> the attribute's docstring, for :mod:`.records` and
    :mod:`.fleet`."""
    body = [
        *ast.parse(inspect.getsource(records)).body,
        *ast.parse(inspect.getsource(logsettings)).body,
        *ast.parse(inspect.getsource(routes)).body,
        *ast.parse(inspect.getsource(fleet)).body,
        *ast.parse(inspect.getsource(discovery)).body,
        *ast.parse(inspect.getsource(kvevents)).body,
        *ast.parse(inspect.getsource(queue)).body,
        *ast.parse(inspect.getsource(extensions)).body,
        *ast.parse(inspect.getsource(telemetry)).body,
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
        value = getattr(records, match[1], getattr(logsettings, match[1], None))
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
    if path in SUB_TABLES:
        return OWN_KEYS if default is not None else "not set"
    if default is None:
        return "not set"
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]  # attrs's own class
        return "none"
    if path in (
        f"{GROUP}.set_headers",
        f"{GROUP}.queue.max_wait",
        f"{GROUP}.models",
        "telemetry.headers",
    ) and (default == ()):
        return "none"
    text = _toml(default)
    if isinstance(default, int) and not isinstance(default, bool) and path in _BYTES:
        text += _size_note(default)
    return text


def _example(table: Table, key: str, default: str, path: str) -> str:
    line = _EXAMPLES.get(path)
    if line is None:
        if default in PHRASES:
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
def entries() -> tuple[Entry, ...]:
    """Every key of every table, in the order of :data:`TABLES` and of their keys."""
    docs = _record_docs()
    by_path = {table.path: table for table in TABLES}
    out = []
    for table in TABLES:
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
            section = by_path.get(SUB_TABLES.get(path, ""))
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
    in_group = table.path == GROUP or table.path.endswith((".servers[]", ".discover"))
    if in_group and ("servers = " in example or "discover = " in example):
        return f"{_MINIMAL_LISTENER}\n{example}\n"  # the example sets the group's servers
    if example.startswith("[upstreams.gpus]\n"):  # keys of the group: add its servers
        return f"{_MINIMAL_LISTENER}\n{_MINIMAL_GROUP}{example.partition(chr(10))[2]}\n"
    return f"{_MINIMAL_LISTENER}\n{_MINIMAL_GROUP}\n{example}\n"
