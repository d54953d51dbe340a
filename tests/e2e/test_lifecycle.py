"""The single-process lifecycle on real processes: ``python -m muxproxy serve --config FILE``
stopped by SIGTERM, SIGINT and SIGQUIT and reloaded by SIGHUP while token streams are in
flight over HTTP/1.1 and HTTP/2 (httpx, prior knowledge), against slow fake LLM backends.

A stop must let every running stream finish with all its tokens (none cut), refuse new
connections from the moment it begins, and exit 0 as soon as the streams are done; past
``timeouts.shutdown_grace`` (or on a second SIGTERM/SIGINT) the rest is cut, visibly to the
client, and the exit is still 0. A reload applies a valid file (listeners added and removed,
a group changed) without touching the running streams, and refuses an invalid one, keeping
the running configuration and saying why on stderr.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import httpx
import pytest
import trio
from processes import Output, proxy_process

if TYPE_CHECKING:
    from conftest import StartBackend

STREAMS_PER_PROTOCOL = 12
"""Streams over HTTP/1.1 (one connection each) and as many over one HTTP/2 connection."""


def config_text(
    backends: list[int],
    *,
    listeners: tuple[str, ...] = ("127.0.0.1:0",),
    grace: float = 30.0,
    extra: str = "",
) -> str:
    lines = [f'[[listeners]]\naddress = "{address}"\n' for address in listeners]
    servers = ", ".join(f'"127.0.0.1:{port}"' for port in backends)
    lines.append(f"[timeouts]\nshutdown_grace = {grace}\n{extra}")
    lines.append(f'[upstreams.llm]\nservers = [{servers}]\n[[routes]]\nprefix = "/"\n')
    lines.append('upstream = "llm"\n')
    return "\n".join(lines)


# ---- token streams ---------------------------------------------------------------------------


@attrs.define
class Stream:
    """One streamed chat completion, as the client saw it."""

    http2: bool
    tokens: int = 0
    done: bool = False
    """The finish chunk arrived and the body ended cleanly."""
    error: str | None = None
    """Why the body did not end cleanly (the stream was cut)."""
    backend: str | None = None
    ended: bool = False


@attrs.define
class Streams:
    """``STREAMS_PER_PROTOCOL`` streamed completions over HTTP/1.1 (httpx, a connection each)
    and as many over HTTP/2 (curl with prior knowledge; python-h2 based clients such as httpx's
    fail every open stream on a graceful GOAWAY, where RFC 9113 §6.8 lets them finish).

    ``multiplex``: every HTTP/2 stream on one connection (one curl, ``--parallel``), its
    bodies on one pipe, told apart by the completion ``id`` each SSE line carries. curl 7.88
    reports success for a multiplexed transfer that was reset, so the tests of cuts run one
    curl per stream (``multiplex=False``), whose exit status says it.
    """

    tokens: int
    delay: float
    multiplex: bool = True
    streams: list[Stream] = attrs.Factory(list)
    by_id: dict[str, Stream] = attrs.Factory(dict)
    curl_statuses: list[int] = attrs.Factory(list)
    """The exit status of each curl process that exited."""
    curl_errors: list[str] = attrs.Factory(list)
    _changed: trio.Event = attrs.Factory(trio.Event)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    def _h1(self) -> list[Stream]:
        return [s for s in self.streams if not s.http2]

    def all(self) -> list[Stream]:
        return self._h1() + list(self.by_id.values())

    def _curls(self) -> int:
        return 1 if self.multiplex else STREAMS_PER_PROTOCOL

    def curls_done(self) -> bool:
        return len(self.curl_statuses) == self._curls()

    async def wait_first_tokens(self) -> None:
        """Until every stream got its first token (or ended)."""

        def started() -> bool:
            h1 = all(s.tokens or s.ended for s in self._h1())
            return h1 and (len(self.by_id) == STREAMS_PER_PROTOCOL or bool(self.curl_statuses))

        await self._wait(started)
        assert len(self.by_id) == STREAMS_PER_PROTOCOL, self.summary()
        assert all(s.tokens for s in self.all()), self.summary()

    async def wait_ended(self) -> None:
        await self._wait(lambda: all(s.ended for s in self._h1()) and self.curls_done())

    def count(self) -> int:
        return 2 * STREAMS_PER_PROTOCOL

    def cut(self) -> int:
        """Streams that did not end cleanly with every token (the ones never started too)."""
        return self.count() - self.complete()

    def complete(self) -> int:
        return sum(1 for s in self.all() if s.done and s.tokens == self.tokens)

    def summary(self) -> str:
        return f"{self.all()!r}, curl exits {self.curl_statuses}: {self.curl_errors}"

    def backends(self) -> set[str | None]:
        return {s.backend for s in self.all()}

    def start(self, nursery: trio.Nursery, client: httpx.AsyncClient, url: str) -> None:
        for _ in range(STREAMS_PER_PROTOCOL):
            stream = Stream(http2=False)
            self.streams.append(stream)
            nursery.start_soon(self._run_h1, client, url, stream)
        for _ in range(self._curls()):
            transfers = STREAMS_PER_PROTOCOL if self.multiplex else 1
            nursery.start_soon(self._run_curl, url, transfers)

    def _headers(self) -> dict[str, str]:
        return {
            "content-type": "application/json",
            "x-fake-tokens": str(self.tokens),
            "x-fake-delay": str(self.delay),
        }

    def _line(self, stream: Stream, line: str) -> None:
        """One SSE line of ``stream``'s body."""
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        stream.backend = chunk["system_fingerprint"]  # the backend id (fakellm)
        choice = chunk["choices"][0]
        if choice["delta"].get("content"):
            stream.tokens += 1
            if stream.tokens == 1:
                self._notify()
        if choice["finish_reason"] == "stop":
            stream.done = True

    async def _run_h1(self, client: httpx.AsyncClient, url: str, stream: Stream) -> None:
        body = {"model": "fake-llm", "stream": True, "messages": []}
        try:
            async with client.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=self._headers()
            ) as response:
                assert response.status_code == 200, response
                async for line in response.aiter_lines():
                    self._line(stream, line)
        except httpx.TransportError as exc:
            stream.error = repr(exc)
            stream.done = False
        finally:
            stream.ended = True
            self._notify()

    async def _run_curl(self, url: str, transfers: int) -> None:
        body = json.dumps({"model": "fake-llm", "stream": True, "messages": []})
        transfer = [f"{name}: {value}" for name, value in self._headers().items()]
        transfer = [arg for header in transfer for arg in ("--header", header)]
        transfer += ["--data-binary", body, f"{url}/v1/chat/completions"]
        args = list(transfer)
        for _ in range(transfers - 1):
            args += ["--next", *transfer]
        command = ["curl", "--silent", "--show-error", "--no-buffer", "--http2-prior-knowledge"]
        if transfers > 1:
            command += ["--no-progress-meter", "--parallel", "--parallel-max", str(transfers)]
        process = await trio.lowlevel.open_process(
            [*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert process.stdout is not None and process.stderr is not None
        errors = Output()
        mine: list[Stream] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(errors.pump, process.stderr)
                pending = b""
                while chunk := await process.stdout.receive_some(65536):
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for raw in lines:
                        self._curl_line(raw.decode(), mine)
            await process.wait()
        finally:
            with trio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                await process.wait()
            self.curl_statuses.append(process.returncode)
            self.curl_errors += errors.lines
            for stream in mine:
                stream.ended = True
                if process.returncode:
                    stream.done = False
                    stream.error = f"curl exit {process.returncode}"
            self._notify()

    def _curl_line(self, line: str, mine: list[Stream]) -> None:
        if not line.startswith("data: {"):
            return
        ident = json.loads(line[6:])["id"]
        stream = self.by_id.get(ident)
        if stream is None:
            stream = self.by_id[ident] = Stream(http2=True)
            mine.append(stream)
        self._line(stream, line)


@asynccontextmanager
async def clients() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=30, limits=limits) as h1:
        yield h1


def refuses(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a TCP connect to ``port`` is refused (nothing listens there)."""
    with socket.socket() as sock:
        try:
            sock.connect((host, port))
        except ConnectionRefusedError:
            return True
    return False


async def backend_of(url: str) -> str | None:
    """The backend that answers a request on a fresh connection to ``url``."""
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(f"{url}/v1/models")
        assert response.status_code == 200, response
        return response.headers.get("x-backend-id")


CUTS: dict[str, int] = {}
"""Streams each scenario cut, printed at the end of the module (``-s``) for the record."""


@pytest.fixture(scope="module", autouse=True)
def report_cuts() -> object:
    yield None
    for scenario, cut in CUTS.items():
        print(f"\nstreams cut: {scenario}: {cut}")


# ---- graceful stop ---------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT])
async def test_stop_signal_lets_every_stream_finish(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend, signum: signal.Signals
) -> None:
    fake, backend = await start_backend(backend_id="one")
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text([backend], grace=30.0))
    streams = Streams(tokens=30, delay=0.05)
    with trio.fail_after(60):
        async with proxy_process(nursery, config=path) as proxy, clients() as h1:
            (port,) = proxy.ports()
            url = f"http://127.0.0.1:{port}"
            async with trio.open_nursery() as running:
                streams.start(running, h1, url)
                await streams.wait_first_tokens()
                signalled = trio.current_time()
                proxy.send(signum)
                line = await proxy.wait_log("muxproxy: stopping: ")
                # Once the stop began, the listening socket is closed: refused by the kernel.
                assert refuses(port), "a new connection was accepted after the stop began"
                status = await proxy.wait_exit()
                exited = trio.current_time() - signalled
            CUTS[f"graceful {signum.name}"] = streams.cut()
            assert streams.complete() == streams.count(), streams.summary()
            assert streams.curl_statuses == [0], streams.summary()
            assert status == 0, proxy.stderr.text()
            assert exited < 30.0  # well before shutdown_grace: the exit follows the streams
            in_flight = int(line.split("stopping: ")[1].split()[0])
            assert in_flight == 2 * STREAMS_PER_PROTOCOL, line
            assert line.endswith(f"grace 30s ({signum.name})"), line
            stopped = await proxy.wait_log("muxproxy: stopped after ")
            assert stopped.endswith(f"all {in_flight} streams finished, none cut"), stopped
    assert fake.streams_completed == 2 * STREAMS_PER_PROTOCOL


async def test_stop_with_nothing_running_exits_at_once(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    """An idle proxy (an idle keep-alive client, health checks running) exits at once."""
    _, backend = await start_backend(backend_id="one")
    path = tmp_path / "muxproxy.toml"
    checks = '[upstreams.llm.health_check]\npath = "/health"\ninterval = 0.2\ntimeout = 0.1\n'
    path.write_text(config_text([backend], grace=30.0) + checks)
    with trio.fail_after(60):
        async with proxy_process(nursery, config=path) as proxy:
            (port,) = proxy.ports()
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.get(f"http://127.0.0.1:{port}/v1/models")
                assert response.status_code == 200
                signalled = trio.current_time()
                proxy.send(signal.SIGTERM)
                assert await proxy.wait_exit() == 0, proxy.stderr.text()
                assert trio.current_time() - signalled < 5.0
    stopped = await proxy.wait_log("muxproxy: stopped after ")
    assert stopped.endswith("all 0 streams finished, none cut"), stopped


# ---- cuts ------------------------------------------------------------------------------------


async def test_streams_longer_than_the_grace_are_cut_at_its_end(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    fake, backend = await start_backend(backend_id="one")
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text([backend], grace=1.0))
    streams = Streams(tokens=1000, delay=0.05, multiplex=False)  # 50 s each
    with trio.fail_after(60):
        async with proxy_process(nursery, config=path) as proxy, clients() as h1:
            (port,) = proxy.ports()
            url = f"http://127.0.0.1:{port}"
            async with trio.open_nursery() as running:
                streams.start(running, h1, url)
                await streams.wait_first_tokens()
                signalled = trio.current_time()
                proxy.send(signal.SIGTERM)
                status = await proxy.wait_exit()
                exited = trio.current_time() - signalled
                await streams.wait_ended()
    CUTS["shutdown_grace 1s, 50 s streams"] = streams.cut()
    assert status == 0, proxy.stderr.text()
    # Cut at the deadline, not before, and exited right after it (the flush is bounded).
    assert 1.0 <= exited < 6.0, exited
    assert streams.cut() == streams.count(), streams.summary()
    for stream in streams.all():
        assert 0 < stream.tokens < streams.tokens
        assert stream.error is not None, stream  # never a clean end
    # Each curl says its stream was cut (a reset, or the connection closed mid-body).
    assert len(streams.curl_statuses) == STREAMS_PER_PROTOCOL, streams.summary()
    assert 0 not in streams.curl_statuses, streams.summary()
    stopped = await proxy.wait_log("muxproxy: stopped after ")
    total = streams.count()
    assert stopped.endswith(f"{total} of {total} streams cut at the end of the shutdown grace")
    assert fake.streams_completed == 0


async def test_second_sigint_cuts_at_once(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    _, backend = await start_backend(backend_id="one")
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text([backend], grace=30.0))
    streams = Streams(tokens=1000, delay=0.05, multiplex=False)
    with trio.fail_after(60):
        async with proxy_process(nursery, config=path) as proxy, clients() as h1:
            (port,) = proxy.ports()
            url = f"http://127.0.0.1:{port}"
            async with trio.open_nursery() as running:
                streams.start(running, h1, url)
                await streams.wait_first_tokens()
                proxy.send(signal.SIGINT)
                await proxy.wait_log("muxproxy: stopping: ")
                again = trio.current_time()
                proxy.send(signal.SIGINT)
                status = await proxy.wait_exit()
                exited = trio.current_time() - again
                await streams.wait_ended()
    CUTS["second SIGINT"] = streams.cut()
    assert status == 0, proxy.stderr.text()
    assert exited < 5.0, exited
    assert streams.cut() == streams.count(), streams.summary()
    # Each curl says its stream was cut (a reset, or the connection closed mid-body).
    assert len(streams.curl_statuses) == STREAMS_PER_PROTOCOL, streams.summary()
    assert 0 not in streams.curl_statuses, streams.summary()
    total = streams.count()
    line = await proxy.wait_log("muxproxy: SIGINT again: ")
    assert line == f"muxproxy: SIGINT again: cutting {total} streams now (exit status stays 0)"
    stopped = await proxy.wait_log("muxproxy: stopped after ")
    assert stopped.endswith(f"{total} of {total} streams cut on a second signal"), stopped


# ---- reload ----------------------------------------------------------------------------------


async def test_sighup_reloads_listeners_and_groups_without_touching_streams(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    """127.0.0.2 and 127.0.0.3 are loopback addresses too (Linux routes all of 127/8 to lo):
    three listeners, each on port 0, told apart by address."""
    one, backend_one = await start_backend(backend_id="one")
    _, backend_two = await start_backend(backend_id="two")
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text([backend_one], listeners=("127.0.0.1:0", "127.0.0.2:0")))
    streams = Streams(tokens=40, delay=0.05)
    with trio.fail_after(60):
        async with (
            proxy_process(nursery, config=path, listeners=2) as proxy,
            clients() as h1,
        ):
            kept, removed = proxy.ports()
            url = f"http://127.0.0.1:{kept}"
            async with trio.open_nursery() as running:
                streams.start(running, h1, url)
                await streams.wait_first_tokens()
                path.write_text(
                    config_text([backend_two], listeners=("127.0.0.1:0", "127.0.0.3:0"))
                )
                proxy.send(signal.SIGHUP)
                line = await proxy.wait_log("muxproxy: reloaded ")
                assert line == f"muxproxy: reloaded {path} (generation 2)"
                added = await proxy.stdout.wait_for(lambda x: "http://127.0.0.3:" in x)
                assert added.startswith("muxproxy listening on http://127.0.0.3:")
                # New requests go to the changed group, on the kept and the new listener.
                assert await backend_of(url) == "two"
                assert await backend_of(f"http://127.0.0.3:{proxy.ports()[-1]}") == "two"
                assert refuses(removed, host="127.0.0.2")
                assert not any(s.ended for s in streams.all()), streams.summary()
            CUTS["SIGHUP reload"] = streams.cut()
            assert streams.complete() == streams.count(), streams.summary()
            assert streams.backends() == {"one"}
            proxy.send(signal.SIGTERM)
            assert await proxy.wait_exit() == 0, proxy.stderr.text()
    assert one.streams_completed == streams.count()


INVALID = {
    "a bad value": (
        lambda text: text.replace("shutdown_grace = 30.0", "shutdown_grace = -1"),
        "timeouts.shutdown_grace: expected a positive, finite number of seconds, got -1",
    ),
    "a number past its range": (
        lambda text: text.replace("shutdown_grace = 30.0", "shutdown_grace = 1e300"),
        "timeouts.shutdown_grace: expected more than 0 and at most 86400 seconds (a day),"
        " got 1e+300; lower it to 86400 or less",
    ),
    "a TOML syntax error": (
        lambda text: text + "\n[upstreams.llm\n",
        ", line ",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
async def test_sighup_with_an_invalid_file_keeps_the_running_configuration(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend, case: str
) -> None:
    one, backend_one = await start_backend(backend_id="one")
    _, backend_two = await start_backend(backend_id="two")
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text([backend_one]))
    streams = Streams(tokens=30, delay=0.05)
    change, problem = INVALID[case]
    with trio.fail_after(60):
        async with proxy_process(nursery, config=path) as proxy, clients() as h1:
            (port,) = proxy.ports()
            url = f"http://127.0.0.1:{port}"
            async with trio.open_nursery() as running:
                streams.start(running, h1, url)
                await streams.wait_first_tokens()
                # The group would change too: none of the file may apply.
                path.write_text(change(config_text([backend_two])))
                proxy.send(signal.SIGHUP)
                kept = await proxy.wait_log("not applied; still running generation 1")
                assert kept == f"muxproxy: {path} not applied; still running generation 1"
                refused = proxy.log_messages("reload refused")
                assert refused, proxy.stderr.text()
                for line in refused:
                    assert line.startswith(f"muxproxy: reload refused: {path}"), line
                assert any(problem in line for line in refused), refused
                assert await backend_of(url) == "one"
            CUTS[f"SIGHUP with {case}"] = streams.cut()
            assert streams.complete() == streams.count(), streams.summary()
            assert "reloaded" not in proxy.stderr.text()
            proxy.send(signal.SIGTERM)
            assert await proxy.wait_exit() == 0, proxy.stderr.text()
    assert one.streams_completed == streams.count()


async def test_sighup_with_a_listener_that_cannot_bind_changes_nothing(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    _, backend_one = await start_backend(backend_id="one")
    _, backend_two = await start_backend(backend_id="two")
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text([backend_one]))
    with socket.socket() as busy, trio.fail_after(60):
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        async with proxy_process(nursery, config=path) as proxy:
            (port,) = proxy.ports()
            # Two new listeners: the free one must not stay bound when the other fails.
            path.write_text(
                config_text(
                    [backend_two], listeners=("127.0.0.1:0", "127.0.0.3:0", f"127.0.0.1:{taken}")
                )
            )
            proxy.send(signal.SIGHUP)
            await proxy.wait_log("not applied; still running generation 1")
            (refused,) = proxy.log_messages("reload refused")
            assert refused.startswith(
                f"muxproxy: reload refused: {path}: cannot listen on 127.0.0.1:{taken}: "
            ), refused
            assert await backend_of(f"http://127.0.0.1:{port}") == "one"
            assert len(proxy.ports()) == 1  # no new listening line
            proxy.send(signal.SIGTERM)
            assert await proxy.wait_exit() == 0, proxy.stderr.text()


async def test_sighup_in_quick_mode_has_nothing_to_reload(
    nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    _, backend = await start_backend(backend_id="one")
    args = ("--listen", "127.0.0.1:0", "--upstream", f"127.0.0.1:{backend}")
    with trio.fail_after(60):
        async with proxy_process(nursery, *args) as proxy:
            (port,) = proxy.ports()
            proxy.send(signal.SIGHUP)
            line = await proxy.wait_log("SIGHUP")
            assert line == (
                "muxproxy: SIGHUP: nothing to reload (configured by --listen, not --config)"
            )
            assert await backend_of(f"http://127.0.0.1:{port}") == "one"
            proxy.send(signal.SIGTERM)
            assert await proxy.wait_exit() == 0, proxy.stderr.text()


# ---- SIGUSR1, SIGUSR2 ------------------------------------------------------------------------


async def test_sigusr1_reopens_the_access_log_and_sigusr2_is_ignored(
    tmp_path: Path, nursery: trio.Nursery, start_backend: StartBackend
) -> None:
    # Unhandled, either signal ended the process at once (exit status 138 / 140), cutting
    # every stream: SIGUSR1 is what logrotate rules written for nginx send.
    _, backend = await start_backend(backend_id="one")
    access, rotated = tmp_path / "access.log", tmp_path / "access.log.1"
    path = tmp_path / "muxproxy.toml"
    path.write_text(config_text([backend], extra=f'\n[log]\naccess = "{access}"\n'))
    with trio.fail_after(60):
        async with proxy_process(nursery, config=path) as proxy:
            (port,) = proxy.ports()
            url = f"http://127.0.0.1:{port}"
            assert await backend_of(url) == "one"
            access.rename(rotated)
            proxy.send(signal.SIGUSR1)
            line = await proxy.wait_log("SIGUSR1")
            assert line == f"muxproxy: SIGUSR1: reopened the access log {access}"
            assert await backend_of(url) == "one"
            proxy.send(signal.SIGUSR2)
            line = await proxy.wait_log("SIGUSR2")
            assert line.startswith("muxproxy: SIGUSR2 ignored: a rolling restart needs workers")
            assert await backend_of(url) == "one"
            proxy.send(signal.SIGTERM)
            assert await proxy.wait_exit() == 0, proxy.stderr.text()
    assert len(rotated.read_text().splitlines()) == 1
    assert len(access.read_text().splitlines()) == 2
