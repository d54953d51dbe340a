"""TLS to a backend: its certificate verified, and the ALPN protocol the core asked for.

What it obeys, and why:

- **Verified.** The context is ``ssl.create_default_context`` with the server's ``tls_ca``
  (None: the system's roots), so the certificate chain and the host name are checked (the
  name is ``tls_server_name``, else the server's host). A proxy that skipped this would hand
  every prompt to whoever answers on the address.
- **ALPN decides h2** (RFC 9113 §3.2, RFC 7301): a server configured ``protocol = "h2"``
  offers "h2" alone, and a backend that does not select it is refused
  (:class:`BackendTLSError`, which the driver reports as ``OpenFailed``) rather than spoken
  to in a protocol it did not agree to; an "h1" server offers "http/1.1".
- **One context per (CA file, ALPN protocol)**, made on first use and kept: a context loads
  its CA file once, not per connection.

A failed handshake closes the TCP connection under it before it raises.
"""

from __future__ import annotations

import ssl

import trio

from muxproxy.core.commands import Origin

__all__ = ["BackendTLS", "BackendTLSError"]


class BackendTLSError(Exception):
    """A backend's TLS handshake or ALPN result was not acceptable."""


class BackendTLS:
    """The TLS contexts for backends, and the handshake over a connected TCP stream."""

    def __init__(self) -> None:
        self._contexts: dict[tuple[str | None, str], ssl.SSLContext] = {}

    async def handshake(
        self, tcp: trio.SocketStream, origin: Origin
    ) -> trio.SSLStream[trio.SocketStream]:
        """TLS to a backend, verifying its certificate, with the ALPN protocol it must pick."""
        key = (origin.ca, origin.alpn)
        context = self._contexts.get(key)
        if context is None:
            context = ssl.create_default_context(cafile=origin.ca)
            context.set_alpn_protocols([origin.alpn])
            self._contexts[key] = context
        stream = trio.SSLStream(tcp, context, server_hostname=origin.server_name or origin.host)
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            await trio.aclose_forcefully(tcp)
            raise BackendTLSError(f"TLS handshake with {origin} failed: {exc.__cause__!r}") from exc
        chosen = stream.selected_alpn_protocol()
        if origin.alpn == "h2" and chosen != "h2":
            # RFC 9113 §3.2: h2 over TLS only when the server selected it by ALPN.
            await trio.aclose_forcefully(stream)
            raise BackendTLSError(f"{origin} did not accept h2 by ALPN (chose {chosen!r})")
        return stream
