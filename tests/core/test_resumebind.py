"""A resumable stream is bound to every credential its request carried
(``core/streams/resumebind.py``).

Through the core with bytes (the playbook's HTTP/1.1 and HTTP/2 peers): a stream begun with
an API key, an Azure-style ``api-key``, a cookie or ``Proxy-Authorization`` is resumed only
by a request that carries the same, and a resume with none (or another) is answered exactly
as an unknown token is. And the digest itself: canonical, length-prefixed, never the values.
"""

from __future__ import annotations

import attrs
import h2.events
import h11
import pytest
from playbook import H2ClientPeer, Playbook
from resume_setup import SSE, Stream, resume, resume_config

from muxproxy.config import RESUME_CREDENTIALS, SessionSource
from muxproxy.core.http.credentials import credential_key
from muxproxy.core.streams.resumebind import binding, canonical_values

NAMES = [name.encode() for name in RESUME_CREDENTIALS]
UNKNOWN = b"A" * 22 + b".1"


def answer(pb: Playbook, conn: int, event_id: bytes, headers: list[tuple[str, str]]) -> bytes:
    """The bytes a resume with ``headers`` is answered with, Date and request id blanked."""
    _, commands = resume(pb, conn, event_id, headers)
    data = pb.take(conn, commands)
    for name in (b"date: ", b"x-request-id: "):
        if name not in data:
            continue
        start = data.index(name) + len(name)
        data = data[:start] + data[data.index(b"\r\n", start) :]
    return data


@pytest.mark.parametrize(
    "credential",
    [
        ("X-Api-Key", "sk-alice"),
        ("Api-Key", "azure-alice"),
        ("Cookie", "session=alice"),
        ("Proxy-Authorization", "Basic YWxpY2U6cHc="),
        ("Authorization", "Bearer alice"),
    ],
)
@pytest.mark.parametrize("accept", [SSE, []])
def test_a_resume_without_the_streams_credential_is_answered_as_an_unknown_token(
    credential: tuple[str, str], accept: list[tuple[str, str]]
) -> None:
    pb = Playbook(resume_config())
    first = Stream(pb, headers=[credential])
    first.send(b"data: a\n\ndata: b\n\n")
    pb.closed(1)
    seen = first.last_id().replace(b".2", b".1")
    unknown = answer(pb, 2, UNKNOWN, accept)
    # No oracle: the same status, head and body as a token that never existed.
    assert answer(pb, 3, seen, accept) == unknown
    assert answer(pb, 4, seen, [*accept, (credential[0], credential[1] + "x")]) == unknown
    assert answer(pb, 5, seen, [*accept, ("Authorization", "Bearer alice-too")]) == unknown
    assert pb.core.resumes.refused["unknown"] == 4
    owner = answer(pb, 6, seen, [*accept, credential])
    assert owner.startswith(b"HTTP/1.1 200 ") and b"data: b\nid: " in owner
    assert pb.core.resumes.resumed == 1


def test_one_clients_cookies_and_scheme_spelling_resume_over_http2() -> None:
    """The same credentials, as HTTP/2 carries them: cookies one field each, in another
    order (RFC 9113 §8.2.3), the auth-scheme in other case (RFC 9110 §11.1)."""
    pb = Playbook(resume_config())
    headers = [("Cookie", "a=1; b=2"), ("Authorization", "Bearer k")]
    first = Stream(pb, headers=headers)
    first.send(b"data: a\n\ndata: b\n\n")
    pb.closed(1)
    client = H2ClientPeer()
    pb.accept(2)
    pb.receive(2, client.preface())
    resumed = [
        (b"last-event-id", first.last_id().replace(b".2", b".1")),
        (b"accept", b"text/event-stream"),
        (b"cookie", b"b=2"),
        (b"cookie", b"a=1"),
        (b"authorization", b"bearer   k"),
    ]
    _sid, request = client.request(b"GET", b"/v1/chat/completions", headers=resumed)
    events = client.events(pb.take(2, pb.receive(2, request)))
    data = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert b"data: b\nid: " in data and b"resume_" not in data
    assert pb.core.resumes.resumed == 1


def test_the_tenant_and_session_key_are_bound_too() -> None:
    config = resume_config()
    (group,) = config.upstreams.values()
    tenant = SessionSource(kind="header", name="x-tenant")
    config = attrs.evolve(config, upstreams={"default": attrs.evolve(group, tenant=tenant)})
    pb = Playbook(config)
    first = Stream(pb, headers=[("X-Tenant", "acme")])
    first.send(b"data: a\n\ndata: b\n\n")
    pb.closed(1)
    seen = first.last_id().replace(b".2", b".1")
    assert b"resume_unknown" in answer(pb, 2, seen, [*SSE, ("X-Tenant", "evil")])
    assert b"resume_unknown" in answer(pb, 3, seen, SSE)
    assert b"data: b\n" in answer(pb, 4, seen, [*SSE, ("X-Tenant", "acme")])


def test_credential_headers_are_configurable() -> None:
    pb = Playbook(resume_config(credential_headers=("x-team-token",)))
    first = Stream(pb, headers=[("X-Team-Token", "t1")])
    first.send(b"data: a\n\ndata: b\n\n")
    pb.closed(1)
    seen = first.last_id().replace(b".2", b".1")
    assert b"resume_unknown" in answer(pb, 2, seen, SSE)
    assert b"data: b\n" in answer(pb, 3, seen, [*SSE, ("X-Team-Token", "t1")])


def test_the_digest_is_canonical_length_prefixed_and_holds_no_credential() -> None:
    secret = b"sk-0123456789abcdef"
    digest = binding([(b"x-api-key", secret)], NAMES)
    assert len(digest) == 32 and secret not in digest
    assert digest != binding([], NAMES)
    # Moving bytes between two values, or between two fields, changes the digest.
    assert binding([(b"x-api-key", b"ab"), (b"x-api-key", b"c")], NAMES) != binding(
        [(b"x-api-key", b"a"), (b"x-api-key", b"bc")], NAMES
    )
    assert binding([(b"x-api-key", b"k")], NAMES) != binding([(b"api-key", b"k")], NAMES)
    assert binding([], NAMES, session_key=b"k") != binding([], NAMES, tenant=b"k")
    # One credential, spelled as a client or HTTP/2 may.
    assert canonical_values([(b"authorization", b"BEARER \t k")], b"authorization") == [b"bearer k"]
    assert canonical_values([(b"cookie", b"b=2;a=1"), (b"cookie", b" c=3 ")], b"cookie") == [
        b"a=1",
        b"b=2",
        b"c=3",
    ]


def test_the_first_client_is_unaffected_by_the_binding() -> None:
    pb = Playbook(resume_config())
    first = Stream(pb, headers=[("X-Api-Key", "k")])
    first.send(b"data: a\n\n")
    assert first.received.startswith(b"data: a\nid: ")
    events = first.client.events(pb.take(1, pb.receive(first.up, first.backend.end())))
    assert isinstance(events[-1], h11.EndOfMessage)


@pytest.mark.parametrize(
    "spelling", [b"Bearer k", b"bearer k", b"BEARER  k", b"Bearer\tk", b" Bearer k "]
)
def test_resume_and_admission_read_one_credential_alike(spelling: bytes) -> None:
    """The binding's reading of a credential is admission's (``credentials.credential_key``):
    every spelling the tenant key takes as one credential is one binding too."""
    assert canonical_values([(b"authorization", spelling)], b"authorization") == [
        credential_key(b"authorization", spelling)
    ]
    assert binding([(b"authorization", spelling)], NAMES) == binding(
        [(b"authorization", b"bearer k")], NAMES
    )
