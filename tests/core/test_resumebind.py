"""A resumable stream is bound to every credential its request carried
(``core/streams/resumebind.py``).

Through the core with bytes (the playbook's HTTP/1.1 and HTTP/2 peers): a stream begun with
an API key, an Azure-style ``api-key``, a cookie or ``Proxy-Authorization`` is resumed only
by a request that carries the same, and a resume with none (or another) is answered exactly
as an unknown token is (the conversations of ``test_resume.py``, every command in order). And
the digest itself: canonical, length-prefixed, never the values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import h11
import pytest
from checks import Check, both, h1_body, h1_response, h2_body, h2_response
from playbook import H2ClientPeer, Playbook, Sends, data
from test_resume import SSE, Stream, idle, lingers, refused, resume, resume_config

from muxproxy.config import RESUME_CREDENTIALS, SessionSource
from muxproxy.core.commands import CancelTimer, CloseConnection, SetTimer
from muxproxy.core.http.credentials import credential_key
from muxproxy.core.streams.resumebind import binding, canonical_values

NAMES = [name.encode() for name in RESUME_CREDENTIALS]
UNKNOWN = b"A" * 22 + b".1"


def answer(
    pb: Playbook, conn: int, event_id: bytes, headers: list[tuple[str, str]], check: Check
) -> bytes:
    """A new client on ``conn`` resumes after ``event_id`` with ``headers`` and is refused
    (``check``): an SSE client's connection then goes idle, another's is closed after its
    410. Returns the answer's bytes, Date and request id blanked."""
    reply = resume(pb, conn, event_id, check, headers)
    if ("Accept", "text/event-stream") in headers:
        idle(pb, conn)
    else:
        pb << CloseConnection(conn=conn)
        pb.done()
    data = reply.data
    for name in (b"date: ", b"x-request-id: "):
        if name not in data:
            continue
        start = data.index(name) + len(name)
        data = data[:start] + data[data.index(b"\r\n", start) :]
    return data


def holds(template: bytes, first: Stream) -> Check:
    """A 200 whose body holds ``template`` (with the stream's token), and no resume error."""

    def check(events: Sequence[Any]) -> None:
        body = h1_body(events)
        assert first.ids(template) in body and b"resume_" not in body, body

    return both(h1_response(200), check)


def two_events(pb: Playbook, headers: list[tuple[str, str]]) -> Stream:
    """A stream begun with ``headers`` that sent "a" and "b"; its client went away."""
    first = Stream(pb, headers=headers)
    first.send(b"data: a\n\ndata: b\n\n", b"data: a\nid: {T}.1\n\ndata: b\nid: {T}.2\n\n")
    lingers(pb)
    return first


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
    first = two_events(pb, [credential])
    seen = first.id(1)
    no = refused("resume_unknown") if accept else h1_response(410)
    unknown = answer(pb, 2, UNKNOWN, accept, no)
    # No oracle: the same status, head and body as a token that never existed.
    assert answer(pb, 3, seen, accept, no) == unknown
    assert answer(pb, 4, seen, [*accept, (credential[0], credential[1] + "x")], no) == unknown
    assert answer(pb, 5, seen, [*accept, ("Authorization", "Bearer alice-too")], no) == unknown
    assert pb.core.resumes.refused["unknown"] == 4
    owner = resume(pb, 6, seen, holds(b"data: b\nid: {T}.2\n\n", first), [*accept, credential])
    pb << CancelTimer(timer=("linger", 1))
    pb.done()
    assert owner.data.startswith(b"HTTP/1.1 200 ")
    assert pb.core.resumes.resumed == 1


def test_one_clients_cookies_and_scheme_spelling_resume_over_http2() -> None:
    """The same credentials, as HTTP/2 carries them: cookies one field each, in another
    order (RFC 9113 §8.2.3), the auth-scheme in other case (RFC 9110 §11.1)."""
    pb = Playbook(resume_config())
    first = two_events(pb, [("Cookie", "a=1; b=2"), ("Authorization", "Bearer k")])
    client = H2ClientPeer()
    pb.accept(2)
    pb >> data(2, client.preface())
    pb << SetTimer(timer=("send", 2), at=60.0)
    pb << Sends(2, client)
    resumed = [
        (b"last-event-id", first.id(1)),
        (b"accept", b"text/event-stream"),
        (b"cookie", b"b=2"),
        (b"cookie", b"a=1"),
        (b"authorization", b"bearer   k"),
    ]
    sid, request = client.request(b"GET", b"/v1/chat/completions", headers=resumed)

    def replayed(events: Sequence[Any]) -> None:
        body = h2_body(events, sid)
        assert first.ids(b"data: b\nid: {T}.2\n\n") in body and b"resume_" not in body, body

    pb >> data(2, request)
    pb << CancelTimer(timer=("header", 2))
    pb << Sends(2, client, both(h2_response(sid, 200), replayed))
    pb << CancelTimer(timer=("linger", 1))
    pb.done()
    assert pb.core.resumes.resumed == 1


def test_the_tenant_and_session_key_are_bound_too() -> None:
    config = resume_config()
    (group,) = config.upstreams.values()
    tenant = SessionSource(kind="header", name="x-tenant")
    config = attrs.evolve(config, upstreams={"default": attrs.evolve(group, tenant=tenant)})
    pb = Playbook(config)
    first = two_events(pb, [("X-Tenant", "acme")])
    seen = first.id(1)
    unknown = refused("resume_unknown")
    answer(pb, 2, seen, [*SSE, ("X-Tenant", "evil")], unknown)
    answer(pb, 3, seen, SSE, unknown)
    resume(pb, 4, seen, holds(b"data: b\n", first), [*SSE, ("X-Tenant", "acme")])
    pb << CancelTimer(timer=("linger", 1))
    pb.done()


def test_credential_headers_are_configurable() -> None:
    pb = Playbook(resume_config(credential_headers=("x-team-token",)))
    first = two_events(pb, [("X-Team-Token", "t1")])
    seen = first.id(1)
    answer(pb, 2, seen, SSE, refused("resume_unknown"))
    resume(pb, 3, seen, holds(b"data: b\n", first), [*SSE, ("X-Team-Token", "t1")])
    pb << CancelTimer(timer=("linger", 1))
    pb.done()


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
    first.send(b"data: a\n\n", b"data: a\nid: {T}.1\n\n")
    pb >> data(-1, first.backend.end())
    pb << SetTimer(timer=("linger", 1), at=30.0)  # the ended stream is kept for resumes
    pb << Sends(1, first.client, lambda events: [type(e) for e in events] == [h11.EndOfMessage])
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    idle(pb, 1)


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
