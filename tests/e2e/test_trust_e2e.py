"""Trust, end to end through a real ``python -m muxproxy serve``: tenants keyed by a credential
(any spelling of it is the same tenant; two Authorization fields are refused), the forwarded
fields a backend sees with and without ``trusted_proxies``, and the client's request id.

The backend is the fake LLM, which keeps the request headers it received. Clients write raw
HTTP/1.1 bytes (h11 would not write OWS inside a value as a client may); the peer is
127.0.0.1.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import trio
from peers import read_until_eof
from test_logs_e2e import fields_of, serve

if TYPE_CHECKING:
    from conftest import StartBackend

TEST_TIMEOUT = 20


def config(backend: int, *, listener: str = "", group: str = "") -> str:
    return (
        f'[[listeners]]\naddress = "127.0.0.1:0"\n{listener}\n'
        f'[upstreams.gpus]\nservers = ["127.0.0.1:{backend}"]\n{group}\n'
    )


async def raw_get(port: int, headers: list[bytes]) -> tuple[int, bytes]:
    """``GET /v1/models`` with ``headers`` (whole field lines) on a new connection: the
    status and the whole answer."""
    lines = [b"GET /v1/models HTTP/1.1", b"host: api.example", b"connection: close", *headers]
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"\r\n".join(lines) + b"\r\n\r\n")
        answer = await read_until_eof(stream)
    return int(answer.split(b" ", 2)[1]), answer


async def test_no_spelling_of_a_credential_escapes_its_request_budget(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    fake, backend = await start_backend(tokens=1, delay=0)
    group = 'tenant = "header:Authorization"\n[upstreams.gpus.rate_limit]\nrequests_per_minute = 1'
    async with serve(tmp_path, config(backend, group=group)) as proxy:
        with trio.fail_after(TEST_TIMEOUT):
            first, _ = await raw_get(proxy.port, [b"Authorization: Bearer team-a"])
            others = [
                await raw_get(proxy.port, [b"Authorization: " + spelling])
                for spelling in (b"bearer team-a", b"Bearer  team-a", b"BEARER\t team-a ")
            ]
            twice, answer = await raw_get(
                proxy.port, [b"Authorization: Bearer team-b", b"Authorization: Bearer team-c"]
            )
            other, _ = await raw_get(proxy.port, [b"Authorization: Bearer team-b"])
    assert first == 200
    assert [status for status, _ in others] == [429, 429, 429]
    assert all(b"x-ratelimit-remaining-requests: 0" in answer for _, answer in others)
    assert twice == 400 and b"more than one authorization field" in answer
    assert other == 200
    assert fake.requests == 2  # team-a's first and team-b's


CLAIMS = [
    b"X-Forwarded-For: 203.0.113.9",
    b"X-Forwarded-Proto: https",
    b"X-Forwarded-Host: admin.internal",
    b"Forwarded: for=203.0.113.9;proto=https",
    b"X-Real-IP: 203.0.113.9",
]


async def claims_forwarded(
    tmp_path: Path, start_backend: StartBackend, listener: str
) -> dict[str, str]:
    """A GET with all the ``CLAIMS`` through a proxy whose listener has ``listener``: it is
    answered 200, and this returns the header fields the backend got."""
    fake, backend = await start_backend(tokens=1, delay=0)
    async with serve(tmp_path, config(backend, listener=listener)) as proxy:
        with trio.fail_after(TEST_TIMEOUT):
            status, _ = await raw_get(proxy.port, CLAIMS)
    assert status == 200
    assert fake.last_request_headers is not None
    return fake.last_request_headers


async def test_forwarded_fields_from_an_untrusted_peer_are_replaced(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    seen = await claims_forwarded(tmp_path, start_backend, "trusted_proxies = []")
    assert seen["x-forwarded-for"] == "127.0.0.1"
    assert seen["x-forwarded-proto"] == "http"
    for name in ("x-forwarded-host", "forwarded", "x-real-ip"):
        assert name not in seen


async def test_forwarded_fields_from_a_trusted_proxy_are_appended_to(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    seen = await claims_forwarded(tmp_path, start_backend, 'trusted_proxies = ["127.0.0.1/32"]')
    assert seen["x-forwarded-for"] == "203.0.113.9, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "https"
    assert seen["x-forwarded-host"] == "admin.internal"
    assert seen["forwarded"] == "for=203.0.113.9;proto=https, for=127.0.0.1;proto=http"
    assert seen["x-real-ip"] == "203.0.113.9"


async def test_an_unsafe_request_id_is_replaced_and_both_are_logged(
    tmp_path: Path, start_backend: StartBackend
) -> None:
    fake, backend = await start_backend(tokens=1, delay=0)
    async with serve(tmp_path, config(backend)) as proxy:
        with trio.fail_after(TEST_TIMEOUT):
            status, answer = await raw_get(proxy.port, [b'X-Request-ID: id"x=1 status=200'])
            replaced = await proxy.line_with(" request_id_replaced ")
            (ours,) = [
                line.split(b":", 1)[1].strip().decode()
                for line in answer.split(b"\r\n")
                if line.lower().startswith(b"x-request-id:")
            ]
            access = await proxy.line_with(f"request_id={ours} client=")
    assert status == 200
    assert fake.last_request_headers is not None
    assert fake.last_request_headers["x-request-id"] == ours
    assert f"request_id={ours}" in replaced
    assert "client_request_id=id\\x22x\\x3d1\\x20status\\x3d200" in replaced
    assert "client=127.0.0.1" in replaced
    assert fields_of(access)["status"] == "200"
