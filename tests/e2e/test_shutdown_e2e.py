"""End to end: a graceful stop cuts no stream in flight.

A real ``ProxyServer`` in front of the fake LLM backend; streams in flight over HTTP/1.1
(httpx) and over HTTP/2 (curl, h2c prior knowledge); then ``ShutdownRequested`` is fed to the
driver. Every stream must end with all its tokens and ``[DONE]``, and the core must end
drained, without cutting anything.

HTTP/2 is played by curl (nghttp2), not httpx: python-h2, under httpx, refuses every frame
after a GOAWAY (python-hyper/h2#1181), and httpcore fails each stream still waiting for data
once it has seen one, whatever its last-stream-id says. No graceful stop of RFC 9113 §6.8,
which is a GOAWAY while streams run, can keep such a client's streams. One curl per stream:
curl 7.88 fails multiplexed uploads (``--parallel`` with ``--data``) against any server.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from test_clients import chat_request, record_accepted, sse_text

from muxproxy.core.commands import Log
from muxproxy.core.events import ShutdownRequested
from muxproxy.testing.fakellm import reply_text

TOKENS = 60
H1_STREAMS = 3
H2_STREAMS = 3


async def test_graceful_stop_lets_every_stream_in_flight_finish(
    start_backend: Any, start_proxy: Any
) -> None:
    fake, backend = await start_backend(tokens=TOKENS, delay=0.03)
    proxy = await start_proxy([backend])
    driver = proxy.server.driver
    core = proxy.server.core
    assert driver is not None
    logs: list[Log] = []
    driver.on_log = logs.append
    accepted = record_accepted(driver)
    request = chat_request(TOKENS)
    h1_results: list[tuple[str, int, bool]] = []
    curls: list[trio.CompletedProcess[bytes]] = []
    url = proxy.url + "/v1/chat/completions"

    async def h1_stream(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", url, json=request) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines()]
        h1_results.append(sse_text(lines))

    async def h2_stream() -> None:
        args = ["curl", "--silent", "--show-error", "--no-buffer", "--max-time", "20"]
        args += ["--http2-prior-knowledge", "--header", "content-type: application/json"]
        args += ["--data-binary", json.dumps(request), url]
        curls.append(
            await trio.run_process(args, capture_stdout=True, capture_stderr=True, check=False)
        )

    with trio.fail_after(30):
        limits = httpx.Limits(max_connections=H1_STREAMS)
        h1 = httpx.AsyncClient(http1=True, http2=False, limits=limits, timeout=20)
        async with h1, trio.open_nursery() as nursery:
            for _ in range(H1_STREAMS):
                nursery.start_soon(h1_stream, h1)
            for _ in range(H2_STREAMS):
                nursery.start_soon(h2_stream)
            await fake.wait_streams_started(H1_STREAMS + H2_STREAMS)
            assert fake.streams_completed == 0  # every stream is in flight
            drained = trio.Event()

            def settled(now: float) -> None:
                if core.drained:
                    drained.set()

            driver.on_settled = settled  # the driver's hook after each batch of commands
            now = trio.current_time()
            driver.feed(ShutdownRequested(now=now, deadline=now + 30))
            # A connection that races the end of accepting is closed before any request.
            async with httpx.AsyncClient(timeout=5) as late:
                with pytest.raises(httpx.RemoteProtocolError):
                    await late.post(url, json=request)
        if not core.drained:
            await drained.wait()

    assert [(c.returncode, c.stderr) for c in curls] == [(0, b"")] * H2_STREAMS
    h2_results = [sse_text(c.stdout.decode().splitlines()) for c in curls]
    assert h1_results == [(reply_text(TOKENS), TOKENS, True)] * H1_STREAMS
    assert h2_results == [(reply_text(TOKENS), TOKENS, True)] * H2_STREAMS
    assert fake.streams_completed == H1_STREAMS + H2_STREAMS and fake.aborts == 0
    events = [log.event for log in logs]
    assert "shutdown_started" in events and "drained" in events
    assert "shutdown_cut" not in events
    (started,) = [log for log in logs if log.event == "shutdown_started"]
    assert started.fields["streams"] == H1_STREAMS + H2_STREAMS
    # One connection per stream: each HTTP/2 one got both GOAWAYs mid-stream.
    assert len(accepted) == H1_STREAMS + H2_STREAMS + 1
    accesses = [log for log in logs if log.event == "access"]
    assert (
        sorted(log.fields["version"] for log in accesses)
        == ["1.1"] * H1_STREAMS + ["2"] * H2_STREAMS
    )
    assert all(log.fields["outcome"] == "ok" for log in accesses)
