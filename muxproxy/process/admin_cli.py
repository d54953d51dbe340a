"""``muxproxy admin``: the admin API from the command line (``muxproxy.trio.admin``).

``muxproxy admin [--url URL] [--token TOKEN] COMMAND``::

    status [--json]             groups, servers, weights, states, active streams
    weight GROUP SERVER N       set a server's weight (0: no new requests)
    weights GROUP SERVER=N ...  set several servers' weights as one change (a gray release's
                                step: no request sees half of it; with a fleet store, on
                                every replica at once)
    drain GROUP SERVER          no new sessions or unkeyed requests; sessions stay
    undrain GROUP SERVER
    down GROUP SERVER           nothing new at all; streams in flight finish
    up GROUP SERVER
    reload [--restart]          re-read the configuration file (--restart instead: restart the
                                workers one by one onto the installed code, --workers N)

``SERVER`` is an address as configured or the server's id as ``status`` shows it. The token
comes from ``--token`` or ``MUXPROXY_ADMIN_TOKEN``. Only the standard library is used
(``http.client``), so the command works wherever muxproxy is installed.

Exit status: 0 done; 1 the API refused (its message is printed) or could not be reached;
2 bad usage.
"""

from __future__ import annotations

import argparse
import http
import http.client
import json
import os
import sys
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlsplit

from muxproxy.config.ranges import SERVER_WEIGHT
from muxproxy.config.records import ADMIN_TOKEN_ENV

__all__ = ["DEFAULT_URL", "add_arguments", "format_status", "run"]

DEFAULT_URL = "http://127.0.0.1:9901"
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

_CHANGES = {
    "drain": {"drain": True},
    "undrain": {"drain": False},
    "down": {"down": True},
    "up": {"down": False},
}


class _Failure(Exception):
    """What to print (after ``muxproxy admin: ``) before exiting with status 1."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``muxproxy admin`` options and commands to ``parser``."""
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"the admin listener (default {DEFAULT_URL})"
    )
    parser.add_argument(
        "--token", help=f"bearer token for changes (default: the {ADMIN_TOKEN_ENV} variable)"
    )
    parser.add_argument(
        "--timeout", type=_seconds, default=30.0, help="seconds to wait for an answer (30)"
    )
    commands = parser.add_subparsers(dest="admin_command", metavar="COMMAND", required=True)
    status = commands.add_parser("status", help="show groups, servers, weights and states")
    status.add_argument("--json", action="store_true", help="print the JSON document as is")
    weight = commands.add_parser("weight", help="set a server's weight")
    _server_arguments(weight)
    weight.add_argument("weight", type=_weight, metavar="N", help="the weight, 0 or more")
    weights = commands.add_parser(
        "weights", help="set several servers' weights as one change (a gray release's step)"
    )
    weights.add_argument("group", help="upstream group")
    weights.add_argument(
        "weights",
        nargs="+",
        type=_server_weight,
        metavar="SERVER=N",
        help="a server (address as configured, or its id) and its weight",
    )
    for name, text in (
        ("drain", "drain a server: no new sessions or unkeyed requests"),
        ("undrain", "end a drain"),
        ("down", "take a server out: nothing new is sent to it"),
        ("up", "bring a server taken down back"),
    ):
        _server_arguments(commands.add_parser(name, help=text))
    reload = commands.add_parser("reload", help="re-read the configuration file")
    reload.add_argument(
        "--restart",
        action="store_true",
        help="instead, restart the workers one by one onto the installed code, with the"
        " configuration they run (--workers N; no file is read)",
    )


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("group", help="upstream group")
    parser.add_argument("server", help="server address as configured, or its id")


def _weight(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not SERVER_WEIGHT.contains(value):
        raise argparse.ArgumentTypeError(
            f"expected an integer from {SERVER_WEIGHT.text}, got {text!r}"
        )
    return value


def _server_weight(text: str) -> tuple[str, int]:
    # The last "=": neither an address nor a server id (hex) holds one.
    server, equals, weight = text.rpartition("=")
    if not equals or not server:
        raise argparse.ArgumentTypeError(
            f"expected SERVER=N, such as 10.0.0.1:8000=3, got {text!r}"
        )
    return server, _weight(weight)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    """Run the ``muxproxy admin`` command in ``args``; returns the exit status."""
    token = args.token if args.token is not None else os.environ.get(ADMIN_TOKEN_ENV) or None
    client = _Client(args.url, token, args.timeout)
    try:
        if client.problem is not None:
            print(f"muxproxy admin: --url: {client.problem}", file=sys.stderr)
            return EXIT_USAGE
        command = args.admin_command
        if command == "status":
            document = client.call("GET", "/status")
            print(json.dumps(document, indent=2) if args.json else format_status(document))
        elif command == "reload":
            path = "/reload?restart=1" if args.restart else "/reload"
            document = client.call("POST", path)
            done = "workers restarted" if args.restart else "reloaded"
            print(f"{done}: generation {document.get('generation')}")
        elif command == "weights":
            servers = [server for server, _ in args.weights]
            twice = sorted({server for server in servers if servers.count(server) > 1})
            if twice:
                print(f"muxproxy admin weights: {twice[0]} given twice", file=sys.stderr)
                return EXIT_USAGE
            path = f"/upstreams/{quote(args.group, safe='')}"
            answer = client.call("PATCH", path, {"weights": dict(args.weights)})
            version = answer.get("version")
            at = "" if version is None else f" (fleet version {version})"
            print(f"upstream {args.group}: {len(args.weights)} servers changed as one{at}")
            for entry in answer.get("servers", []):
                print(f"  {_describe_server(entry)}")
        else:
            change = {"weight": args.weight} if command == "weight" else _CHANGES[command]
            path = f"/upstreams/{quote(args.group, safe='')}/servers/{quote(args.server, safe='')}"
            entry = client.call("PATCH", path, change)
            print(f"upstream {args.group}: {_describe_server(entry)}")
    except _Failure as exc:
        print(f"muxproxy admin: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


class _Client:
    def __init__(self, url: str, token: str | None, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.problem: str | None = None
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            self.problem = f'expected a URL such as "{DEFAULT_URL}", got {url!r}'
        self.parts = parts

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        parts = self.parts
        connection_type = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        try:
            connection = connection_type(parts.netloc, timeout=self.timeout)
        except http.client.InvalidURL as exc:
            raise _Failure(f"--url: {exc}") from None
        headers = {"Accept": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            connection.request(method, parts.path + path, body=data, headers=headers)
            response = connection.getresponse()
            raw = response.read()
        except ConnectionRefusedError:
            raise _Failure(
                f"cannot connect to {self.url}: connection refused; is muxproxy serve running"
                " with an [admin] section (or --admin ADDRESS), and is --url its address?"
            ) from None
        except TimeoutError:
            raise _Failure(f"{self.url}: no answer within {self.timeout:g} seconds") from None
        except (OSError, http.client.HTTPException) as exc:
            raise _Failure(f"cannot reach {self.url}: {exc}") from None
        finally:
            connection.close()
        try:
            document = json.loads(raw)
        except ValueError:
            document = None
        if response.status == 200 and document is not None:
            return document
        raise _Failure(self._refusal(method, path, response, document, raw))

    def _refusal(
        self,
        method: str,
        path: str,
        response: http.client.HTTPResponse,
        document: Any,
        raw: bytes,
    ) -> str:
        reason = response.reason or _phrase(response.status)
        head = f"{method} {path}: {response.status} {reason}".rstrip()
        if not isinstance(document, dict):
            text = raw.decode("utf-8", "replace").strip()[:200]
            return f"{head}: {text}" if text else head
        errors = document.get("errors")
        if isinstance(errors, list) and errors:
            lines = "\n".join(f"  {error}" for error in errors)
            return f"{head}; the running configuration stays. Problems:\n{lines}"
        message = str(document.get("error", ""))
        if response.status == 401:
            hint = (
                f"pass --token or set {ADMIN_TOKEN_ENV}"
                if self.token is None
                else "check --token / " + ADMIN_TOKEN_ENV
            )
            return f"{head}: {message}; {hint}"
        return f"{head}: {message}" if message else head


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""


def _describe_server(entry: dict[str, Any]) -> str:
    weight = entry.get("weight")
    configured = entry.get("configured_weight")
    shown = f"weight {weight}" + (f" (configured {configured})" if configured != weight else "")
    return (
        f"server {entry.get('address')}: {shown}, {entry.get('state')},"
        f" {entry.get('health')}, {entry.get('active')} active"
    )


_COLUMNS = ("SERVER", "ID", "WEIGHT", "STATE", "HEALTH", "ACTIVE", "FAILURES", "WORK")
_RIGHT = frozenset({"ACTIVE", "FAILURES", "WORK"})


def format_status(document: dict[str, Any]) -> str:
    """A ``GET /status`` document as text: a summary, then one table per upstream group.

    A weight that differs from the configured one is shown as ``0 (1)``: now (configured).
    """
    lines = []
    workers = document.get("workers", [])
    pids = ", ".join(f"{w.get('pid')} (generation {w.get('generation')})" for w in workers)
    lines.append(f"generation {document.get('generation')}; workers: {pids or 'none'}")
    listeners = document.get("listeners", {})
    bound = listeners.get("bound") if isinstance(listeners, dict) else None
    if bound:
        lines.append("listening on " + ", ".join(bound))
    counts = [
        f"{key.replace('_', ' ')} {document[key]}"
        for key in ("clients", "upstream_connections", "streams")
        if key in document
    ]
    if counts:
        lines.append(", ".join(counts))
    for name, group in document.get("groups", {}).items():
        lines.append("")
        title = f"upstream {name} ({group.get('balance', '?')})"
        queue = group.get("queue") or {}
        if queue.get("waiting"):
            title += f"; {queue['waiting']} waiting in the queue (max {queue.get('max')})"
        lines.append(title)
        rows = [list(_COLUMNS)]
        for server in group.get("servers", []):
            weight = str(server.get("weight"))
            if server.get("configured_weight") != server.get("weight"):
                weight += f" ({server.get('configured_weight')})"
            rows.append(
                [
                    str(server.get("address")),
                    str(server.get("id")),
                    weight,
                    str(server.get("state")),
                    str(server.get("health")),
                    str(server.get("active")),
                    str(server.get("failures")),
                    str(server.get("work", 0)),
                ]
            )
        lines.extend("  " + line for line in _table(rows))
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    out = []
    for row in rows:
        cells = [
            cell.rjust(width) if column in _RIGHT else cell.ljust(width)
            for cell, width, column in zip(row, widths, _COLUMNS, strict=True)
        ]
        out.append("  ".join(cells).rstrip())
    return out
