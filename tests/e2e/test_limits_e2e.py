"""End to end: the proxy's resource limits over real sockets.

* Memory: a fresh ``muxproxy serve`` process holding 2,000 idle SSE streams (20 HTTP/2
  connections x 100 streams, each relayed to its own HTTP/1.1 backend connection) stays within
  a per-stream RSS budget (docs/performance.md, "Memory per idle stream").
* ``max_request_body``: a Content-Length above it is a 413 over HTTP/1.1 and HTTP/2, and the
  backend sees nothing (not even a connection).
* ``max_header_fields``: too many fields is a 431, nothing forwarded.
* ``max_concurrent_streams``: one stream past the limit should be refused alone (RFC 9113
  §5.1.2); today it costs the whole connection (strict xfail, as in tests/core/test_limits.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import h2.errors
import h2.settings
import pytest
import trio
from h2client import H2Stream
from peers import H1Peer, H2Peer, open_h2, serve_raw
from stepped import RecordingBackend

from muxproxy.config import Limits

REPO = Path(__file__).resolve().parents[2]

# ---- a recording backend --------------------------------------------------------------------


async def recording_proxy(start_proxy, nursery, **limits):
    backend = RecordingBackend(answer=None)
    port = await serve_raw(nursery, backend.handle)
    proxy = await start_proxy([port], limits=Limits(**limits))
    return backend, proxy


# ---- memory per idle stream -----------------------------------------------------------------

CONNECTIONS = 20
STREAMS_PER_CONNECTION = 100
RSS_BUDGET_KIB = 16
"""The target (nginx needs about 14-18 KiB here). Measured 6-7 KiB per idle HTTP/2 stream
(client stream + exchange + its own backend connection, served by the reactor with no task of
its own); the budget leaves room for allocator and interpreter noise, and a regression that
brings back a task per connection (17.5-18.5 KiB) fails it."""


def vm_rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB$", status, re.MULTILINE)
    assert match, status
    return int(match.group(1))


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def read_line_matching(process: trio.Process, pattern: bytes) -> re.Match[bytes]:
    """Read the process's stdout until a line matches ``pattern``."""
    assert process.stdout is not None
    buffer = b""
    while True:
        for line in buffer.split(b"\n")[:-1]:
            if match := re.search(pattern, line):
                return match
        chunk = await process.stdout.receive_some(4096)
        if not chunk:
            raise AssertionError(f"process exited before printing {pattern!r}: {buffer!r}")
        buffer += chunk


async def stop(process: trio.Process) -> None:
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.kill()
        with trio.move_on_after(5):
            await process.wait()


async def open_idle_streams(port: int, count: int, opened: list[int], nursery: trio.Nursery):
    """One h2 connection with ``count`` idle SSE streams; appends to ``opened`` once every
    stream has its response head and first (comment) chunk, then holds them until cancelled."""

    async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with open_h2(port) as peer:
            sids = [queue_get(peer, "/sse?idle=1") for _ in range(count)]
            await peer.flush()  # all HEADERS in one write
            await peer.wait_until(
                lambda: all(
                    peer.streams[s].headers is not None and peer.streams[s].frames for s in sids
                )
            )
            assert all(peer.streams[s].status == 200 for s in sids)
            opened.append(count)
            task_status.started()
            await trio.sleep_forever()

    await nursery.start(run)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
async def test_rss_per_idle_h2_stream_is_within_budget():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    backend_port = free_port()
    processes: list[trio.Process] = []
    try:
        with trio.fail_after(60):
            backend = await trio.lowlevel.open_process(
                [
                    sys.executable,
                    str(REPO / "bench" / "sse_backend.py"),
                    "--port",
                    str(backend_port),
                    "--hb",
                    "3600",
                ],
                stdout=subprocess.PIPE,
                cwd=REPO,
                env=env,
            )
            processes.append(backend)
            await read_line_matching(backend, rb"^ready")
            proxy = await trio.lowlevel.open_process(
                [
                    sys.executable,
                    "-m",
                    "muxproxy",
                    "serve",
                    "--listen",
                    "127.0.0.1:0",
                    "--upstream",
                    f"127.0.0.1:{backend_port}",
                ],
                stdout=subprocess.PIPE,
                cwd=REPO,
                env=env,
            )
            processes.append(proxy)
            match = await read_line_matching(proxy, rb"listening on http://127\.0\.0\.1:(\d+)")
            port = int(match.group(1))

            async with trio.open_nursery() as nursery:
                # Warm-up: lazy imports, first-use caches, a first backend connection.
                warm: list[int] = []
                async with trio.open_nursery() as warm_nursery:
                    await open_idle_streams(port, 5, warm, warm_nursery)
                    warm_nursery.cancel_scope.cancel()
                # Measurement pacing, not synchronisation: let the allocator settle after the
                # warm-up streams closed, so `before` is not read mid-free.
                await trio.sleep(0.3)
                before = vm_rss_kib(proxy.pid)

                opened: list[int] = []
                async with trio.open_nursery() as openers:
                    for _ in range(CONNECTIONS):
                        openers.start_soon(
                            open_idle_streams, port, STREAMS_PER_CONNECTION, opened, nursery
                        )
                assert sum(opened) == CONNECTIONS * STREAMS_PER_CONNECTION
                await trio.sleep(0.3)
                after = vm_rss_kib(proxy.pid)
                nursery.cancel_scope.cancel()

        streams = CONNECTIONS * STREAMS_PER_CONNECTION
        per_stream = (after - before) / streams
        print(f"proxy VmRSS {before} -> {after} KiB: {per_stream:.1f} KiB per idle h2 stream")
        assert per_stream <= RSS_BUDGET_KIB, (before, after, per_stream)
    finally:
        for process in reversed(processes):
            await stop(process)


# ---- max_request_body -----------------------------------------------------------------------


async def test_h1_content_length_over_max_request_body_is_413_and_nothing_forwarded(
    start_proxy, nursery
):
    backend, proxy = await recording_proxy(start_proxy, nursery, max_request_body=1000)
    with trio.fail_after(10):
        peer = await H1Peer.connect(proxy.port)
        await peer.send_request("POST", "/v1/chat/completions", body=b"x" * 1001)
        response = await peer.read_response()
        await peer.aclose()
        # A body at the limit is forwarded (so the backend would have seen the other one).
        peer = await H1Peer.connect(proxy.port)
        await peer.send_request("POST", "/v1/chat/completions", body=b"y" * 1000)
        while b"y" * 1000 not in backend.received:
            await trio.sleep(0.01)
        await peer.aclose()
    assert response.status == 413
    assert backend.connections == 1
    assert b"x" not in backend.received.split(b"\r\n\r\n", 1)[1]
    assert backend.heads == 1


async def test_h2_content_length_over_max_request_body_is_413_and_nothing_forwarded(
    start_proxy, nursery
):
    backend, proxy = await recording_proxy(start_proxy, nursery, max_request_body=1000)
    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer:
            sid = await peer.request(
                "POST",
                "/v1/chat/completions",
                [("content-length", "1001")],
                body=b"x" * 1001,
            )
            stream = await peer.wait_done(sid)
            assert peer.terminated is None
    assert stream.status == 413
    assert backend.connections == 0
    assert backend.received == b""


# ---- max_header_fields ----------------------------------------------------------------------

MANY_FIELDS = [(f"x-field-{i}", "v") for i in range(40)]


async def test_h1_too_many_header_fields_is_431_and_nothing_forwarded(start_proxy, nursery):
    backend, proxy = await recording_proxy(start_proxy, nursery, max_header_fields=20)
    with trio.fail_after(10):
        peer = await H1Peer.connect(proxy.port)
        await peer.send_request("GET", "/v1/models", MANY_FIELDS)
        response = await peer.read_response()
        await peer.aclose()
    assert response.status == 431
    assert backend.connections == 0


async def test_h2_too_many_header_fields_is_431_on_its_stream_only(start_proxy, nursery):
    backend, proxy = await recording_proxy(start_proxy, nursery, max_header_fields=20)
    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer:
            sid = await peer.request("GET", "/v1/models", MANY_FIELDS)
            stream = await peer.wait_done(sid)
            assert peer.terminated is None
    assert stream.status == 431
    assert backend.connections == 0


# ---- max_concurrent_streams -----------------------------------------------------------------


def queue_get(peer: H2Peer, path: str) -> int:
    """Queue a GET's HEADERS (END_STREAM) without writing it; the caller flushes."""
    sid = peer.conn.get_next_available_stream_id()
    peer.streams[sid] = H2Stream(sid=sid)
    block = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"proxy")]
    peer.conn.send_headers(sid, [*block, (b":path", path.encode())], end_stream=True)
    return sid


async def test_stream_past_max_concurrent_streams_is_refused_alone(start_proxy, nursery):
    backend, proxy = await recording_proxy(start_proxy, nursery, max_concurrent_streams=2)
    with trio.fail_after(10):
        # Not waiting for the server's SETTINGS: python-h2 would not let us open the third
        # stream once it knows the limit. All three HEADERS go out in one write.
        async with open_h2(proxy.port, wait_settings=False) as peer:
            sids = [queue_get(peer, "/sse") for _ in range(3)]
            await peer.flush()
            third = peer.streams[sids[2]]
            try:
                await peer.wait_until(lambda: third.done or peer.terminated is not None)
            except ConnectionError:
                pass
            assert peer.terminated is None, peer.terminated
            assert third.reset == h2.errors.ErrorCodes.REFUSED_STREAM
            # The two streams within the limit were forwarded and are still open.
            while backend.heads < 2:
                await trio.sleep(0.01)
            assert not any(peer.streams[s].done for s in sids[:2])
            assert peer.conn.remote_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == 2
    assert backend.heads == 2
