"""The admin ``Control`` of ``serve --workers N`` (:mod:`muxproxy.process.supervision`).

A :class:`~muxproxy.process.workers.Supervisor` runs in the test's Trio loop with real worker
processes (``python -c``, on sockets it binds), so what is asserted is what the workers
answered over their control channels. Every wait is bounded.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import attrs
import pytest
import trio

from muxproxy.config import Config, Listener, quick_config
from muxproxy.process.handover import bind_listeners, close_listeners
from muxproxy.process.supervision import SupervisorControl, merge_statuses
from muxproxy.process.workerproc import Worker
from muxproxy.process.workers import Phase, Supervisor
from muxproxy.trio.control import AdminError

if TYPE_CHECKING:
    from conftest import StartBackend

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="--workers needs Linux")

START_TIMEOUT = 20


@asynccontextmanager
async def supervising(config: Config, count: int = 2) -> AsyncIterator[Supervisor]:
    """A started supervisor of ``count`` workers; its workers are cut at the end."""
    supervisor = Supervisor(config, count, None, bind_listeners(config.listeners, count))
    try:
        async with trio.open_nursery() as nursery:
            supervisor.nursery = nursery
            with trio.fail_after(START_TIMEOUT):
                await supervisor.start()
            assert supervisor.phase is Phase.SERVING
            yield supervisor
            await supervisor.stop(cut=True)
            with trio.fail_after(10):
                await supervisor.done.wait()
            nursery.cancel_scope.cancel()
    finally:
        close_listeners(supervisor.sockets)


async def exited(workers: list[Worker]) -> None:
    """Until each of ``workers`` has exited (replaced, it drains first) and left
    ``Supervisor.workers``."""
    for worker in workers:
        await worker.exited.wait()


async def open_stream(port: int) -> trio.SocketStream:
    """A streamed completion on a fresh connection, left open once its head arrived."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}'
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy.test\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await stream.receive_some(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return stream


async def test_status_lists_every_worker_and_sums_their_streams(
    start_backend: StartBackend,
) -> None:
    _, backend_port = await start_backend(tokens=1000, delay=0.05)
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{backend_port}"])
    async with supervising(config) as supervisor:
        control = SupervisorControl(supervisor)
        port = supervisor.bound_addresses()[0][1]
        with trio.fail_after(10):
            streams = [await open_stream(port) for _ in range(6)]
            status = await control.status()
        assert status["streams"] == 6
        assert status["generation"] == 1
        assert status["listeners"]["bound"] == [f"127.0.0.1:{port}"]
        workers = status["workers"]
        assert {w["pid"] for w in workers} == {w.pid for w in supervisor.workers}
        assert sorted(w["slot"] for w in workers) == [0, 1]
        assert all(w["generation"] == 1 and w["state"] == "serving" for w in workers)
        assert all(w["answered"] for w in workers)
        for stream in streams:
            await stream.aclose()


async def test_an_unknown_server_or_a_bad_change_changes_nothing(
    start_backend: StartBackend,
) -> None:
    _, backend_port = await start_backend()
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{backend_port}"])
    async with supervising(config) as supervisor:
        control = SupervisorControl(supervisor)
        with pytest.raises(AdminError) as unknown:
            await control.change_server("default", "127.0.0.1:1", {"weight": 3})
        assert unknown.value.status == 404 and "127.0.0.1:1" in unknown.value.message
        with pytest.raises(AdminError) as group:
            await control.change_server("nope", f"127.0.0.1:{backend_port}", {"weight": 3})
        assert group.value.status == 404 and "nope" in group.value.message
        with pytest.raises(AdminError) as field:
            await control.change_server("default", f"127.0.0.1:{backend_port}", {"colour": 1})
        assert field.value.status == 400 and "colour" in field.value.message
        assert not supervisor.runtime.servers
        with pytest.raises(AdminError) as reload:
            await control.reload()
        assert reload.value.status == 400 and "--config" in reload.value.message


async def test_a_rolling_restart_replaces_every_worker_and_keeps_the_runtime_state(
    start_backend: StartBackend,
) -> None:
    _, backend_port = await start_backend()
    address = f"127.0.0.1:{backend_port}"
    config = quick_config("127.0.0.1:0", [address])
    async with supervising(config) as supervisor:
        control = SupervisorControl(supervisor)
        old = list(supervisor.workers)
        before = {w.pid for w in old}
        with trio.fail_after(10):
            await control.change_server("default", address, {"weight": 7})
        with trio.fail_after(START_TIMEOUT):
            result = await control.reload(restart=True)
            assert result.ok, result
            await exited(old)
        after = {w.pid for w in supervisor.workers}
        assert len(after) == 2 and not after & before
        assert [w.pid for w in supervisor.slots if w is not None] != []
        # The new workers got the operator's change in their payload.
        with trio.fail_after(10):
            answers = await supervisor.ask_all({"type": "status?"})
        for _, answer in answers:
            assert answer is not None
            (server,) = answer["status"]["groups"]["default"]["servers"]
            assert server["weight"] == 7


async def test_a_new_worker_that_cannot_start_aborts_the_rolling_restart(
    start_backend: StartBackend, tmp_path: os.PathLike[str]
) -> None:
    _, backend_port = await start_backend()
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{backend_port}"])
    async with supervising(config) as supervisor:
        before = {w.pid for w in supervisor.workers}
        # The next worker cannot load this listener's certificate: it exits before listening.
        missing = os.path.join(tmp_path, "missing.pem")
        supervisor.config = attrs.evolve(
            config,
            listeners=(Listener(address="127.0.0.1:0", tls_cert=missing, tls_key=missing),),
        )
        with trio.fail_after(START_TIMEOUT):
            result = await supervisor.restart()
        assert not result.ok
        assert "rolling restart aborted" in result.errors[0]
        assert "exited with status 1" in result.errors[0]
        assert {w.pid for w in supervisor.workers} == before
        assert {w.pid for w in supervisor.slots if w is not None} == before


def test_merged_status_sums_counts_and_reports_the_worst_health() -> None:
    def server(active: int, state: str, health: str) -> dict[str, object]:
        return {
            "address": "a:1",
            "id": "x",
            "weight": 1,
            "configured_weight": 1,
            "state": state,
            "health": health,
            "active": active,
            "failures": 1,
            "work": 10 * active,
        }

    one = {
        "groups": {
            "g": {
                "balance": "least_conn",
                "servers": [server(2, "up", "healthy")],
                "queue": {"waiting": 3, "max": 10},
                "refused": {"queue_full": 2},
                "reservations": 1,
            }
        },
        "clients": 3,
        "upstream_connections": 1,
        "streams": 2,
    }
    two = {
        "groups": {
            "g": {
                "balance": "least_conn",
                "servers": [server(5, "down", "unhealthy")],
                "queue": {"waiting": 4, "max": 10},
                "refused": {"queue_full": 1, "rate_limited": 5},
                "reservations": 2,
            }
        },
        "clients": 4,
        "upstream_connections": 2,
        "streams": 5,
    }
    merged = merge_statuses([one, two])
    assert merged["clients"] == 7 and merged["upstream_connections"] == 3
    assert merged["streams"] == 7
    (entry,) = merged["groups"]["g"]["servers"]
    assert entry["active"] == 7 and entry["failures"] == 2 and entry["work"] == 70
    assert merged["groups"]["g"]["queue"] == {"waiting": 7, "max": 10}
    assert merged["groups"]["g"]["refused"] == {"queue_full": 3, "rate_limited": 5}
    assert merged["groups"]["g"]["reservations"] == 3
    assert entry["state"] == "down" and entry["health"] == "unhealthy"
    assert merged["groups"]["g"]["balance"] == "least_conn"
    assert merge_statuses([]) == {"groups": {}}


def test_merged_sessions_count_the_hosts_memory_once() -> None:
    """Each worker holds the host's memory (the supervisor relays it): ``remembered`` is the
    most any holds, not the sum, which counted each key once per worker."""

    def worker(remembered: int, sent_out: int, learned: int) -> dict[str, object]:
        sessions = {"shared": True, "remembered": remembered, "sent_out": sent_out}
        group = {"servers": [], "remembered_sessions": remembered}
        return {
            "groups": {"g": group},
            "sessions": {**sessions, "learned": learned, "ignored": 0},
        }

    merged = merge_statuses([worker(20, 10, 10), worker(21, 11, 10)])
    assert merged["groups"]["g"]["remembered_sessions"] == 21
    assert merged["sessions"] == {
        "shared": True,
        "remembered": 21,
        "sent_out": 21,
        "learned": 20,
        "ignored": 0,
    }


async def get_models(port: int) -> None:
    """GET /v1/models on a fresh connection, read to the end (``Connection: close``)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            b"GET /v1/models HTTP/1.1\r\nhost: proxy.test\r\nconnection: close\r\n\r\n"
        )
        response = b""
        while chunk := await stream.receive_some(65536):
            response += chunk
    assert response.startswith(b"HTTP/1.1 200"), response[:200]


def requests_total(exposition: bytes) -> float:
    """The sum of every ``muxproxy_requests_total`` sample of a Prometheus text exposition."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in exposition.decode().splitlines()
        if line.startswith("muxproxy_requests_total{")
    )


async def test_metrics_count_every_request_across_a_rolling_restart(
    start_backend: StartBackend,
) -> None:
    _, backend_port = await start_backend()
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{backend_port}"])
    async with supervising(config) as supervisor:
        control = SupervisorControl(supervisor)
        port = supervisor.bound_addresses()[0][1]
        with trio.fail_after(10):
            for _ in range(10):
                await get_models(port)
            assert requests_total(await control.metrics()) == 10
        old = list(supervisor.workers)
        with trio.fail_after(START_TIMEOUT):
            assert (await control.reload(restart=True)).ok
            await exited(old)
        with trio.fail_after(10):
            # The old workers' counts live on in the supervisor; the new ones add to them.
            assert requests_total(await control.metrics()) == 10
            await get_models(port)
            assert requests_total(await control.metrics()) == 11
