"""``ProxyServer``'s lifecycle API in process (``muxproxy/trio/server.py``): ``run`` returns
once stopped, ``request_shutdown`` (graceful, then a cut), ``reload`` (listeners bound all or
none, TLS contexts renewed, ``generation``) and sockets adopted with ``listen_sockets``."""

from __future__ import annotations

import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import httpx
import pytest
import trio
import trio.testing
import trustme

from muxproxy.config import Config, Listener, Timeouts, quick_config
from muxproxy.trio.listeners import ConnectionSlots
from muxproxy.trio.server import Phase, ProxyServer

if TYPE_CHECKING:
    from conftest import StartBackend

CHAT = {"model": "fake-llm", "stream": True, "messages": []}


def config_for(backend: int, *listeners: Listener, grace: float = 30.0) -> Config:
    config = quick_config("127.0.0.1:0", [f"127.0.0.1:{backend}"])
    return attrs.evolve(
        config,
        listeners=listeners or config.listeners,
        timeouts=attrs.evolve(config.timeouts, shutdown_grace=grace),
    )


@asynccontextmanager
async def running(server: ProxyServer) -> AsyncIterator[trio.Event]:
    """``server.run`` in a nursery; the event is set once ``run`` returned."""
    returned = trio.Event()

    async def run(task_status: trio.TaskStatus[object]) -> None:
        await server.run(task_status=task_status)
        returned.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(run)
        yield returned
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def first_token(
    client: httpx.AsyncClient, server: ProxyServer
) -> AsyncIterator[AsyncIterator[str]]:
    """A streamed chat completion through ``server``'s listener, read up to its first token;
    yields the rest of its lines."""
    ((host, port),) = server.addresses
    url = f"http://{host}:{port}/v1/chat/completions"
    async with client.stream("POST", url, json=CHAT) as response:
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                break
        else:
            raise AssertionError("the stream ended before its first token")
        yield lines


async def read_cut(lines: AsyncIterator[str]) -> None:
    """The rest of a stream, which the proxy cuts (no terminating chunk)."""
    with pytest.raises(httpx.RemoteProtocolError):
        async for _ in lines:
            pass


def refuses(address: tuple[str, int]) -> bool:
    with socket.socket() as sock:
        try:
            sock.connect(address)
        except ConnectionRefusedError:
            return True
    return False


def chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (or during)."""
    seen = []
    while exc is not None:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


async def backend_of(url: str, **options: object) -> str | None:
    async with httpx.AsyncClient(timeout=10, **options) as client:  # type: ignore[arg-type]
        response = await client.get(f"{url}/v1/models")
        assert response.status_code == 200
        return response.headers.get("x-backend-id")


async def test_run_returns_once_a_stop_finds_nothing_running(start_backend: StartBackend) -> None:
    _, backend = await start_backend(backend_id="one")
    server = ProxyServer(config_for(backend))
    with trio.fail_after(10):
        async with running(server) as returned:
            ((host, port),) = server.addresses
            assert await backend_of(f"http://{host}:{port}") == "one"
            assert server.phase is Phase.SERVING
            server.request_shutdown()
            assert server.phase is Phase.DRAINING
            assert refuses((host, port))  # closed in request_shutdown itself
            await returned.wait()
    assert server.phase is Phase.STOPPED
    assert server.stop_summary is not None
    assert (server.stop_summary.in_flight, server.stop_summary.cut) == (0, 0)
    assert server.stop_summary.seconds < 5


async def test_a_second_request_cuts_the_running_streams_at_once(
    start_backend: StartBackend,
) -> None:
    fake, backend = await start_backend(backend_id="one", tokens=1000, delay=0.05)
    server = ProxyServer(config_for(backend, grace=60.0))
    with trio.fail_after(15):
        async with running(server) as returned, httpx.AsyncClient(timeout=10) as client:
            async with first_token(client, server) as lines:
                server.request_shutdown()
                assert server.streams_in_flight() == 1
                server.request_shutdown()
                assert server.phase is Phase.CUTTING
                await read_cut(lines)
            await returned.wait()
    summary = server.stop_summary
    assert summary is not None
    assert (summary.in_flight, summary.cut, summary.forced) == (1, 1, True)
    assert fake.streams_completed == 0


async def test_adopted_sockets_stay_open_after_the_stop(start_backend: StartBackend) -> None:
    """A supervisor hands the same socket to the next process: only this one's own closes."""
    _, backend = await start_backend(backend_id="one")
    adopted = socket.create_server(("127.0.0.1", 0))
    with adopted:
        config = config_for(
            backend, Listener(address="127.0.0.1:0"), Listener(address="127.0.0.2:0")
        )
        server = ProxyServer(config, listen_sockets={"127.0.0.1:0": [adopted]})
        with trio.fail_after(10):
            async with running(server) as returned:
                first, second = server.addresses
                assert first == adopted.getsockname()
                assert await backend_of(f"http://{first[0]}:{first[1]}") == "one"
                server.request_shutdown()
                await returned.wait()
        assert refuses(second)
        assert adopted.fileno() != -1
        # Still listening: the kernel completes a connect into its backlog.
        with socket.create_connection(first, timeout=5):
            pass


async def test_reload_adds_and_removes_listeners_and_changes_groups(
    start_backend: StartBackend,
) -> None:
    _, one = await start_backend(backend_id="one")
    _, two = await start_backend(backend_id="two")
    kept, removed, added = (Listener(address=f"127.0.0.{n}:0") for n in (1, 2, 3))
    server = ProxyServer(config_for(one, kept, removed))
    with trio.fail_after(10):
        async with running(server):
            (kept_host, kept_port), gone = server.addresses
            assert server.generation == 1
            new = server.reload(config_for(two, kept, added))
            assert server.generation == 2
            ((listener, (host, port)),) = new
            assert listener == added and host == "127.0.0.3"
            assert server.addresses == [(kept_host, kept_port), (host, port)]
            assert refuses(gone)
            assert await backend_of(f"http://{kept_host}:{kept_port}") == "two"
            assert await backend_of(f"http://{host}:{port}") == "two"
            # Several listeners on the same "127.0.0.1:0" are told apart by their order.
            twice = config_for(two, kept, kept)
            ((_, third),) = server.reload(twice)
            assert server.addresses[0] == (kept_host, kept_port)
            assert server.addresses[1] == third and third != (kept_host, kept_port)
            assert refuses((host, port))
            assert server.generation == 3
            server.request_shutdown()


async def test_reload_that_cannot_bind_changes_nothing(start_backend: StartBackend) -> None:
    _, one = await start_backend(backend_id="one")
    _, two = await start_backend(backend_id="two")
    server = ProxyServer(config_for(one))
    busy = socket.create_server(("127.0.0.1", 0))
    with busy, trio.fail_after(10):
        taken = busy.getsockname()[1]
        async with running(server):
            before = list(server.addresses)
            wanted = config_for(
                two,
                Listener(address="127.0.0.1:0"),
                Listener(address="127.0.0.3:0"),
                Listener(address=f"127.0.0.1:{taken}"),
            )
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{taken}: "):
                server.reload(wanted)
            assert server.generation == 1
            assert server.addresses == before
            assert server.config.upstreams == config_for(one).upstreams
            ((host, port),) = before
            assert await backend_of(f"http://{host}:{port}") == "one"
            server.request_shutdown()
            with pytest.raises(RuntimeError, match="draining"):
                server.reload(config_for(two))


@attrs.frozen
class Pair:
    ca: trustme.CA
    listener: Listener

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        return context


def tls_pair(directory: Path, name: str) -> Pair:
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(key))
    return Pair(
        ca=ca, listener=Listener(address="127.0.0.1:0", tls_cert=str(cert), tls_key=str(key))
    )


async def test_reload_gives_new_tls_connections_the_new_certificate(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    _, backend = await start_backend(backend_id="one")
    old, new = tls_pair(tmp_path, "old"), tls_pair(tmp_path, "new")
    server = ProxyServer(config_for(backend, old.listener))
    with trio.fail_after(10):
        async with running(server):
            ((host, port),) = server.addresses
            url = f"https://{host}:{port}"
            assert await backend_of(url, verify=old.context()) == "one"
            server.reload(config_for(backend, new.listener))
            assert server.addresses == [(host, port)]  # the same socket
            assert await backend_of(url, verify=new.context()) == "one"
            with pytest.raises(httpx.ConnectError) as info:
                await backend_of(url, verify=old.context())
            assert any(isinstance(e, ssl.SSLCertVerificationError) for e in chain(info.value))
            server.request_shutdown()


async def test_reload_with_a_missing_certificate_changes_nothing(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    _, backend = await start_backend(backend_id="one")
    old = tls_pair(tmp_path, "old")
    server = ProxyServer(config_for(backend, old.listener))
    with trio.fail_after(10):
        async with running(server):
            gone = attrs.evolve(old.listener, tls_cert=str(tmp_path / "missing.pem"))
            with pytest.raises(OSError, match=r"missing\.pem"):
                server.reload(config_for(backend, gone))
            assert server.generation == 1
            ((host, port),) = server.addresses
            assert await backend_of(f"https://{host}:{port}", verify=old.context()) == "one"
            server.request_shutdown()


async def test_grace_comes_from_the_config(start_backend: StartBackend) -> None:
    """A stream longer than ``shutdown_grace`` is cut at its end, not before."""
    fake, backend = await start_backend(backend_id="one", tokens=1000, delay=0.05)
    server = ProxyServer(config_for(backend, grace=0.5))
    assert server.config.timeouts == attrs.evolve(Timeouts(), shutdown_grace=0.5)
    with trio.fail_after(10):
        async with running(server) as returned, httpx.AsyncClient(timeout=10) as client:
            async with first_token(client, server) as lines:
                stopped = trio.current_time()
                server.request_shutdown()
                await read_cut(lines)
                assert trio.current_time() - stopped >= 0.5
            await returned.wait()
    summary = server.stop_summary
    assert summary is not None
    assert (summary.in_flight, summary.cut, summary.forced) == (1, 1, False)
    assert fake.streams_completed == 0


async def test_reload_adopts_handed_over_sockets_and_closes_removed_ones(
    start_backend: StartBackend,
) -> None:
    """A supervisor binds a new listener itself and hands it over with the reload; a listener
    the reload removes is closed even when adopted, so no connection queues unanswered."""
    _, backend = await start_backend(backend_id="one")
    kept, new = Listener(address="127.0.0.1:0"), Listener(address="127.0.0.3:0")
    handed = socket.create_server(("127.0.0.3", 0))
    server = ProxyServer(config_for(backend, kept))
    with handed, trio.fail_after(10):
        async with running(server):
            ((_, address),) = server.reload(
                config_for(backend, kept, new), listen_sockets={"127.0.0.3:0": [handed]}
            )
            assert address == handed.getsockname()
            assert await backend_of(f"http://{address[0]}:{address[1]}") == "one"
            server.reload(config_for(backend, kept))
            assert handed.fileno() == -1
            assert refuses(address)
            server.request_shutdown()


async def test_connection_slots_resize_and_wait_idle() -> None:
    slots = ConnectionSlots(1)
    slots.acquire_nowait()
    with pytest.raises(trio.WouldBlock):
        slots.acquire_nowait()
    taken = trio.Event()
    idle = trio.Event()

    async def take() -> None:
        await slots.acquire()
        taken.set()

    async def wait_idle() -> None:
        await slots.wait_idle()
        idle.set()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(take)
            nursery.start_soon(wait_idle)
            await trio.testing.wait_all_tasks_blocked()
            assert not taken.is_set()
            slots.resize(2)  # a reload raised max_client_connections
            await taken.wait()
            assert slots.used == 2
            slots.release()
            await trio.testing.wait_all_tasks_blocked()
            assert not idle.is_set()
            slots.release()
            await idle.wait()
    assert slots.used == 0
