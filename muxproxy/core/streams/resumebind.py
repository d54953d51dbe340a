"""What binds a resumable stream to its client: a digest of every credential the request carried.

What it obeys, and why:

- **Every credential.** A stream's token (``resume.py``) is unguessable but easy to leak
  (logs, screenshots), so a resume must carry what the request that began the stream
  carried: each field named in ``resume.credential_headers`` (by default ``Authorization``,
  ``Proxy-Authorization``, ``X-Api-Key``, the Azure-style ``Api-Key`` and ``Cookie``), the
  group's session key and its tenant as read from the request head. A field the first
  request had and the resume lacks (or the other way round) is a different binding: a
  request with no credential never resumes a stream begun with one.
- **Canonical, so one client's two requests agree.** RFC 9110 §5.3: several fields of one
  name are one list, in order, so each is kept in order; RFC 9110 §11.1: an auth-scheme is
  case-insensitive, so ``Bearer k`` and ``bearer k`` are one credential (the scheme is lower
  cased, the whitespace after it made one space: ``credentials.credential_key``, the
  reading admission's tenant uses too). RFC 9113 §8.2.3: HTTP/2 may split
  ``Cookie`` into one field per cookie-pair, and a stream begun over HTTP/1.1 may be
  resumed over HTTP/2, so the cookie-pairs of all ``Cookie`` fields are one sorted list.
- **Never the credentials themselves.** Only a SHA-256 over the canonical values, each
  length-prefixed (so no two different lists hash alike by moving bytes between values), is
  kept, in memory and in a shared store; comparisons are constant-time
  (``secrets.compare_digest``) by the caller.
- A ``body:`` session-key or tenant source is not part of the binding: a browser's
  reconnect carries no body.

Pure: a function of the request head and the configuration.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from muxproxy.config import Resume, SessionSource, Upstream
from muxproxy.core.http.credentials import credential_key
from muxproxy.core.messages import Headers, RequestHead
from muxproxy.routing.sticky import session_key_from_head, source_value

DOMAIN = b"muxproxy resume binding v1"
"""Hashed first: a digest of this kind is never equal to a digest of anything else."""


def binding_of(settings: Resume, group: Upstream, head: RequestHead) -> bytes:
    """The 32-byte digest a resume of a stream begun by ``head`` must match."""
    session_key, _ = session_key_from_head(group.sticky.sources, head.headers, head.target)
    tenant = _head_source(group.tenant, head)
    names = tuple(name.encode("ascii") for name in settings.credential_headers)
    return binding(head.headers, names, session_key=session_key, tenant=tenant)


def binding(
    headers: Headers,
    names: Iterable[bytes],
    *,
    session_key: bytes | None = None,
    tenant: bytes | None = None,
) -> bytes:
    """SHA-256 over the canonical values of ``names`` (lower case) in ``headers``, the
    session key and the tenant, each length-prefixed."""
    digest = hashlib.sha256(DOMAIN)
    parts: list[tuple[bytes, list[bytes]]] = [
        (name, canonical_values(headers, name)) for name in names
    ]
    parts.append((b":session-key", [] if session_key is None else [session_key]))
    parts.append((b":tenant", [] if tenant is None else [tenant]))
    for name, values in parts:
        digest.update(_framed(name))
        digest.update(len(values).to_bytes(4, "big"))
        for value in values:
            digest.update(_framed(value))
    return digest.digest()


def canonical_values(headers: Headers, name: bytes) -> list[bytes]:
    """The values of the fields ``name`` in ``headers``, canonical (see the module)."""
    values = [credential_key(name, value) for field, value in headers if field == name]
    if name == b"cookie":
        pairs = (pair.strip(b" \t") for value in values for pair in value.split(b";"))
        return sorted(pair for pair in pairs if pair)
    return values


def _head_source(source: SessionSource | None, head: RequestHead) -> bytes | None:
    if source is None or source.kind == "body":
        return None
    value = source_value(source, head.headers, head.target, None)
    if value is not None and source.kind == "header":
        # The tenant as admission reads it (admit.py): one spelling per credential.
        value = credential_key(source.name.encode("latin-1"), value)
    return value


def _framed(value: bytes) -> bytes:
    return len(value).to_bytes(4, "big") + value
