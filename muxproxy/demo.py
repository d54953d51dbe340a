"""``muxproxy demo``: three fake GPU backends, the proxy in front, streaming clients.

Everything runs in one process on free loopback ports, with the runtime dependencies only: the
clients are small h11/h2 peers over Trio sockets. Each stream's tokens are printed as they
arrive, then a table with each stream's backend and time to first token (TTFT). Exit status
0 when every stream received every token, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys

import attrs
import h2.config
import h2.connection
import h2.events
import h11
import trio

from .config import quick_config
from .testing.fakellm import FakeLLM, serve_fakellm
from .trio.server import ProxyServer


@attrs.define
class StreamResult:
    label: str
    protocol: str
    backend: str = "?"
    tokens: list[str] = attrs.field(factory=list)
    started: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    done: bool = False
    """``data: [DONE]`` arrived."""


class SSEParser:
    """Incremental server-sent events parser (WHATWG HTML §9.2.6), ``data`` fields only."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> list[str]:
        self.buffer += data.replace(b"\r\n", b"\n")
        *events, self.buffer = self.buffer.split(b"\n\n")
        out = []
        for event in events:
            lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines).decode())
        return out


def _on_event(result: StreamResult, data: str, show: bool) -> None:
    if data == "[DONE]":
        result.done = True
        return
    chunk = json.loads(data)
    content = chunk["choices"][0]["delta"].get("content")
    if not content:
        return
    now = trio.current_time()
    if result.first_token is None:
        result.first_token = now
    result.tokens.append(content)
    if show:
        elapsed = (now - result.started) * 1000
        print(
            f"  {result.label:<6} {result.backend:<5} +{elapsed:7.1f} ms  {content!r}", flush=True
        )


def _request_body(tokens: int) -> bytes:
    return json.dumps(
        {
            "model": "fake-llm",
            "stream": True,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": "Say hello through muxproxy."}],
        }
    ).encode()


async def stream_h1(port: int, result: StreamResult, tokens: int, show: bool) -> None:
    """One streamed chat completion over HTTP/1.1."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        body = _request_body(tokens)
        result.started = trio.current_time()
        headers = [
            ("Host", f"127.0.0.1:{port}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
        ]
        out = conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=headers))
        await stream.send_all((out or b"") + (conn.send(h11.Data(data=body)) or b""))
        await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
        parser = SSEParser()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
                continue
            if isinstance(event, h11.Response):
                result.backend = dict(event.headers).get(b"x-backend-id", b"?").decode()
            elif isinstance(event, h11.Data):
                for data in parser.feed(bytes(event.data)):
                    _on_event(result, data, show)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                result.finished = trio.current_time()
                return


async def stream_h2(port: int, results: list[StreamResult], tokens: int, show: bool) -> None:
    """Several streamed chat completions multiplexed on one HTTP/2 connection (h2c)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        conn = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        conn.initiate_connection()
        by_id: dict[int, tuple[StreamResult, SSEParser]] = {}
        body = _request_body(tokens)
        for result in results:
            sid = conn.get_next_available_stream_id()
            result.started = trio.current_time()
            conn.send_headers(
                sid,
                [
                    (b":method", b"POST"),
                    (b":scheme", b"http"),
                    (b":authority", f"127.0.0.1:{port}".encode()),
                    (b":path", b"/v1/chat/completions"),
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            )
            conn.send_data(sid, body, end_stream=True)
            by_id[sid] = (result, SSEParser())
        await stream.send_all(conn.data_to_send())
        open_streams = set(by_id)
        while open_streams:
            data = await stream.receive_some(65536)
            if not data:
                return
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    result = by_id[event.stream_id][0]
                    result.backend = dict(event.headers).get(b"x-backend-id", b"?").decode()
                elif isinstance(event, h2.events.DataReceived):
                    result, parser = by_id[event.stream_id]
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    for item in parser.feed(event.data):
                        _on_event(result, item, show)
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    by_id[event.stream_id][0].finished = trio.current_time()
                    open_streams.discard(event.stream_id)
            await stream.send_all(conn.data_to_send())


async def run_demo(*, tokens: int, delay: float, h2_streams: int, h1_streams: int) -> int:
    results: list[StreamResult] = []
    async with trio.open_nursery() as nursery:
        ports = []
        for i in range(3):
            fake = FakeLLM(backend_id=f"gpu{i}", tokens=tokens, delay=delay, first_delay=0.05)
            ports.append(await nursery.start(serve_fakellm, fake))
        config = quick_config("127.0.0.1:0", [f"127.0.0.1:{p}" for p in ports])
        server = ProxyServer(config)
        (address,) = await nursery.start(server.run)
        proxy_port = address[1]
        print(
            "muxproxy demo: fake GPU backends gpu0..gpu2 on "
            + ", ".join(f"127.0.0.1:{p}" for p in ports)
        )
        print(f"               proxy on http://127.0.0.1:{proxy_port}\n")
        print(f"{h2_streams} streams on one HTTP/2 connection, {h1_streams} over HTTP/1.1:")
        h2_results = [
            StreamResult(label=f"h2/{i + 1}", protocol="HTTP/2") for i in range(h2_streams)
        ]
        h1_results = [
            StreamResult(label=f"h1/{i + 1}", protocol="HTTP/1.1") for i in range(h1_streams)
        ]
        results = h2_results + h1_results
        with trio.fail_after(30):
            async with trio.open_nursery() as clients:
                clients.start_soon(stream_h2, proxy_port, h2_results, tokens, True)
                for result in h1_results:
                    clients.start_soon(stream_h1, proxy_port, result, tokens, True)
        nursery.cancel_scope.cancel()

    print("\nstream  protocol  backend  tokens  TTFT (ms)  total (ms)")
    ok = True
    for r in results:
        ttft = (r.first_token - r.started) * 1000 if r.first_token is not None else float("nan")
        total = (r.finished - r.started) * 1000 if r.finished is not None else float("nan")
        complete = r.done and len(r.tokens) == tokens
        ok = ok and complete
        mark = "" if complete else "  INCOMPLETE"
        print(
            f"{r.label:<7} {r.protocol:<9} {r.backend:<8} {len(r.tokens):>6}"
            f"  {ttft:9.1f}  {total:10.1f}{mark}"
        )
    print("\nall streams complete" if ok else "\nsome streams did not complete", flush=True)
    return 0 if ok else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=8, help="tokens per reply (default 8)")
    parser.add_argument(
        "--delay", type=float, default=0.03, help="seconds between tokens (default 0.03)"
    )
    parser.add_argument("--h2-streams", type=int, default=3, help="HTTP/2 streams (default 3)")
    parser.add_argument("--h1-streams", type=int, default=2, help="HTTP/1.1 streams (default 2)")


def run(args: argparse.Namespace) -> int:
    return trio.run(
        lambda: run_demo(
            tokens=args.tokens,
            delay=args.delay,
            h2_streams=args.h2_streams,
            h1_streams=args.h1_streams,
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="muxproxy demo")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
