"""CPU cost of relaying one SSE event through the sans-IO core, in microseconds (no sockets).

What it measures: one ``ProxyCore`` (config: one route, one HTTP/1.1 upstream, like
``quick_config``) driven the way the Trio driver drives it, with no I/O at all. A client opens
one stream ``GET /sse``; the backend answers ``200`` with a chunked ``text/event-stream`` head.
Then the timed loop feeds the backend connection ``N`` chunks ``%x\\r\\n<event>\\r\\n`` of one
SSE event of about 190 bytes each (an OpenAI-style ``chat.completion.chunk``), and after each
``handle`` call reports what the core wrote as one ``DataSent`` per connection (the sum of that
batch's ``SendData`` bytes, as the driver does). Each figure is the median over ``--runs`` runs,
each run on a fresh core, of (loop time / events), so it includes building the ``DataReceived``
and ``DataSent`` events, the core's dispatch, decoding the backend's chunked body (h11, or the
core's own decoder where it has one), the SSE boundary tracker, and h11 or h2 framing the bytes
for the client. Garbage collection stays on. The first line of output says which h11 build and
which muxproxy tree were measured.

Cases:

- ``h1-h1``: HTTP/1.1 client, HTTP/1.1 backend; one event per ``DataReceived``.
- ``h2-h1``: h2c client (prior knowledge; preface, SETTINGS and HEADERS made by the ``h2``
  library) to the same backend. The client opens the flow-control windows to 2**31-1 before
  the loop, so the proxy never stalls and the loop never has to parse DATA frames.
- ``h1-h1-batch32`` / ``h2-h1-batch32``: the same, but one ``DataReceived`` carries 32 events
  (a backend that wrote faster than the proxy read); still reported per event.

The backend's head and chunks and the HTTP/1.1 client's request are written by hand, so in the
timed loop only the core itself uses h11. Before timing, every case relays a short stream and
checks with real peers (h11 / h2) that the client gets exactly the backend's events.

``--h11 mypyc`` makes ``import h11`` resolve to ``h11_mypyc`` (the compiled fork on PyPI, which
installs under that name beside ``h11``) for this process, before muxproxy is imported.
``--profile`` runs the loop of the first case (``--cases``; ``h1-h1`` first by default)
under cProfile and prints the top functions by own time and the own time summed by layer.

    . .venv/bin/activate
    python bench/core_bench.py                       # markdown table
    python bench/core_bench.py --h11 mypyc --json    # needs ``pip install h11-mypyc``
    python bench/core_bench.py --profile --events 20000
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import platform
import pstats
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

CLIENT = 1
BACKEND = "127.0.0.1:9001"
CASES = ("h1-h1", "h2-h1", "h1-h1-batch32", "h2-h1-batch32")
BATCH = 32
WINDOW_MAX = 2**31 - 1

RESPONSE_HEAD = (
    b"HTTP/1.1 200 OK\r\n"
    b"Content-Type: text/event-stream\r\n"
    b"Cache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n"
    b"\r\n"
)
H1_REQUEST = b"GET /sse HTTP/1.1\r\nHost: proxy.example\r\nAccept: text/event-stream\r\n\r\n"


def select_h11(which: str) -> None:
    """Make ``import h11`` give the chosen build; call before importing muxproxy."""
    if which == "mypyc":
        import h11_mypyc

        sys.modules["h11"] = h11_mypyc
    repo = str(Path(__file__).resolve().parent.parent)
    if repo not in sys.path:
        sys.path.insert(0, repo)


def h11_in_use() -> str:
    """Name, version and build of the h11 module the core actually imported."""
    import muxproxy.core.http1.h1 as h1

    module = h1.h11
    connection = sys.modules[module.__name__ + "._connection"]
    built = "compiled" if str(connection.__file__).endswith(".so") else "pure Python"
    core = "compiled" if str(h1.__file__).endswith(".so") else "pure Python"
    where = Path(h1.__file__).parent
    return f"{module.__name__} {module.__version__} ({built}), core ({core}) from {where}"


def sse_event(i: int) -> bytes:
    """One SSE event of about 190 bytes (an OpenAI-style streaming chunk)."""
    body = (
        '{"id":"chatcmpl-9f3c2a1b7e","object":"chat.completion.chunk","created":1718000000,'
        f'"model":"m","choices":[{{"index":0,"delta":{{"content":"tok{i:06d}"}},'
        '"finish_reason":null}]}'
    )
    return b"data: " + body.encode() + b"\n\n"


def chunked(event: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(event), event)


class Driver:
    """Feeds events to one core like the Trio driver: DataSent per connection after a batch."""

    def __init__(self) -> None:
        import attrs

        from muxproxy.config import quick_config
        from muxproxy.core.commands import OpenConnection, SendData
        from muxproxy.core.events import DataReceived, DataSent
        from muxproxy.core.proxy import ProxyCore

        config = quick_config("127.0.0.1:8080", [BACKEND])
        self.core = ProxyCore(attrs.evolve(config))
        self.now = 0.0
        self.send_data = SendData
        self.open_connection = OpenConnection
        self.data_received = DataReceived
        self.data_sent = DataSent
        self.client_bytes: list[bytes] = []
        """What the core wrote to the client (kept only while ``keep`` is set)."""
        self.keep = True
        self.upstream: int | None = None

    def feed(self, event: Any) -> int:
        """Handle ``event`` and report what was written; return bytes written to the client."""
        send_data = self.send_data
        pending = [event]
        to_client = 0
        while pending:
            written: dict[int, int] = {}
            for command in self.core.handle(pending.pop()):
                if type(command) is send_data:
                    conn = command.conn
                    written[conn] = written.get(conn, 0) + len(command.data)
                    if conn == CLIENT:
                        to_client += len(command.data)
                        if self.keep:
                            self.client_bytes.append(command.data)
                elif type(command) is self.open_connection:
                    self.upstream = command.conn
            for conn, nbytes in written.items():
                pending.append(self.data_sent(now=self.now, conn=conn, nbytes=nbytes))
        return to_client

    def receive(self, conn: int, data: bytes) -> int:
        return self.feed(self.data_received(now=self.now, conn=conn, data=data))


def open_stream(proto: str) -> tuple[Driver, Any]:
    """A core with one client stream ``GET /sse`` answered by an SSE head; (driver, h2 peer)."""
    from muxproxy.core.events import ConnectionAccepted, ConnectionOpened

    driver = Driver()
    driver.feed(
        ConnectionAccepted(now=0.0, conn=CLIENT, listener="l", peer=("10.0.0.7", 5555), tls=False)
    )
    peer = None
    if proto == "h1":
        driver.receive(CLIENT, H1_REQUEST)
    else:
        import h2.config
        import h2.connection
        import h2.settings

        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        peer = h2.connection.H2Connection(config=config)
        peer.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW_MAX}
        )
        peer.initiate_connection()
        peer.increment_flow_control_window(WINDOW_MAX - peer.inbound_flow_control_window)
        headers = [
            (b":method", b"GET"),
            (b":scheme", b"http"),
            (b":authority", b"proxy.example"),
            (b":path", b"/sse"),
            (b"accept", b"text/event-stream"),
        ]
        peer.send_headers(1, headers, end_stream=True)
        driver.receive(CLIENT, peer.data_to_send())
        peer.receive_data(b"".join(driver.client_bytes))  # the proxy's SETTINGS: ACK them
        driver.client_bytes.clear()
        driver.receive(CLIENT, peer.data_to_send())
    if driver.upstream is None:
        raise RuntimeError("the core opened no backend connection")
    driver.feed(ConnectionOpened(now=0.0, conn=driver.upstream))
    if not driver.receive(driver.upstream, RESPONSE_HEAD):
        raise RuntimeError("the core sent the client no response head")
    return driver, peer


def payloads(case: str, events: int) -> list[bytes]:
    """What the backend writes in the loop: one chunk per read, or 32 chunks per read."""
    chunks = [chunked(sse_event(i)) for i in range(events)]
    if not case.endswith(f"batch{BATCH}"):
        return chunks
    return [b"".join(chunks[i : i + BATCH]) for i in range(0, events, BATCH)]


def relay(case: str, events: int, *, keep: bool) -> tuple[Driver, Any, Callable[[], None]]:
    """Set up ``case`` and return the loop that relays ``events`` events (not yet run)."""
    driver, peer = open_stream(case[:2])
    if not keep:
        driver.client_bytes.clear()
    driver.keep = keep
    upstream = driver.upstream
    assert upstream is not None
    reads = payloads(case, events)
    receive = driver.receive

    def loop() -> None:
        for data in reads:
            driver.now += 0.001
            if not receive(upstream, data):
                raise RuntimeError("the core wrote nothing to the client: stalled?")

    return driver, peer, loop


def check(case: str, events: int = 2 * BATCH) -> None:
    """Relay a short stream; the client must decode exactly the backend's events."""
    import h2.events
    import h11

    driver, peer, loop = relay(case, events, keep=True)
    loop()
    out = b"".join(driver.client_bytes)
    if peer is None:
        client = h11.Connection(h11.CLIENT)
        client.send(h11.Request(method="GET", target="/sse", headers=[("Host", "x")]))
        client.send(h11.EndOfMessage())
        client.receive_data(out)
        parts = []
        while (event := client.next_event()) is not h11.NEED_DATA:
            if type(event) is h11.Data:
                parts.append(bytes(event.data))
        body = b"".join(parts)
    else:
        received = peer.receive_data(out)
        body = b"".join(e.data for e in received if isinstance(e, h2.events.DataReceived))
    expected = b"".join(sse_event(i) for i in range(events))
    if body != expected:
        raise AssertionError(f"{case}: the client got {len(body)} bytes, not the events")


def time_case(case: str, events: int, runs: int) -> list[float]:
    """Microseconds per event of each run, each on a fresh core."""
    samples = []
    for _ in range(runs):
        _, _, loop = relay(case, events, keep=False)
        gc.collect()
        start = time.perf_counter_ns()
        loop()
        samples.append((time.perf_counter_ns() - start) / events / 1000)
    return samples


def layer(filename: str, name: str) -> str:
    """Which part of the stack a cProfile entry belongs to."""
    import h11

    if "h11" in filename or "h11" in name:
        return "h11"
    # A method of a compiled (mypyc) h11 class shows as "<method 'send' of 'Connection' objects>".
    owner = re.fullmatch(r"<method '\w+' of '(\w+)' objects>", name)
    if filename == "~" and owner and isinstance(getattr(h11, owner[1], None), type):
        return "h11"
    if "/muxproxy/" in filename:
        return "muxproxy core"
    if "attrs generated" in filename:
        return "attrs (generated __init__ etc.)"
    if "/h2/" in filename or "/hpack/" in filename or "/hyperframe/" in filename:
        return "h2 / hpack / hyperframe"
    if filename.endswith("core_bench.py"):
        return "benchmark driver"
    if filename in ("~", "<string>"):
        return "C (called from C)"
    return "other Python"


def profile(events: int, top: int, case: str = "h1-h1") -> None:
    _, _, loop = relay(case, events, keep=False)
    profiler = cProfile.Profile()
    profiler.enable()
    loop()
    profiler.disable()
    stats = pstats.Stats(profiler)
    entries: list[tuple[float, int, str, str]] = []
    layers: dict[str, float] = defaultdict(float)
    total = 0.0
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = stats.stats  # type: ignore[attr-defined]
    for (filename, line, name), (_, calls, tottime, _, callers) in raw.items():
        where = f"{Path(filename).name}:{line}({name})" if filename != "~" else name
        entries.append((tottime, calls, where, filename))
        total += tottime
        if filename not in ("~", "<string>") or layer(filename, name) == "h11":
            layers[layer(filename, name)] += tottime
            continue
        # A C function (builtin, method of a C type) or one made by ``dataclasses`` (h11's
        # events): its time goes to its callers' layers.
        for (caller_file, _, caller_name), timing in callers.items():
            layers[layer(caller_file, caller_name)] += timing[2]
    entries.sort(reverse=True)
    print(f"\ncProfile of {case}, {events} events, top {top} by tottime (own time):\n")
    print("| tottime µs/event | % | calls/event | function |")
    print("|---:|---:|---:|---|")
    for tottime, calls, where, _ in entries[:top]:
        share = 100 * tottime / total
        print(f"| {tottime / events * 1e6:.2f} | {share:.1f} | {calls / events:.2f} | `{where}` |")
    print("\nOwn time by layer (C functions counted in the layer of their caller):\n")
    print("| layer | µs/event | % |")
    print("|---|---:|---:|")
    for name, seconds in sorted(layers.items(), key=lambda item: -item[1]):
        print(f"| {name} | {seconds / events * 1e6:.2f} | {100 * seconds / total:.1f} |")
    print(f"| total (profiled) | {total / events * 1e6:.2f} | 100 |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000, help="events per run")
    parser.add_argument("--runs", type=int, default=5, help="runs per case (median reported)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    parser.add_argument(
        "--h11",
        choices=("installed", "mypyc"),
        default="installed",
        help="installed: whatever `import h11` finds; mypyc: alias h11_mypyc as h11",
    )
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the loop of the first --cases case"
    )
    parser.add_argument("--top", type=int, default=15, help="functions shown by --profile")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args()
    select_h11(args.h11)
    cases = [c for c in args.cases.split(",") if c]
    for case in cases:
        if case not in CASES:
            parser.error(f"unknown case {case!r}; known: {', '.join(CASES)}")
        check(case)
    results = {case: time_case(case, args.events, args.runs) for case in cases}
    used = h11_in_use()
    if args.json:
        medians = {case: statistics.median(s) for case, s in results.items()}
        print(json.dumps({"h11": used, "median_us": medians, "samples_us": results}))
    else:
        print(f"Python {platform.python_version()}, {used}, {args.events} events x {args.runs}")
        print("\n| case | µs/event (median) | min | max |")
        print("|---|---:|---:|---:|")
        for case, s in results.items():
            print(f"| {case} | {statistics.median(s):.2f} | {min(s):.2f} | {max(s):.2f} |")
    if args.profile:
        profile(args.events, args.top, cases[0] if cases else "h1-h1")


if __name__ == "__main__":
    main()
