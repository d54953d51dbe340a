"""The TLS context a listener serves with: its certificate pair, ALPN and the TLS floor.

Obeys RFC 9113 §3.2 (h2 over TLS is chosen by ALPN "h2", RFC 7301; every other client gets
http/1.1) and §9.2 (HTTP/2 over TLS 1.2 or later). Made once per listener when it starts, and
again at each reload (a renewed certificate at the same path is read again).

The configuration loaders check the pair first (``config/tls.py``) and say which file is
wrong; the only failure left here is the files changing in between, reported as ``OSError``
naming both, never OpenSSL's ``[SSL] PEM lib`` that names neither. An encrypted key never
gets OpenSSL's interactive prompt: a server must not wait on a terminal.
"""

from __future__ import annotations

import ssl

from muxproxy.config import Listener

__all__ = ["server_ssl_context"]


def server_ssl_context(listener: Listener) -> ssl.SSLContext:
    """The TLS context of ``listener``. Raises ``OSError`` naming both files when the pair
    cannot be loaded (the configuration loaders check it first; this is the file changing
    in between), rather than OpenSSL's ``[SSL] PEM lib`` that names neither."""
    assert listener.tls_cert is not None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(listener.tls_cert, listener.tls_key, password=_no_password)
    except (OSError, ValueError) as exc:
        raise OSError(
            f"cannot load the TLS certificate {listener.tls_cert!r} and key"
            f" {listener.tls_key!r} of {listener.address}: {exc}"
        ) from exc
    # RFC 9113 §3.2: "h2" over TLS; http/1.1 for everyone else.
    context.set_alpn_protocols(["h2", "http/1.1"])
    # RFC 9113 §9.2: TLS 1.2 or later for HTTP/2.
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _no_password() -> str:
    # Never OpenSSL's interactive prompt for an encrypted key: a server must not wait on a
    # terminal (the configuration loaders refuse encrypted keys).
    raise ValueError("the private key is encrypted; muxproxy needs it unencrypted")
