"""Credentials as the proxy reads them: one spelling per credential, one field per request.

A credential names who pays (the tenant of ``admit.py``, whose budgets and queue share it
holds) and whom a resumed stream belongs to (``resume.py``). Whatever derives an identity
from a request reads it through :func:`credential_key`, so that two spellings of one
credential are one identity everywhere. What it obeys:

- RFC 9110 §11.4 / §11.6.2: ``credentials = auth-scheme [ 1*SP ( token68 / #auth-param ) ]``,
  and §11.1: the auth-scheme is case-insensitive. ``Bearer k``, ``bearer k``, ``BEARER  k``
  and ``Bearer<TAB>k`` are one credential to the server that checks it, so they are one
  identity here: the scheme lower-cased, one SP, the rest as sent (a token68 is
  case-sensitive). Surrounding whitespace (RFC 9110 §5.5: OWS is not part of a field value;
  h11 strips it, an HTTP/2 value may not carry it, RFC 9113 §8.2.1) is dropped too. A value
  without whitespace is kept as it is: it is a bare scheme, or (for the many APIs that send
  a raw key in ``Authorization``) a key, which is case-sensitive.
- RFC 9110 §5.3: a field that is not a list must not be sent twice, and Authorization
  (§11.6.2) is one credential, not a list. With two, which one counts is each parser's
  choice: the tenant taken from one while the backend authenticates with the other would let
  a client be any tenant it likes. A request with more than one is refused with 400, as
  RFC 9112 §3.2 refuses two Host fields for the same reason (:func:`check_credentials`);
  so is one with its tenant's own header twice (``admit.repeated_tenant_field``).
"""

from __future__ import annotations

from collections.abc import Iterable

from muxproxy.core.http.intake import MalformedRequest
from muxproxy.core.messages import RequestHead

__all__ = [
    "AUTHORIZATION",
    "CREDENTIAL_FIELDS",
    "check_credentials",
    "credential_key",
    "normal_credentials",
    "repeated_field",
]

AUTHORIZATION = b"authorization"
CREDENTIAL_FIELDS = frozenset({AUTHORIZATION, b"proxy-authorization"})
"""Fields whose value is ``auth-scheme [ 1*SP credentials ]`` (RFC 9110 §11.6.2, §11.7.2)."""

_OWS = b" \t"


def normal_credentials(value: bytes) -> bytes:
    """``value`` (an Authorization field value) in its one spelling: surrounding whitespace
    dropped and, when credentials follow the scheme, the scheme lower-cased and the
    whitespace after it made one SP (RFC 9110 §11.1, §11.4)."""
    value = value.strip(_OWS)
    cut = _first_ows(value)
    if cut < 0:
        return value
    return value[:cut].lower() + b" " + value[cut:].lstrip(_OWS)


def _first_ows(value: bytes) -> int:
    space, tab = value.find(b" "), value.find(b"\t")
    if space < 0 or 0 <= tab < space:
        return tab
    return space


def credential_key(name: bytes, value: bytes) -> bytes:
    """The identity a field ``name`` (lower case) with ``value`` names: for a credential field
    its :func:`normal_credentials`, for any other field the value without surrounding
    whitespace."""
    if name in CREDENTIAL_FIELDS:
        return normal_credentials(value)
    return value.strip(_OWS)


def repeated_field(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bool:
    """Whether field ``name`` (lower case) is in ``headers`` more than once."""
    seen = False
    for field_name, _ in headers:
        if field_name == name:
            if seen:
                return True
            seen = True
    return False


def check_credentials(head: RequestHead) -> None:
    """Refuse a request with more than one Authorization field (400, see the module)."""
    if repeated_field(head.headers, AUTHORIZATION):
        raise MalformedRequest("more than one authorization field")
