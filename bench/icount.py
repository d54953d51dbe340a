"""User-space instructions per token and per request through the real server (callgrind).

Timings on a shared 2-vCPU machine move by 10-20 % from run to run; instruction counts do not
(two runs agree to 0.1 %). This runs the real ``ProxyServer`` in-process (reactor, driver,
core, h11) on loopback sockets, with the backend and the clients as plain non-blocking sockets
of the same process, under ``valgrind --tool=callgrind``, twice with different sizes: the
difference divided by the difference in size is the cost of one unit, start-up excluded.
Valgrind counts user-space instructions only, so the kernel's TCP work, which is the same for
any proxy, is left out: what remains is Python's work (muxproxy, Trio, h11), plus the harness's
own sends and receives.

Modes:

- ``token``: one stream, one SSE event at a time (the next is sent when the client got the
  last): the paced case, one token per round of the reactor;
- ``batch``: 32 streams, one event each per round; per event (the harness waits once per
  round for all 32 clients);
- ``token-h2``: ``token`` for an h2c client (prior knowledge, its windows opened to 2**31-1
  first so that it never needs to send a WINDOW_UPDATE): each event reaches it as one DATA
  frame, counted by its length, never parsed;
- ``request``: sequential ``GET /sse`` requests on one kept-alive connection (2 request fields,
  4 response fields), each answered with a head, one event and the last chunk; per request;
- ``request-h2``: ``request`` for an h2c client: sequential ``GET /sse`` streams on one
  connection (after the first, HPACK sends every field as a dynamic-table index, as a kept-alive
  HTTP/2 client does); the response read frame by frame up to its END_STREAM, never parsed by h2;
- ``openai``: the same with the request of the OpenAI Python SDK (15 fields, a JSON body) and
  a vLLM-like response head; per request;
- ``h11-floor``: no proxy, h11 alone doing what any h11-based proxy does for one ``openai``
  request: parse the request head and body, send the request head and body, parse the
  response head, send it and the body. The floor of the request path while heads go through
  h11.
- ``h11-floor-get``: the same for the ``request`` mode's ``GET /sse`` and its response (the
  TTFB probe of ``sse_bench.py``).

    python bench/icount.py                   # every mode, a markdown table
    python bench/icount.py --modes token,openai --src /tmp/wt-old   # an older checkout
    python bench/icount.py --run openai 100  # one plain run (no valgrind), for profiling
    python bench/icount.py --h11 mypyc       # h11's compiled fork (pip install h11-mypyc)
    python bench/icount.py --modes request --extension trivial_hook:RequestHeadOnly
                                             # what a hook costs (``[[extensions]]``)
    python bench/otlp_sink.py 4318 &         # a collector that takes everything
    python bench/icount.py --modes request,openai --telemetry http://127.0.0.1:4318
                                             # what [telemetry] costs (the export threads too)
    python bench/icount.py --modes request,request-h2 --routes 100
                                             # a route table of 100 prefixes (/r0/ ... /r99/),
                                             # every request for the last
"""

from __future__ import annotations

import argparse
import os
import re
import select
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODES = (
    "token",
    "token-h2",
    "batch",
    "request",
    "request-h2",
    "openai",
    "h11-floor",
    "h11-floor-get",
)
SIZES = {"token": (200, 1200), "token-h2": (200, 1200), "batch": (20, 120), "request": (50, 250)}
"""Units of the small and the large run of each mode (the others: ``request``'s)."""
BATCH = 32
H11_ENV = "ICOUNT_H11"
"""``--h11``, passed to the runs under valgrind."""
EXTENSION_ENV = "ICOUNT_EXTENSION"
"""``--extension``, passed to the runs under valgrind."""
TELEMETRY_ENV = "ICOUNT_TELEMETRY"
"""``--telemetry``, passed to the runs under valgrind."""
ROUTES_ENV = "ICOUNT_ROUTES"
"""``--routes``, passed to the runs under valgrind."""

GET = b"GET /sse HTTP/1.1\r\nhost: x\r\naccept: text/event-stream\r\n\r\n"
"""``request``'s request; with ``--routes N``, its target is the last route's (``routed``)."""
GET_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
OPENAI_BODY = (
    b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":16,"n":1}'
)
OPENAI = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
    b"Accept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\nAccept: application/json\r\n"
    b"Content-Type: application/json\r\nUser-Agent: OpenAI/Python 1.54.0\r\n"
    b"X-Stainless-Lang: python\r\nX-Stainless-Package-Version: 1.54.0\r\n"
    b"X-Stainless-OS: Linux\r\nX-Stainless-Arch: x64\r\nX-Stainless-Runtime: CPython\r\n"
    b"X-Stainless-Runtime-Version: 3.11.7\r\nAuthorization: Bearer sk-test-0123456789abcdef\r\n"
    b"X-Stainless-Async: false\r\nx-stainless-retry-count: 0\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(OPENAI_BODY), OPENAI_BODY)
)
OPENAI_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ndate: Mon, 30 Nov 2026 05:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-type: text/event-stream; charset=utf-8\r\n"
    b"x-request-id: chatcmpl-8f7a6b5c4d3e2f1a\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENT = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
CHUNK = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
LAST = b"0\r\n\r\n"


def run(mode: str, n: int) -> None:
    """One run of ``mode`` with ``n`` units (tokens, rounds or requests)."""
    if mode == "h11-floor":
        h11_floor(n, OPENAI, OPENAI_RESPONSE)
        return
    if mode == "h11-floor-get":
        h11_floor(n, GET, GET_RESPONSE)
        return
    import trio

    trio.run(serve_through_proxy, mode, n)


async def serve_through_proxy(mode: str, n: int) -> None:
    import trio

    from muxproxy.config import quick_config
    from muxproxy.trio.server import ProxyServer

    async def read_until(sock: socket.socket, marker: bytes) -> bytes:
        buf = b""
        while marker not in buf:
            await trio.lowlevel.wait_readable(sock)
            buf += sock.recv(65536)
        return buf

    request, response = (OPENAI, OPENAI_RESPONSE) if mode == "openai" else (GET, GET_RESPONSE)
    # What the backend has of a request once it has all of it (the proxy rewrites the head).
    request_end = OPENAI_BODY if mode == "openai" else b"\r\n\r\n"
    h2_first, h2_next = h2_request()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(BATCH)
    listener.setblocking(False)
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{listener.getsockname()[1]}"])
    if os.environ.get(EXTENSION_ENV):
        import attrs

        from muxproxy.config.extensions import ExtensionConfig

        extension = ExtensionConfig(module=os.environ[EXTENSION_ENV])
        config = attrs.evolve(config, extensions=(extension,))
    routes = int(os.environ.get(ROUTES_ENV) or 0)
    if routes:
        config, request, h2_first, h2_next = routed(config, routes, request, h2_first, h2_next)
    if os.environ.get(TELEMETRY_ENV):
        import attrs

        from muxproxy.config.telemetry import TelemetrySettings

        telemetry = TelemetrySettings(otlp_endpoint=os.environ[TELEMETRY_ENV])
        config = attrs.evolve(config, telemetry=telemetry)
    async with trio.open_nursery() as nursery:
        addresses = await nursery.start(ProxyServer(config).run)
        pairs: list[tuple[socket.socket, socket.socket]] = []
        for _ in range(BATCH if mode == "batch" else 1):
            client = socket.create_connection(addresses[0])
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
            client.setblocking(False)
            client.send(h2_first if mode in ("token-h2", "request-h2") else request)
            await trio.lowlevel.wait_readable(listener)
            backend, _ = listener.accept()
            backend.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
            backend.setblocking(False)
            await read_until(backend, request_end)
            backend.send(response + CHUNK)
            await read_until(client, EVENT)
            pairs.append((client, backend))
        if mode in ("request", "openai"):
            client, backend = pairs[0]
            backend.send(LAST)
            await read_until(client, LAST)
            for _ in range(n):
                client.send(request)
                await read_until(backend, request_end)
                backend.send(response + CHUNK + LAST)
                await read_until(client, LAST)
        elif mode == "request-h2":
            client, backend = pairs[0]
            backend.send(LAST)
            await read_h2_until_end(client, 1)
            for i in range(n):
                sid = 3 + 2 * i
                client.send(h2_next[:5] + sid.to_bytes(4, "big") + h2_next[9:])
                await read_until(backend, request_end)
                backend.send(response + CHUNK + LAST)
                await read_h2_until_end(client, sid)
        elif mode == "token-h2":
            client, backend = pairs[0]
            frame = 9 + len(EVENT)  # RFC 9113 §4.1: a 9-byte frame header, then the event
            for _ in range(n):
                backend.send(CHUNK)
                got = 0
                while got < frame:
                    await trio.lowlevel.wait_readable(client)
                    got += len(client.recv(65536))
                assert got == frame, got
        else:
            # The clients' sockets in an epoll set of their own: the harness waits once per
            # round, not once per client, so the count is mostly the proxy's.
            clients = select.epoll()
            by_fd = {client.fileno(): client for client, _ in pairs}
            for fd in by_fd:
                clients.register(fd, select.EPOLLIN)
            for _ in range(n):
                for _, backend in pairs:
                    backend.send(CHUNK)
                got = 0
                while got < len(pairs):
                    await trio.lowlevel.wait_readable(clients.fileno())
                    for fd, _ in clients.poll(0):
                        # One event per client per round: the proxy writes each in one send.
                        assert by_fd[fd].recv(65536) == CHUNK
                        got += 1
            clients.close()
        nursery.cancel_scope.cancel()


def routed(
    config: Any, routes: int, request: bytes, h2_first: bytes, h2_next: bytes
) -> tuple[Any, bytes, bytes, bytes]:
    """``config`` with ``routes`` routes of distinct prefixes (``/r0/`` ... ``/rN-1/``, all to
    the one group), and the requests of ``GET /sse`` with the last route's target instead."""
    import attrs

    from muxproxy.config import Route

    table = tuple(Route(prefix=f"/r{i}/", upstream="default") for i in range(routes))
    target = f"/r{routes - 1}/sse"
    h2_first, h2_next = h2_request(target)
    return (
        attrs.evolve(config, routes=table),
        request.replace(b" /sse ", b" %s " % target.encode()),
        h2_first,
        h2_next,
    )


async def read_h2_until_end(sock: socket.socket, stream: int) -> None:
    """Read HTTP/2 frames (RFC 9113 §4.1) until one of ``stream`` carries END_STREAM."""
    import trio

    buf = b""
    while True:
        await trio.lowlevel.wait_readable(sock)
        buf += sock.recv(65536)
        while len(buf) >= 9:
            end = 9 + int.from_bytes(buf[:3], "big")
            if len(buf) < end:
                break
            kind, flags, sid = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
            buf = buf[end:]
            if sid == stream and kind in (0, 1) and flags & 0x1:
                return


def h2_request(path: str = "/sse") -> tuple[bytes, bytes]:
    """An h2c client's preface, SETTINGS (the largest initial window), a connection
    WINDOW_UPDATE to 2**31-1 and the HEADERS of ``GET /sse``, made by the h2 library; and the
    HEADERS frame of the same request on stream 3, every field then a dynamic-table index."""
    import h2.config
    import h2.connection
    import h2.settings

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    conn.increment_flow_control_window(2**31 - 1 - 65535)
    headers = [(":method", "GET"), (":path", path), (":scheme", "http"), (":authority", "x")]
    conn.send_headers(1, [*headers, ("accept", "text/event-stream")], end_stream=True)
    first = conn.data_to_send()
    conn.send_headers(3, [*headers, ("accept", "text/event-stream")], end_stream=True)
    return first, conn.data_to_send()


def h11_floor(n: int, request_bytes: bytes, response_bytes: bytes) -> None:
    import h11

    server, client = h11.Connection(h11.SERVER), h11.Connection(h11.CLIENT)
    for _ in range(n):
        server.receive_data(request_bytes)
        head = server.next_event()
        assert isinstance(head, h11.Request)
        client.send(h11.Request(method=head.method, target=head.target, headers=head.headers))
        body = server.next_event()
        if isinstance(body, h11.Data):
            client.send(h11.Data(data=body.data))
            body = server.next_event()
        assert isinstance(body, h11.EndOfMessage)
        client.send(h11.EndOfMessage())
        client.receive_data(response_bytes + CHUNK + LAST)
        response, data = client.next_event(), client.next_event()
        assert isinstance(response, h11.Response) and isinstance(data, h11.Data)
        client.next_event()
        server.send(h11.Response(status_code=response.status_code, headers=response.headers))
        server.send(h11.Data(data=data.data))
        server.send(h11.EndOfMessage())
        server.start_next_cycle()
        client.start_next_cycle()


def instructions(valgrind: str, src: Path, mode: str, n: int) -> int:
    """User-space instructions of one run (callgrind's total)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--run", mode, str(n)]
    # The tree measured first; the caller's path after it (where an extra may be installed).
    path = os.pathsep.join(filter(None, (str(src), os.environ.get("PYTHONPATH"))))
    return callgrind_total(valgrind, argv, cwd=src, env={**os.environ, "PYTHONPATH": path})


def valgrind_or_exit(parser: argparse.ArgumentParser) -> str:
    """valgrind's path, or the parser's error exit when it is not installed."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        parser.error("valgrind not found (apt-get install valgrind)")
    return valgrind


def callgrind_total(
    valgrind: str, argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> int:
    """The user-space instructions callgrind counts for running ``argv``."""
    proc = subprocess.run(
        [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    match = re.search(r"Collected : (\d+)", proc.stderr)
    if match is None:
        raise RuntimeError(f"no instruction count from callgrind:\n{proc.stderr[-2000:]}")
    return int(match[1])


def per_unit(valgrind: str, src: Path, mode: str) -> float:
    small, large = SIZES.get(mode, SIZES["request"])
    extra = instructions(valgrind, src, mode, large) - instructions(valgrind, src, mode, small)
    units = (large - small) * (BATCH if mode == "batch" else 1)
    return extra / units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    parser.add_argument("--src", type=Path, default=HERE.parent, help="the checkout to measure")
    parser.add_argument("--run", nargs=2, metavar=("MODE", "N"), help="one run, no valgrind")
    parser.add_argument(
        "--h11",
        choices=("pure", "mypyc"),
        default=os.environ.get(H11_ENV, "pure"),
        help="mypyc: import h11_mypyc (h11's compiled fork, beside h11) as h11",
    )
    parser.add_argument(
        "--extension",
        default=os.environ.get(EXTENSION_ENV, ""),
        metavar="MODULE:CLASS",
        help="configure this extension (importable from bench/, e.g. trivial_hook:RequestHeadOnly)",
    )
    parser.add_argument(
        "--telemetry",
        default=os.environ.get(TELEMETRY_ENV, ""),
        metavar="URL",
        help="configure [telemetry] with this otlp_endpoint (bench/otlp_sink.py serves one)",
    )
    parser.add_argument(
        "--routes",
        type=int,
        default=int(os.environ.get(ROUTES_ENV) or 0),
        metavar="N",
        help="N routes of distinct prefixes, every request for the last (0: the one route /)",
    )
    args = parser.parse_args()
    os.environ[H11_ENV] = args.h11  # the runs under valgrind inherit it
    os.environ[ROUTES_ENV] = str(args.routes)
    os.environ[EXTENSION_ENV] = args.extension
    os.environ[TELEMETRY_ENV] = args.telemetry
    if args.h11 == "mypyc":
        import h11_mypyc

        sys.modules["h11"] = h11_mypyc
    if args.run:
        run(args.run[0], int(args.run[1]))
        return
    valgrind = valgrind_or_exit(parser)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    extension = f", extension {args.extension}" if args.extension else ""
    extension += f", telemetry to {args.telemetry}" if args.telemetry else ""
    extension += f", {args.routes} routes" if args.routes else ""
    python = sys.version.split()[0]
    print(f"muxproxy from {args.src.resolve()}, Python {python}, h11 {args.h11}{extension}\n")
    print("| mode | unit | instructions per unit |\n|---|---|---:|")
    for mode in modes:
        unit = {"token": "token", "token-h2": "token", "batch": "token"}.get(mode, "request")
        print(f"| {mode} | {unit} | {per_unit(valgrind, args.src, mode):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
