"""``muxproxy serve --workers N`` as a user runs it: a real supervisor and worker processes.

Which worker served a connection is read from the kernel, not guessed: the proxy's end of a
connection is the socket in ``/proc/net/tcp`` whose local port is the proxy's and whose remote
port is the client's, and the worker holding that socket's inode among its fds accepted it.
SO_REUSEPORT spreads connections by a hash of the 4-tuple, so a test keeps opening fresh
connections until every worker has served one (bounded by a count and a deadline).

The signal tests put load on the supervisor first: 30 streams of about a second each from a
slow fake backend, each on a connection of its own, all in flight (the backend has sent every
head) before the signal; a rolling restart also has two clients opening fresh connections
back to back throughout. A :class:`Tally` counts what the clients saw: streams completed or
cut, connections tried and failed; the tests print the figures (``pytest -s``).

Every wait is on a condition with a deadline; the ``/proc`` polls step by a few milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import h11
import httpx
import pytest
import trio
from peers import h1_read_response, h1_request_bytes, open_tcp, sse_events
from processes import ProxyProcess, log_message, proxy_process

from muxproxy.process.cli import main
from muxproxy.testing.fakellm import FakeLLM

if TYPE_CHECKING:
    from conftest import StartBackend

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="--workers needs Linux (SO_REUSEPORT)"
)

START_TIMEOUT = 15
"""Seconds for worker interpreters to start and import (a replacement, a rolling restart)."""
MAX_CONNECTIONS = 200
"""Fresh connections tried before concluding that some worker is never handed one."""
POLL = 0.005
"""Seconds between looks at ``/proc`` while waiting for a process to appear or go."""


# ---- processes, from /proc -------------------------------------------------------------------


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` (``Z`` for a zombie), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z")


def children_of(parent: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == parent and state != "Z":
            found.add(int(entry))
    return found


def accepting_worker(proxy_port: int, client_port: int, workers: set[int]) -> int | None:
    """The worker holding the proxy's end of the connection from ``client_port``, if any."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], fields[9]
        if local.endswith(f":{proxy_port:04X}") and remote.endswith(f":{client_port:04X}"):
            inodes.add(f"socket:[{inode}]")
    for pid in workers:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return pid
            except OSError:
                continue
    return None


async def wait_for(condition: str, predicate: Callable[[], bool], timeout: float = 10) -> None:
    """Poll ``predicate()`` until it holds; fail naming ``condition`` after ``timeout``."""
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(POLL)
        return
    raise AssertionError(f"timed out waiting until {condition}")


def quick(backend_port: int, *, workers: int = 2, port: int = 0) -> list[str]:
    """``serve`` flags: ``workers`` workers on 127.0.0.1:``port`` before one backend."""
    return [
        *("--workers", str(workers), "--listen", f"127.0.0.1:{port}"),
        *("--upstream", f"127.0.0.1:{backend_port}"),
    ]


# ---- a supervisor ----------------------------------------------------------------------------


@attrs.define
class Supervisor:
    proxy: ProxyProcess
    seen_workers: set[int] = attrs.field(factory=set)
    read: int = 1
    """Stdout lines returned so far (its listening line, then by :meth:`read_line`)."""

    @property
    def process(self) -> trio.Process:
        return self.proxy.process

    @property
    def port(self) -> int:
        return self.proxy.ports()[0]

    @property
    def stdout(self) -> list[str]:
        """The lines it printed to stdout so far: its listening line, more once it exited."""
        return self.proxy.stdout.lines

    def workers(self) -> set[int]:
        current = children_of(self.process.pid)
        self.seen_workers |= current
        return current

    def errors(self) -> str:
        return self.proxy.stderr.text()

    def errors_besides_access(self) -> list[str]:
        """stderr without the access log's lines (on stderr by default: ``[log] access``)."""
        return [line for line in self.proxy.stderr.lines if " request_id=" not in line]

    async def request(self) -> int | None:
        """GET /v1/models on a fresh connection (must answer 200); the worker that served it."""
        async with await open_tcp(self.port) as stream:
            conn, data = h1_request_bytes(b"/v1/models")
            await stream.send_all(data)
            response, _ = await h1_read_response(stream, conn)
            assert response.status_code == 200, response
            # Still open (keep-alive): the worker holds the proxy's end.
            return accepting_worker(self.port, stream.socket.getsockname()[1], self.workers())

    async def wait_served_by(self, workers: set[int]) -> int:
        """Fresh connections until each of ``workers`` served one; returns how many it took."""
        served: set[int] = set()
        with trio.fail_after(10):
            for count in range(1, MAX_CONNECTIONS + 1):
                pid = await self.request()
                if pid is not None:
                    served.add(pid)
                if served >= workers:
                    return count
        raise AssertionError(f"{MAX_CONNECTIONS} connections, served by {served} of {workers}")

    async def read_line(self) -> str:
        """The next line the supervisor prints on stdout (past its first listening line)."""
        with trio.fail_after(10):
            line = await self.proxy.stdout.wait_for(lambda _: True, start=self.read)
        self.read += 1
        return line

    async def wait_logged(self, text: str, timeout: float = 15) -> str:
        """The first stderr line holding ``text``, once there is one."""
        with trio.move_on_after(timeout):
            return await self.proxy.stderr.wait_for(lambda line: text in line)
        raise AssertionError(f"no {text!r} on stderr within {timeout}s: {self.errors()}")

    async def wait_exit(self, timeout: float = 10) -> int:
        """Its exit status, once it exited and closed its stdout (every line read)."""
        with trio.fail_after(timeout):
            await self.proxy.stdout.wait_closed()
            return await self.process.wait()


@asynccontextmanager
async def supervisor(*args: str) -> AsyncIterator[Supervisor]:
    """``python -m muxproxy serve ARGS`` with its listening line read; stopped (SIGTERM) at
    the end."""
    running: Supervisor | None = None
    async with trio.open_nursery() as nursery:
        try:
            async with proxy_process(nursery, *args, stop=signal.SIGTERM) as proxy:
                assert proxy.url.startswith("http://127.0.0.1:"), proxy.stdout.lines
                running = Supervisor(proxy)
                running.workers()
                yield running
        finally:
            # Our own workers only, should the supervisor have failed to stop them.
            for pid in running.seen_workers if running is not None else ():
                if is_alive(pid):
                    os.kill(pid, signal.SIGKILL)


# ---- tests -----------------------------------------------------------------------------------


async def test_workers_share_the_port_and_each_serves_connections(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    _, backend_port = await start_backend()
    async with supervisor(*quick(backend_port)) as proxy:
        workers = proxy.workers()
        assert len(workers) == 2
        for _ in range(40):
            await proxy.request()
        await proxy.wait_served_by(workers)
        proxy.process.send_signal(signal.SIGINT)
        assert await proxy.wait_exit() == 0
    assert proxy.stdout == [f"muxproxy listening on http://127.0.0.1:{proxy.port}"]
    first, *rest = proxy.errors_besides_access()
    assert log_message(first) == (  # an error-log line, as a worker's: time and level first
        "muxproxy: stopping: 2 workers drain their streams (up to 30s; a second SIGTERM or"
        " SIGINT cuts them)"
    )
    # Then each worker's own account of its stop, and no warning or error.
    assert sum(" INFO drained " in line for line in rest) == 2
    assert all(" INFO " in line for line in rest), rest


async def test_a_killed_worker_is_replaced(tmp_path: Path, start_backend: StartBackend) -> None:
    _, backend_port = await start_backend()
    async with supervisor(*quick(backend_port)) as proxy:
        victim, survivor = sorted(proxy.workers())
        # Stopped, it accepts nothing: the connections the kernel gives its socket queue there.
        os.kill(victim, signal.SIGSTOP)
        await wait_for("the worker is stopped", lambda: process_state(victim) == "T")
        queued = []
        with trio.fail_after(START_TIMEOUT):
            for _ in range(20):
                stream = await open_tcp(proxy.port)
                conn, data = h1_request_bytes(b"/v1/models")
                await stream.send_all(data)
                queued.append((stream, conn))
            os.kill(victim, signal.SIGKILL)
            # The supervisor keeps the dead worker's socket: its queue waits for the
            # replacement, and every connection in it is answered, none reset.
            for stream, conn in queued:
                async with stream:
                    response, _ = await h1_read_response(stream, conn)
                assert response.status_code == 200
        await wait_for("the worker is replaced", lambda: len(proxy.workers() - {victim}) == 2)
        workers = proxy.workers()
        assert survivor in workers and victim not in workers
        # The replacement listens on the same port: it is handed connections too.
        await proxy.wait_served_by(workers)
        assert f"WARNING muxproxy: worker {victim} was killed by SIGKILL" in proxy.errors()


async def test_sigterm_stops_every_worker_and_exits_zero(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    _, backend_port = await start_backend()
    config = tmp_path / "muxproxy.toml"
    config.write_text(
        '[[listeners]]\naddress = "127.0.0.1:0"\n\n'
        f'[upstreams.gpus]\nservers = ["127.0.0.1:{backend_port}"]\n\n'
        '[[routes]]\nprefix = "/"\nupstream = "gpus"\n'
    )
    async with supervisor("--workers", "3", "--config", str(config)) as proxy:
        workers = proxy.workers()
        assert len(workers) == 3
        await proxy.request()
        proxy.process.send_signal(signal.SIGTERM)
        assert await proxy.wait_exit() == 0
        assert not any(is_alive(pid) for pid in workers)


async def test_workers_do_not_outlive_a_killed_supervisor(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    _, backend_port = await start_backend()
    async with supervisor(*quick(backend_port)) as proxy:
        workers = proxy.workers()
        proxy.process.kill()
        await proxy.process.wait()
        await wait_for("the workers exit", lambda: not any(is_alive(p) for p in workers))


async def test_a_crash_loop_gives_up_with_status_1(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    _, backend_port = await start_backend()
    async with supervisor(*quick(backend_port)) as proxy:
        # Two replacements within the window are allowed for two workers; the third is not.
        for _ in range(2):
            before = proxy.workers()
            os.kill(min(before), signal.SIGKILL)
            await wait_for("a replacement starts", lambda b=before: len(proxy.workers() - b) == 1)
        os.kill(min(proxy.workers()), signal.SIGKILL)
        assert await proxy.wait_exit() == 1
        assert "giving up" in proxy.errors()
        assert not any(is_alive(pid) for pid in proxy.seen_workers)


async def test_a_port_in_use_fails_the_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with trio.fail_after(START_TIMEOUT):
            result = await trio.run_process(
                [sys.executable, "-m", "muxproxy", "serve", *quick(9, port=port)],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    assert result.returncode == 1
    assert result.stdout == b""
    # The supervisor binds the listening sockets itself, before any worker starts.
    errors = result.stderr.decode()
    assert errors == (
        f"muxproxy: cannot serve: [Errno 98] cannot listen on 127.0.0.1:{port}:"
        " Address already in use\n"
    )


@pytest.mark.parametrize("count", ["0", "-1", "two"])
def test_workers_must_be_a_positive_number(count: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--workers", count, "--listen", "127.0.0.1:0", "--upstream", "a:1"]) == 2
    err = capsys.readouterr().err
    assert "--workers" in err and repr(count) in err


# ---- draining, reloading and restarting under load -------------------------------------------

STREAMS = 30
"""Streams in flight when a signal arrives."""
STREAM_TOKENS = 20
TOKEN_DELAY = 0.05
"""Seconds between tokens: a stream lasts about a second, long past each signal."""


def config_text(backend_port: int, *listeners: str) -> str:
    heads = "".join(f'[[listeners]]\naddress = "{address}"\n\n' for address in listeners)
    return (
        f'{heads}[upstreams.gpus]\nservers = ["127.0.0.1:{backend_port}"]\n\n'
        '[[routes]]\nprefix = "/"\nupstream = "gpus"\n'
    )


@attrs.define
class Tally:
    """What the clients saw."""

    completed: int = 0
    cut: list[str] = attrs.field(factory=list)
    """Streams that ended short of ``[DONE]``, and why."""
    tried: int = 0
    failed: list[str] = attrs.field(factory=list)
    """Fresh connections whose request did not get its 200, and why."""


async def one_stream(port: int, tally: Tally) -> None:
    """A streamed completion on a connection of its own; counted complete or cut."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}'
    headers = [(b"host", b"proxy.test"), (b"content-type", b"application/json")]
    try:
        async with await open_tcp(port) as stream:
            conn, data = h1_request_bytes(b"/v1/chat/completions", b"POST", body, headers)
            await stream.send_all(data)
            response, received = await h1_read_response(stream, conn)
    except (OSError, trio.BrokenResourceError, h11.ProtocolError, AssertionError) as exc:
        tally.cut.append(repr(exc))
        return
    events = [e for e in sse_events(received) if e != "[DONE]"]
    if response.status_code == 200 and received.endswith(b"data: [DONE]\n\n"):
        assert len(events) == STREAM_TOKENS + 1  # the tokens and the finish chunk
        tally.completed += 1
    else:
        tally.cut.append(f"{response.status_code}: {received[-200:]!r}")


async def keep_connecting(port: int, tally: Tally, until: trio.Event) -> None:
    """Fresh connections, one request each, back to back until ``until`` is set."""
    while not until.is_set():
        tally.tried += 1
        try:
            async with await open_tcp(port) as stream:
                conn, data = h1_request_bytes(b"/v1/models")
                await stream.send_all(data)
                response, _ = await h1_read_response(stream, conn)
        except (OSError, trio.BrokenResourceError, h11.ProtocolError, AssertionError) as exc:
            tally.failed.append(repr(exc))
            continue
        if response.status_code != 200:
            tally.failed.append(f"status {response.status_code}")


async def streams_in_flight(
    nursery: trio.Nursery, fake: FakeLLM, port: int, tally: Tally, count: int = STREAMS
) -> None:
    """Start ``count`` streams and return once the backend has sent every response head."""
    already = fake.streams_started
    for _ in range(count):
        nursery.start_soon(one_stream, port, tally)
    with trio.fail_after(10):
        await fake.wait_streams_started(already + count)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGQUIT])
async def test_a_stop_signal_lets_every_stream_in_flight_finish(
    tmp_path: Path, start_backend: StartBackend, signum: signal.Signals
) -> None:
    fake, backend_port = await start_backend(tokens=STREAM_TOKENS, delay=TOKEN_DELAY)
    tally = Tally()
    async with supervisor(*quick(backend_port)) as proxy:
        workers = proxy.workers()
        async with trio.open_nursery() as nursery:
            await streams_in_flight(nursery, fake, proxy.port, tally)
            proxy.process.send_signal(signum)
            assert await proxy.wait_exit(timeout=20) == 0
        assert not any(is_alive(pid) for pid in workers)
    print(f"{signum.name}: {STREAMS} streams in flight, {len(tally.cut)} cut")
    assert tally.cut == []
    assert tally.completed == STREAMS
    assert fake.disconnects == 0


async def test_a_second_sigterm_cuts_the_streams(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    fake, backend_port = await start_backend(tokens=1000, delay=TOKEN_DELAY)
    tally = Tally()
    async with supervisor(*quick(backend_port)) as proxy, trio.open_nursery() as n:
        await streams_in_flight(n, fake, proxy.port, tally, count=4)
        proxy.process.send_signal(signal.SIGTERM)
        # Trio may coalesce two signals not yet received: the second waits for the first.
        await proxy.wait_logged("stopping: 2 workers drain")
        proxy.process.send_signal(signal.SIGTERM)
        await proxy.wait_logged("cutting the streams of 2 workers")
        # Streams of 50 s end long before the 30 s grace: cut, not drained.
        assert await proxy.wait_exit(timeout=10) == 0
    assert tally.completed == 0 and len(tally.cut) == 4


async def test_sighup_reloads_the_file_without_cutting_streams(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    fake, backend_port = await start_backend(tokens=STREAM_TOKENS, delay=TOKEN_DELAY)
    config = tmp_path / "muxproxy.toml"
    config.write_text(config_text(backend_port, "127.0.0.1:0"))
    tally = Tally()
    async with supervisor("--workers", "2", "--config", str(config)) as proxy:
        workers = proxy.workers()
        async with trio.open_nursery() as nursery:
            await streams_in_flight(nursery, fake, proxy.port, tally)
            # An invalid file is refused; the running configuration goes on.
            config.write_text(config_text(backend_port, "127.0.0.1:0") + "bogus = 1\n")
            proxy.process.send_signal(signal.SIGHUP)
            await proxy.wait_logged("reload refused")
            assert "bogus" in proxy.errors()
            await proxy.request()
            # A valid one with a new listener is applied by both workers.
            config.write_text(config_text(backend_port, "127.0.0.1:0", "127.0.0.2:0"))
            proxy.process.send_signal(signal.SIGHUP)
            line = await proxy.wait_logged("generation 2")
        assert tally.cut == [] and tally.completed == STREAMS
        assert set(map(int, line.rsplit("workers ", 1)[1].rstrip(")").split(", "))) == workers
        new_line = await proxy.read_line()
        assert new_line.startswith("muxproxy listening on http://127.0.0.2:"), new_line
        new_port = int(new_line.rsplit(":", 1)[1])
        with trio.fail_after(5):
            async with await open_tcp(new_port, host="127.0.0.2") as stream:
                conn, data = h1_request_bytes(b"/v1/models")
                await stream.send_all(data)
                response, _ = await h1_read_response(stream, conn)
        assert response.status_code == 200
        assert proxy.workers() == workers  # a reload restarts nothing
        # Removed again: its sockets are closed, so the kernel refuses connections.
        config.write_text(config_text(backend_port, "127.0.0.1:0"))
        proxy.process.send_signal(signal.SIGHUP)
        await proxy.wait_logged("generation 3")
        with pytest.raises(ConnectionRefusedError), trio.fail_after(5):
            await open_tcp(new_port, host="127.0.0.2")
        await proxy.request()
    print(f"SIGHUP: {STREAMS} streams in flight, {len(tally.cut)} cut")


async def test_sigusr2_restarts_every_worker_without_refusing_a_connection(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    fake, backend_port = await start_backend(tokens=STREAM_TOKENS, delay=TOKEN_DELAY)
    tally = Tally()
    async with supervisor(*quick(backend_port)) as proxy:
        old = proxy.workers()
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(keep_connecting, proxy.port, tally, done)
            await streams_in_flight(nursery, fake, proxy.port, tally)
            proxy.process.send_signal(signal.SIGUSR2)
            await proxy.wait_logged("rolling restart done")
            # The old workers drain their streams and exit while the clients keep coming.
            await wait_for("the old workers exit", lambda: not any(map(is_alive, old)))
            before = tally.tried
            await wait_for("more connections after", lambda: tally.tried >= before + 20)
            done.set()
        new = proxy.workers()
        assert len(new) == 2 and not new & old
        await proxy.wait_served_by(new)
    print(
        f"SIGUSR2: {tally.tried} connections tried, {len(tally.failed)} failed;"
        f" {STREAMS} streams in flight, {len(tally.cut)} cut"
    )
    assert tally.failed == []
    assert tally.cut == [] and tally.completed == STREAMS


async def test_the_admin_api_of_the_supervisor_answers_for_every_worker(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    fake, backend_port = await start_backend(tokens=1000, delay=TOKEN_DELAY)
    config = tmp_path / "muxproxy.toml"
    config.write_text(
        config_text(backend_port, "127.0.0.1:0")
        + '\n[admin]\naddress = "127.0.0.1:0"\ntoken = "t0ken"\nstate_file = "state.json"\n'
    )
    auth = {"authorization": "Bearer t0ken"}
    server_url = f"upstreams/gpus/servers/127.0.0.1:{backend_port}"
    async with supervisor("--workers", "2", "--config", str(config)) as proxy:
        line = await proxy.read_line()
        assert line.startswith("muxproxy admin on http://127.0.0.1:"), line
        admin = line.rsplit(" ", 1)[1]
        workers = proxy.workers()
        async with httpx.AsyncClient(base_url=admin, timeout=5) as client:
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    await streams_in_flight(nursery, fake, proxy.port, Tally(), count=4)
                    status = (await client.get("/status")).json()
                    nursery.cancel_scope.cancel()
            assert {w["pid"] for w in status["workers"]} == workers
            assert [w["generation"] for w in status["workers"]] == [1, 1]
            assert status["streams"] == 4  # summed over the workers
            (entry,) = status["groups"]["gpus"]["servers"]
            assert entry["active"] == 4
            with trio.fail_after(10):
                changed = await client.patch(f"/{server_url}", json={"weight": 5}, headers=auth)
            assert changed.status_code == 200 and changed.json()["weight"] == 5
            saved = json.loads((tmp_path / "state.json").read_text())
            assert [s["weight"] for s in saved["servers"]] == [5]
            with trio.fail_after(START_TIMEOUT):
                restarted = await client.post("/reload?restart=1", headers=auth)
            assert restarted.status_code == 200, restarted.text
            await wait_for("the old workers exit", lambda: not any(map(is_alive, workers)))
            with trio.fail_after(10):
                status = (await client.get("/status")).json()
                metrics = await client.get("/metrics")
            # New workers, which started with the operator's weight.
            assert not {w["pid"] for w in status["workers"]} & workers
            assert status["groups"]["gpus"]["servers"][0]["weight"] == 5
            assert metrics.status_code == 200
            assert "muxproxy_requests_total{" in metrics.text  # the old workers' streams


async def test_sigusr1_has_every_worker_reopen_the_access_log(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    # Unhandled, SIGUSR1 ended the supervisor at once (what logrotate rules written for
    # nginx send); its workers then drained and exited.
    _, backend_port = await start_backend()
    access, rotated = tmp_path / "access.log", tmp_path / "access.log.1"
    config = tmp_path / "muxproxy.toml"
    config.write_text(config_text(backend_port, "127.0.0.1:0") + f'\n[log]\naccess = "{access}"\n')
    async with supervisor("--workers", "2", "--config", str(config)) as proxy:
        workers = proxy.workers()
        await proxy.request()
        access.rename(rotated)
        proxy.process.send_signal(signal.SIGUSR1)
        reopened = f"muxproxy: SIGUSR1: reopened the access log {access}"
        await wait_for(
            "both workers reopened the log",
            lambda: sum(reopened in line for line in proxy.proxy.stderr.lines) == 2,
        )
        for _ in range(4):
            await proxy.request()
        assert proxy.workers() == workers  # nothing restarted
    assert len(rotated.read_text().splitlines()) == 1
    assert len(access.read_text().splitlines()) == 4
