"""End-to-end gRPC: a real ``grpcio`` client through the proxy (h2c listener) to a real
``grpcio`` server configured as an h2 backend. No protoc: a generic handler with bytes in and
out. grpcio is blocking, so client calls run in threads (``trio.to_thread.run_sync``); the
server runs its own thread pool.

Asserted: unary, server-streaming and bidirectional calls; a non-OK status with its message
delivered end to end, both as trailers after messages and as a Trailers-Only response; the
proxy's own failures answered as gRPC (UNAVAILABLE), never an HTTP error page; ``grpc-timeout``
honoured by the proxy (DEADLINE_EXCEEDED in a Trailers-Only response); ``te: trailers`` kept.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import grpc
import pytest
import trio
from peers import open_h2
from processes import proxy_process

from muxproxy.config import Config, quick_config

if TYPE_CHECKING:
    from conftest import StartProxy

SERVICE = "test.Echo"
seen_metadata: dict[str, str] = {}


def _unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    seen_metadata.update({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
    return request.upper()


def _stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    for i in range(int(request)):
        yield f"msg{i}".encode()


def _bidi(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    for request in requests:
        yield b"echo:" + request


def _fail_early(request: bytes, context: grpc.ServicerContext) -> bytes:
    # Aborting before any message: grpcio answers with a Trailers-Only response.
    context.abort(grpc.StatusCode.PERMISSION_DENIED, "not for you")
    raise AssertionError("abort returns no value")


PUSHBACK = (("custom-key", "custom-value"), ("grpc-retry-pushback-ms", "250"))
"""Trailing metadata of a call that fails before any message (a Trailers-Only response)."""


def _fail_with_metadata(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.set_trailing_metadata(PUSHBACK)
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down")
    raise AssertionError("abort returns no value")


def _fail_late(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    yield b"first"
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of tokens")


def _slow(request: bytes, context: grpc.ServicerContext) -> bytes:
    release.wait(5)
    return b"late"


release = threading.Event()


def _identity(value: bytes) -> bytes:
    return value


def _handler() -> grpc.GenericRpcHandler:
    def unary(fn: Callable[..., Any]) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(fn, _identity, _identity)

    def streaming(fn: Callable[..., Any]) -> grpc.RpcMethodHandler:
        return grpc.unary_stream_rpc_method_handler(fn, _identity, _identity)

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": unary(_unary),
            "Stream": streaming(_stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(_bidi, _identity, _identity),
            "FailEarly": unary(_fail_early),
            "FailWithMetadata": unary(_fail_with_metadata),
            "FailLate": streaming(_fail_late),
            "Slow": unary(_slow),
        },
    )


@pytest.fixture
def grpc_backend() -> Iterator[int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((_handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    release.clear()
    try:
        yield port
    finally:
        release.set()
        server.stop(None)


def with_servers(config: Config, **fields: Any) -> Config:
    """``config`` with ``fields`` set on every server of its ``default`` upstream group."""
    group = config.upstreams["default"]
    servers = tuple(attrs.evolve(s, **fields) for s in group.servers)
    return attrs.evolve(config, upstreams={"default": attrs.evolve(group, servers=servers)})


def h2_config(port: int) -> Config:
    return with_servers(quick_config("127.0.0.1:0", [f"127.0.0.1:{port}"]), protocol="h2")


def start_tls_grpc_server(cert: Any, max_workers: int) -> tuple[grpc.Server, int]:
    """A started grpcio server with the echo handlers, on TLS with ``cert`` (a trustme
    ``LeafCert``); the caller stops it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
    server.add_generic_rpc_handlers((_handler(),))
    credentials = grpc.ssl_server_credentials(
        [(cert.private_key_pem.bytes(), cert.cert_chain_pems[0].bytes())]
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port


def _method(channel: grpc.Channel, kind: str, name: str) -> Any:
    factory = getattr(channel, kind)
    return factory(
        f"/{SERVICE}/{name}", request_serializer=_identity, response_deserializer=_identity
    )


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


async def unary_error(channel: grpc.Channel, name: str) -> grpc.RpcError:
    """The error that a unary call of ``name`` (request ``x``) ends with."""
    call = _method(channel, "unary_unary", name)
    with pytest.raises(grpc.RpcError) as info:
        await in_thread(lambda: call(b"x", timeout=5))
    return info.value


async def test_unary_streaming_and_bidi_calls(grpc_backend: int, start_proxy: StartProxy) -> None:
    proxy = await start_proxy(config=h2_config(grpc_backend))
    with trio.fail_after(10), grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        unary = _method(channel, "unary_unary", "Unary")
        assert await in_thread(lambda: unary(b"hello", timeout=5)) == b"HELLO"
        # grpcio sends te: trailers; the backend must see it (gRPC servers require it).
        assert seen_metadata.get("te") in (None, "trailers")

        stream = _method(channel, "unary_stream", "Stream")
        got = await in_thread(lambda: list(stream(b"5", timeout=5)))
        assert got == [f"msg{i}".encode() for i in range(5)]

        bidi = _method(channel, "stream_stream", "Bidi")
        got = await in_thread(lambda: list(bidi(iter([b"a", b"b", b"c"]), timeout=5)))
        assert got == [b"echo:a", b"echo:b", b"echo:c"]
    # Every call used one shared backend connection.
    assert proxy.server.core.statistics().upstream_connections == 1


async def test_error_status_and_message_reach_the_client(
    grpc_backend: int, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config=h2_config(grpc_backend))
    with trio.fail_after(10), grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        error = await unary_error(channel, "FailEarly")
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error.details() == "not for you"

        late = _method(channel, "unary_stream", "FailLate")
        got: list[bytes] = []

        def collect() -> None:
            for message in late(b"x", timeout=5):
                got.append(message)

        with pytest.raises(grpc.RpcError) as info:
            await in_thread(collect)
        assert got == [b"first"]
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == "out of tokens"


async def test_trailers_only_metadata_reaches_the_client(
    grpc_backend: int, start_proxy: StartProxy
) -> None:
    """A Trailers-Only error keeps its metadata: grpcio reads the fields of such a response as
    trailing metadata, which a head split from its status would hide."""
    proxy = await start_proxy(config=h2_config(grpc_backend))
    with trio.fail_after(10), grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        error = await unary_error(channel, "FailWithMetadata")
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == "slow down"
    trailing = dict(error.trailing_metadata())
    assert trailing["custom-key"] == "custom-value"
    assert trailing["grpc-retry-pushback-ms"] == "250"


async def test_trailers_only_passes_through_to_raw_h2_client(
    grpc_backend: int, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config=h2_config(grpc_backend))
    headers = [("content-type", "application/grpc"), ("te", "trailers")]
    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer:
            sid = await peer.request(
                "POST", f"/{SERVICE}/FailEarly", headers, b"\x00\x00\x00\x00\x01x"
            )
            state = await peer.wait_done(sid)
    assert state.ended and state.status == 200
    fields = dict(state.headers or []) | dict(state.trailers or [])
    assert fields[b"grpc-status"] == b"7"
    assert fields[b"grpc-message"] == b"not for you"


async def test_proxy_failure_is_a_grpc_unavailable(start_proxy: StartProxy) -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]  # bound, never listening: connections are refused
        proxy = await start_proxy(config=h2_config(dead))
        with trio.fail_after(10), grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
            error = await unary_error(channel, "Unary")
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert error.details() == "upstream unavailable"
        # On the wire: HTTP 200, application/grpc, one HEADERS frame ending the stream.
        with trio.fail_after(10):
            async with open_h2(proxy.port) as peer:
                sid = await peer.request(
                    "POST", f"/{SERVICE}/Unary", [("content-type", "application/grpc")], b""
                )
                state = await peer.wait_done(sid)
        assert state.ended and state.status == 200 and state.trailers is None
        assert not state.data_frames
        fields = dict(state.headers or [])
        assert fields[b"content-type"] == b"application/grpc"
        assert fields[b"grpc-status"] == b"14"


async def test_grpc_timeout_is_honoured_by_the_proxy(
    grpc_backend: int, start_proxy: StartProxy
) -> None:
    proxy = await start_proxy(config=h2_config(grpc_backend))
    headers = [("content-type", "application/grpc"), ("te", "trailers"), ("grpc-timeout", "100m")]
    with trio.fail_after(10):
        async with open_h2(proxy.port) as peer:
            sid = await peer.request("POST", f"/{SERVICE}/Slow", headers, b"\x00\x00\x00\x00\x00")
            state = await peer.wait_done(sid)
    assert state.ended and state.status == 200
    fields = dict(state.headers or [])
    assert fields[b"grpc-status"] == b"4", fields
    assert b"deadline" in fields[b"grpc-message"]


async def test_grpc_over_tls_on_both_sides(start_proxy: StartProxy, tmp_path: Any) -> None:
    """A TLS gRPC client (ALPN h2) to the proxy's TLS listener, and TLS with ALPN h2 from the
    proxy to a TLS grpcio server, its certificate verified against the test CA."""
    import trustme

    ca = trustme.CA()
    backend_cert = ca.issue_cert("backend.test")
    proxy_cert = ca.issue_cert("127.0.0.1")
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert_file, key_file = tmp_path / "proxy.pem", tmp_path / "proxy.key"
    proxy_cert.cert_chain_pems[0].write_to_path(str(cert_file))
    proxy_cert.private_key_pem.write_to_path(str(key_file))

    server, port = start_tls_grpc_server(backend_cert, max_workers=4)
    try:
        config = quick_config(
            "127.0.0.1:0", [f"127.0.0.1:{port}"], tls_cert=str(cert_file), tls_key=str(key_file)
        )
        config = with_servers(
            config, protocol="h2", tls=True, tls_ca=str(ca_file), tls_server_name="backend.test"
        )
        proxy = await start_proxy(config=config)
        client_credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        with (
            trio.fail_after(10),
            grpc.secure_channel(f"127.0.0.1:{proxy.port}", client_credentials) as channel,
        ):
            unary = _method(channel, "unary_unary", "Unary")
            assert await in_thread(lambda: unary(b"secure", timeout=5)) == b"SECURE"
            stream = _method(channel, "unary_stream", "Stream")
            got = await in_thread(lambda: list(stream(b"3", timeout=5)))
            assert got == [b"msg0", b"msg1", b"msg2"]
            error = await unary_error(channel, "FailEarly")
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        server.stop(None)


async def test_backend_certificate_that_does_not_verify_is_unavailable(
    start_proxy: StartProxy, tmp_path: Any
) -> None:
    import trustme

    ca, other_ca = trustme.CA(), trustme.CA()
    backend_cert = ca.issue_cert("backend.test")
    wrong_ca = tmp_path / "other-ca.pem"
    other_ca.cert_pem.write_to_path(str(wrong_ca))
    server, port = start_tls_grpc_server(backend_cert, max_workers=2)
    try:
        config = with_servers(
            h2_config(port), tls=True, tls_ca=str(wrong_ca), tls_server_name="backend.test"
        )
        proxy = await start_proxy(config=config)
        with trio.fail_after(10), grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
            error = await unary_error(channel, "Unary")
            assert error.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


async def test_an_http2_server_configured_as_http11_is_named_in_the_log(
    grpc_backend: int, tmp_path: Path
) -> None:
    """A gRPC server left at the default ``protocol = "h1"``: the client gets UNAVAILABLE and
    the log of ``muxproxy serve`` names the cause and the fix, not only h11's complaint."""
    path = tmp_path / "muxproxy.toml"
    path.write_text(
        '[[listeners]]\naddress = "127.0.0.1:0"\n'
        f'[upstreams.grpc]\nservers = ["127.0.0.1:{grpc_backend}"]\n'
    )
    async with (
        trio.open_nursery() as nursery,
        proxy_process(nursery, config=path, stop=signal.SIGTERM) as proxy,
    ):
        with trio.fail_after(20):
            with grpc.insecure_channel(f"127.0.0.1:{proxy.ports()[0]}") as channel:
                error = await unary_error(channel, "Unary")
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            line = await proxy.stderr.wait_for(lambda line: "HTTP/2 SETTINGS frame" in line)
    assert 'set protocol = \\"h2\\" on this server' in line, line
