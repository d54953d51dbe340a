"""The admin API: an HTTP/1.1 listener over a :class:`~muxproxy.trio.control.Control`.

Endpoints (JSON in and out, but ``/metrics``)::

    GET   /ready                                  200 {"ready": true}, or 503 with a reason
    GET   /status                                 groups, servers, listeners, workers
    GET   /metrics                                Prometheus text format 0.0.4
    PATCH /upstreams/{group}/servers/{server}     {"weight": N|null, "drain": B, "down": B}
    PATCH /upstreams/{group}                      {"servers": {SERVER: CHANGE, ...}} or
                                                  {"weights": {SERVER: N|null, ...}}
    PATCH /models/{alias}                         {"weights": {MODEL: N|null, ...}}: the
                                                  weights of a model alias's targets
    POST  /reload[?restart=1]                     re-read the configuration file

Served by Hypercorn (its HTTP/1.1 parsing, head-size limit and timeouts answer malformed and
slow requests) with the small ASGI application below, which knows nothing of the proxy: a
single process and a supervisor of workers hand it their own ``Control``.

Readiness (``READY_PATH``), for a Kubernetes ``httpGet`` readiness probe or a load balancer's
health check: 200 ``{"ready": true}`` while the proxy takes new traffic, 503 ``{"ready":
false, "reason": "stopping"}`` from the moment a graceful stop begins (the first SIGTERM,
SIGINT or SIGQUIT) until the process exits, and ``"starting"`` while nothing accepts yet (a
supervisor whose every worker is being replaced). The listener stays open for the whole drain
(it closes when the process exits), so a probe sees the 503 rather than a refused
connection, and a liveness check on ``/status`` keeps passing. The backends are deliberately
left out: a proxy whose groups have no usable server is still ready. Every replica shares the
same backends, so "not ready" there would take every pod out of its Service at once; clients
would get connection refused instead of the proxy's own 502 or 503 that says why, and with no
requests passive health (which learns from them) could not see a backend come back. Readiness
says whether this process should be sent traffic; whether the fleet behind it can serve is
``/status``'s and ``/metrics``' business.

Security rules. Every change (PATCH, POST) needs ``Authorization: Bearer <token>`` (RFC 6750
§2.1); the comparison is constant-time (``hmac.compare_digest``) so the token cannot be
guessed byte by byte from response times. A missing or wrong token is a 401 with
``WWW-Authenticate: Bearer`` (RFC 6750 §3) and changes nothing. With no token configured,
changes are refused (403) rather than open. ``GET /ready`` is open on every address: it says
"ready" or one word why not, names no backend and changes nothing, and an ``httpGet`` probe
cannot send a token from a Secret. Other reads (GET) are open only on a loopback address;
elsewhere they need the token as well, since status names every backend. Request bodies are
bounded (``MAX_BODY``) and must arrive within ``BODY_TIMEOUT``; heads by ``_MAX_HEAD``, on
``/ready`` too. Every change, and every refused attempt, is logged to ``muxproxy.admin`` with
the client's address; readiness answers are not (a probe every few seconds would drown the
log; the stop itself is logged by the process that stops).

A group's PATCH (a gray release's step) changes several servers as one: the whole body is
checked before anything is changed (any bad entry: 400 naming it, nothing changed), and the
servers' changes are applied as one new runtime state, so no request sees half a step. With a
fleet store (``[fleet] store``) every change is written to the store first and answered, with
its ``version``, once the store has it; while the store cannot be reached it is 503.

Nothing a client sends may stop the proxy: the application answers every request it
understands with a status and a message, and Hypercorn answers the rest (a 500 for a bug,
logged) without leaving its connection task.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any
from urllib.parse import parse_qs, unquote

import attrs
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from muxproxy.asgi import serve_lifespan
from muxproxy.config.admin import is_loopback
from muxproxy.config.ranges import SERVER_WEIGHT
from muxproxy.config.records import ADMIN_TOKEN_ENV
from muxproxy.core.http.credentials import normal_credentials
from muxproxy.trio.control import AdminError, Control, Readiness

__all__ = [
    "BODY_TIMEOUT",
    "MAX_BODY",
    "READY_PATH",
    "AdminApp",
    "TokenSource",
    "parse_change",
    "parse_group_change",
    "serve_admin",
]

log = logging.getLogger("muxproxy.admin")
_http_log = logging.getLogger("muxproxy.admin.http")
# Hypercorn's own lines: its errors (a bug in the app, a 500) matter; its "Running on ...
# (CTRL + C to quit)" does not, muxproxy prints its own.
_http_log.setLevel(logging.WARNING)

MAX_BODY = 16 * 1024
"""Largest request body accepted. A change is a few dozen bytes of JSON; anything near this
is not one, and holding more would let a client make the proxy keep it."""
READY_PATH = "/ready"
"""The readiness endpoint: what a probe or a load balancer's health check asks for."""
BODY_TIMEOUT = 10.0
"""Seconds a client has to send its whole request body once the head has arrived."""
_MAX_HEAD = 16 * 1024
"""Largest request head: past it, 431 (RFC 6585 §5), from h11 while the head is incomplete,
from here once it is complete (Hypercorn reads 64 KiB at once)."""
_IDLE_TIMEOUT = 5.0
"""Seconds an idle keep-alive connection to the admin listener is kept open."""
_READ_TIMEOUT = 30.0
"""Seconds Hypercorn waits on a read from a connection before closing it."""

_CHANGE_FIELDS = ("weight", "drain", "down")
_CLOSE = (b"connection", b"close")
_JSON = "application/json"
_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
_TRUE = ("1", "true", "yes")
_FALSE = ("0", "false", "no", "")


@attrs.frozen(kw_only=True)
class _Response:
    status: int
    body: bytes
    content_type: str = _JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()


def _json(status: int, document: Any) -> _Response:
    return _Response(status=status, body=json.dumps(document, indent=2).encode() + b"\n")


def _error(status: int, message: str, *headers: tuple[bytes, bytes]) -> _Response:
    response = _json(status, {"ok": False, "error": message})
    return attrs.evolve(response, headers=headers)


def parse_change(body: bytes) -> dict[str, Any]:
    """The change a PATCH body asks for: ``weight`` (an integer in the configuration's range
    for a weight, :data:`~muxproxy.config.ranges.SERVER_WEIGHT`, or null for the configured
    weight again), ``drain`` and ``down`` (bool).

    Raises :class:`AdminError` (400) with a message naming the field at fault.
    """
    return _change_of(_body_json(body, '{"weight": 2}'), "")


def parse_group_change(body: bytes) -> dict[str, dict[str, Any]]:
    """The changes a group's PATCH body asks for, server (as given) -> fields: either
    ``{"servers": {SERVER: {"weight": N, "drain": B, "down": B}, ...}}`` or the short
    ``{"weights": {SERVER: N, ...}}``; at least one server.

    Raises :class:`AdminError` (400) naming the entry and field at fault; nothing is made
    of a body with one bad entry.
    """
    example = '{"weights": {"10.0.0.1:8000": 3, "10.0.0.2:8000": 1}}'
    data = _body_json(body, example)
    if not isinstance(data, dict) or len(data) != 1 or set(data) - {"servers", "weights"}:
        raise AdminError(
            400,
            'body: expected {"servers": {SERVER: {"weight": N, ...}}} or {"weights": {SERVER:'
            f" N}}}} (one of them), got {_shown(data)}",
        )
    ((key, entries),) = data.items()
    if not isinstance(entries, dict) or not entries:
        raise AdminError(400, f"{key}: expected an object naming at least one server")
    changes: dict[str, dict[str, Any]] = {}
    for server, entry in entries.items():
        where = f"{key}[{json.dumps(server)}]"
        if not server:
            raise AdminError(400, f"{where}: a server's address or id, not an empty name")
        change = {"weight": entry} if key == "weights" else entry
        changes[server] = _change_of(change, where + ("" if key == "weights" else "."))
    return changes


def parse_model_weights(body: bytes) -> dict[str, int | None]:
    """The weights a model alias's PATCH body asks for: ``{"weights": {MODEL: N|null}}``,
    each an integer in the server weight's range or null (the configured weight again).

    Raises :class:`AdminError` (400) naming the entry at fault.
    """
    example = '{"weights": {"llama-v1": 0, "llama-v2": 10}}'
    data = _body_json(body, example)
    if not isinstance(data, dict) or set(data) != {"weights"}:
        raise AdminError(400, f"body: expected {example}, got {_shown(data)}")
    entries = data["weights"]
    if not isinstance(entries, dict) or not entries:
        raise AdminError(400, "weights: expected an object naming at least one target model")
    weights: dict[str, int | None] = {}
    for model, value in entries.items():
        weights[model] = _weight(value, f"weights[{json.dumps(model)}]")
    return weights


def _weight(value: Any, field: str) -> int | None:
    """A weight as the admin API takes it: an integer in range, or null (the configured)."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not SERVER_WEIGHT.contains(value)
    ):
        raise AdminError(
            400,
            f"{field}: expected an integer from {SERVER_WEIGHT.text} or null (the configured"
            f" weight), got {_shown(value)}",
        )
    return value


def _body_json(body: bytes, example: str) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise AdminError(
            400, f"body: not JSON ({exc}); expected an object such as {example}"
        ) from None


def _change_of(data: Any, where: str) -> dict[str, Any]:
    """One server's change, checked; ``where`` prefixes the field in messages."""
    at = where.rstrip(".") or "body"
    if not isinstance(data, dict):
        raise AdminError(
            400, f"{at}: expected a JSON object with weight, drain or down, got {_kind(data)}"
        )
    if not data:
        raise AdminError(400, f"{at}: empty object; set at least one of weight, drain, down")
    change: dict[str, Any] = {}
    for key, value in data.items():
        field = where + key if where.endswith(".") or not where else where
        if key not in _CHANGE_FIELDS:
            raise AdminError(400, f"{field}: unknown field; expected weight, drain or down")
        if key == "weight":
            _weight(value, field)
        elif not isinstance(value, bool):
            raise AdminError(400, f"{field}: expected true or false, got {_shown(value)}")
        change[key] = value
    return change


def _fields(change: Mapping[str, Any]) -> str:
    """``weight=0 drain=true``: a change as the log shows it."""
    return " ".join(f"{key}={json.dumps(value)}" for key, value in change.items())


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", type(None): "null"}.get(type(value), "a number")


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


TokenSource = str | Callable[[], str | None] | None
"""A token, or a function returning the current one (None: no token)."""


class AdminApp:
    """The ASGI application of the admin API over ``control``.

    ``token``: the bearer token changes need (None: changes refused), or a function that
    returns it, asked on every request (a reload may change it). ``open_reads``: GETs need no
    token (for a loopback listener; ``GET /ready`` never needs one). ``body_timeout``: seconds
    a request body may take.
    """

    def __init__(
        self,
        control: Control,
        token: TokenSource,
        *,
        open_reads: bool,
        body_timeout: float = BODY_TIMEOUT,
    ) -> None:
        self.control = control
        self._token = token
        self.open_reads = open_reads
        self.body_timeout = body_timeout

    @property
    def token(self) -> str | None:
        return self._token() if callable(self._token) else self._token

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
        elif scope["type"] == "http":
            response = await self._respond(scope, receive)
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": [
                        (b"content-type", response.content_type.encode()),
                        (b"content-length", str(len(response.body)).encode()),
                        (b"cache-control", b"no-store"),
                        *response.headers,
                    ],
                }
            )
            await send({"type": "http.response.body", "body": response.body})

    async def _respond(self, scope: Mapping[str, Any], receive: Any) -> _Response:
        method: str = scope["method"]
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        path = raw_path.split(b"?", 1)[0].decode("latin-1")
        # Split before decoding: a group name may hold an encoded "/" (%2F).
        segments = [unquote(segment) for segment in path.split("/")[1:]]
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "unknown client"
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        if sum(len(name) + len(value) + 4 for name, value in raw_headers) > _MAX_HEAD:
            # Hypercorn bounds a head only while it is incomplete, and reads 64 KiB at once.
            return _error(431, f"request head larger than {_MAX_HEAD} bytes (RFC 6585 §5)", _CLOSE)
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1") for name, value in raw_headers
        }
        try:
            return await self._route(method, segments, scope, headers, receive, who)
        except AdminError as exc:
            if exc.status in (401, 403):
                log.warning("admin: %s: %s %s refused: %s", who, method, path, exc.message)
                extra = [(b"www-authenticate", b'Bearer realm="muxproxy"')] * (exc.status == 401)
                return _error(exc.status, exc.message, *extra)
            if exc.status in (408, 413):
                # What is left of the body is not read: the connection cannot be reused.
                return _error(exc.status, exc.message, _CLOSE)
            if isinstance(exc, _MethodNotAllowed):
                # RFC 9110 §15.5.6: a 405 lists the methods the resource takes.
                return _error(405, exc.message, (b"allow", exc.allowed.encode()))
            return _error(exc.status, exc.message)

    async def _route(
        self,
        method: str,
        segments: list[str],
        scope: Mapping[str, Any],
        headers: Mapping[str, str],
        receive: Any,
        who: str,
    ) -> _Response:
        match segments:
            case ["ready"]:
                _allow(method, "GET")
                return _ready(self.control.readiness())
            case ["status"]:
                _allow(method, "GET")
                self._authorize(headers, change=False)
                return _json(200, await self.control.status())
            case ["metrics"]:
                _allow(method, "GET")
                self._authorize(headers, change=False)
                text = await self.control.metrics()
                return _Response(status=200, body=text, content_type=_PROMETHEUS)
            case ["upstreams", group, "servers", server] if group and server:
                _allow(method, "PATCH")
                self._authorize(headers, change=True)
                change = parse_change(await _read_body(receive, headers, self.body_timeout))
                try:
                    entry = await self.control.change_server(group, server, change)
                except AdminError as exc:
                    log.info(
                        "admin: %s: upstream %s server %s: %s refused: %s",
                        who,
                        group,
                        server,
                        _fields(change),
                        exc.message,
                    )
                    raise
                log.info(
                    "admin: %s: upstream %s server %s: %s",
                    who,
                    group,
                    entry["address"],
                    _fields(change),
                )
                return _json(200, entry)
            case ["upstreams", group] if group:
                _allow(method, "PATCH")
                self._authorize(headers, change=True)
                changes = parse_group_change(await _read_body(receive, headers, self.body_timeout))
                what = "; ".join(f"{server} {_fields(c)}" for server, c in changes.items())
                try:
                    answer = await self.control.change_group(group, changes)
                except AdminError as exc:
                    why = exc.message
                    log.info("admin: %s: upstream %s: %s refused: %s", who, group, what, why)
                    raise
                version = answer["version"]
                at = "" if version is None else f" (fleet version {version})"
                log.info("admin: %s: upstream %s: %s%s", who, group, what, at)
                return _json(200, answer)
            case ["models", alias] if alias:
                _allow(method, "PATCH")
                self._authorize(headers, change=True)
                weights = parse_model_weights(await _read_body(receive, headers, self.body_timeout))
                what = _fields(weights)
                try:
                    answer = await self.control.change_models(alias, weights)
                except AdminError as exc:
                    log.info("admin: %s: model %s: %s refused: %s", who, alias, what, exc.message)
                    raise
                log.info("admin: %s: model %s: %s", who, alias, what)
                return _json(200, answer)
            case ["reload"]:
                _allow(method, "POST")
                self._authorize(headers, change=True)
                restart = _flag(scope.get("query_string", b""), "restart")
                await _read_body(receive, headers, self.body_timeout)  # read within bounds
                what = "rolling restart" if restart else "reload"
                result = await self.control.reload(restart=restart)
                if result.ok:
                    log.info("admin: %s: %s: generation %d", who, what, result.generation)
                    return _json(200, {"ok": True, "generation": result.generation})
                log.warning("admin: %s: %s refused: %s", who, what, "; ".join(result.errors))
                return _json(
                    422, {"ok": False, "errors": result.errors, "generation": result.generation}
                )
        raise AdminError(
            404,
            f"no such endpoint: /{'/'.join(segments)}; expected GET /ready, GET /status,"
            " GET /metrics, PATCH /upstreams/GROUP/servers/SERVER, PATCH /upstreams/GROUP,"
            " PATCH /models/ALIAS or POST /reload",
        )

    def _authorize(self, headers: Mapping[str, str], *, change: bool) -> None:
        if not change and self.open_reads:
            return
        token = self.token
        if token is None:
            raise AdminError(
                403,
                ("changes" if change else "reads on a non-loopback address")
                + f" need a token: set [admin] token in the configuration or {ADMIN_TOKEN_ENV},"
                " and send it as Authorization: Bearer TOKEN",
            )
        # RFC 9110 §11.1: the auth-scheme is case-insensitive; read as everywhere else.
        value = headers.get("authorization", "").encode("latin-1")
        scheme, _, given = normal_credentials(value).partition(b" ")
        if scheme.lower() != b"bearer" or not given:
            raise AdminError(401, "missing token; send Authorization: Bearer TOKEN")
        if not hmac.compare_digest(given, token.encode()):
            raise AdminError(401, "wrong token")


def _ready(readiness: Readiness) -> _Response:
    if readiness is Readiness.READY:
        return _json(200, {"ready": True})
    # RFC 9110 §15.6.4: 503, the server is unable to handle requests now; a probe or a load
    # balancer only needs the status, the reason is for whoever looks.
    return _json(503, {"ready": False, "reason": readiness.value})


def _allow(method: str, allowed: str) -> None:
    if method != allowed:
        raise _MethodNotAllowed(allowed)


class _MethodNotAllowed(AdminError):
    def __init__(self, allowed: str) -> None:
        super().__init__(405, f"method not allowed; this endpoint takes {allowed}")
        self.allowed = allowed


def _flag(query_string: bytes, name: str) -> bool:
    values = parse_qs(query_string.decode("latin-1"), keep_blank_values=True).get(name, ["0"])
    value = values[-1].lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise AdminError(400, f"{name}: expected 1 or 0, got {_shown(value)}")


async def _read_body(receive: Any, headers: Mapping[str, str], timeout: float) -> bytes:
    """The request body, at most ``MAX_BODY`` bytes, within ``timeout`` seconds."""
    too_large = f"body: larger than {MAX_BODY} bytes; a change is a small JSON object"
    length = headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY:
        raise AdminError(413, too_large)
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(timeout) as scope:
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise AdminError(400, "body: the client went away before sending all of it")
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                raise AdminError(413, too_large)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
    if scope.cancelled_caught:
        raise AdminError(408, f"body: not received within {timeout:g} seconds")
    return b"".join(chunks)


def _hypercorn_config(address: str) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [address]
    config.accesslog = None
    config.errorlog = _http_log
    config.keep_alive_timeout = _IDLE_TIMEOUT
    config.read_timeout = int(_READ_TIMEOUT)
    config.h11_max_incomplete_size = _MAX_HEAD
    config.graceful_timeout = 1.0
    return config


async def serve_admin(
    address: str,
    control: Control,
    token: TokenSource,
    *,
    body_timeout: float = BODY_TIMEOUT,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin API for ``control`` on ``address`` (``host:port``) until cancelled.

    ``token`` guards changes (None: changes are refused; a function: asked on every request,
    so a reload can change it); reads are open when ``address`` is loopback, ``GET /ready``
    on any address. ``task_status.started((host, port))`` reports the address bound (port 0:
    any free port). ``body_timeout``: seconds a request body may take to arrive. Raises
    ``OSError`` when the address cannot be bound.
    """
    host = address.rsplit(":", 1)[0].strip("[]")
    app: Any = AdminApp(control, token, open_reads=is_loopback(host), body_timeout=body_timeout)
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(hypercorn_serve, app, _hypercorn_config(address))
        )
        bound_host, _, port = binds[0].removeprefix("http://").rpartition(":")
        task_status.started((bound_host.strip("[]"), int(port)))
