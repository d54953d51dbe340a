"""A listener's TLS files: can the certificate chain and its private key be loaded, and if
not, which of the two files is wrong and why.

Internal to :mod:`muxproxy.config`. OpenSSL's own error for a bad pair names neither file
(``[SSL] PEM lib (_ssl.c:3905)``), so the files are looked at first: readable, a PEM
``CERTIFICATE`` in the one, a PEM private key in the other (both swapped is the common
mistake), an unencrypted key. Only then are they loaded, as the server will load them, which
also tells a key that does not belong to the certificate.
"""

from __future__ import annotations

import re

__all__ = ["tls_pair_problems"]

_PEM_LABEL = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----")
_CERTIFICATE_LABELS = frozenset({b"CERTIFICATE", b"TRUSTED CERTIFICATE", b"X509 CERTIFICATE"})
"""The PEM labels OpenSSL reads a certificate from (RFC 7468 §5, and OpenSSL's own two)."""


def tls_pair_problems(
    cert: str, key: str, names: tuple[str, str] = ("tls_cert", "tls_key")
) -> list[tuple[str, str]]:
    """What is wrong with the certificate chain file ``cert`` and the key file ``key``.

    Returns ``(which, message)`` pairs, ``which`` being ``"cert"`` or ``"key"`` (the file the
    message is about, which the caller names by its key or flag); empty when the pair loads.
    ``names`` are how the caller spells the two settings, for the advice to swap them.
    """
    contents: dict[str, bytes] = {}
    problems: list[tuple[str, str]] = []
    for which, path in (("cert", cert), ("key", key)):
        try:
            with open(path, "rb") as file:
                contents[which] = file.read()
        except OSError as exc:
            problems.append((which, f'cannot read "{path}": {exc.strerror or exc}'))
    if problems:
        return problems
    cert_labels = set(_PEM_LABEL.findall(contents["cert"]))
    key_labels = set(_PEM_LABEL.findall(contents["key"]))
    cert_has_cert = bool(cert_labels & _CERTIFICATE_LABELS)
    key_has_key = any(label.endswith(b"PRIVATE KEY") for label in key_labels)
    if not cert_has_cert and not key_has_key and key_labels & _CERTIFICATE_LABELS:
        return [
            (
                "cert",
                f'"{cert}" holds no certificate, but "{key}" does: the two files look'
                f" swapped; give the certificate as {names[0]} and the key as {names[1]}",
            )
        ]
    if not cert_has_cert:
        problems.append(
            (
                "cert",
                f'"{cert}" holds no PEM certificate (-----BEGIN CERTIFICATE-----);'
                f" found {_found(cert_labels)}",
            )
        )
    if not key_has_key:
        problems.append(
            (
                "key",
                f'"{key}" holds no PEM private key (-----BEGIN PRIVATE KEY-----);'
                f" found {_found(key_labels)}",
            )
        )
    elif b"ENCRYPTED PRIVATE KEY" in key_labels or b"Proc-Type: 4,ENCRYPTED" in contents["key"]:
        problems.append(
            (
                "key",
                f'"{key}" holds an encrypted private key; muxproxy needs it unencrypted'
                " (openssl pkey -in KEY -out PLAIN.pem)",
            )
        )
    if problems:
        return problems
    return _load_problems(cert, key)


def _load_problems(cert: str, key: str) -> list[tuple[str, str]]:
    """Load the pair as ``trio.servertls.server_ssl_context`` does; what OpenSSL refused."""
    import ssl  # only when a listener has TLS: ``muxproxy check`` stays light otherwise

    def no_password() -> str:
        # Never OpenSSL's interactive prompt: an encrypted key is refused above, and one that
        # got past that check must not make the process wait on a terminal.
        raise ValueError("the private key is encrypted")

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key, password=no_password)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            message = f'the private key in "{key}" does not belong to the certificate in "{cert}"'
            return [("key", message)]
        return [("cert", f'cannot load "{cert}" with the key "{key}": {exc.reason or exc}')]
    except (OSError, ValueError) as exc:
        return [("cert", f'cannot load "{cert}" with the key "{key}": {exc}')]
    return []


def _found(labels: set[bytes]) -> str:
    if not labels:
        return "no PEM block"
    return ", ".join(f"-----BEGIN {label.decode()}-----" for label in sorted(labels))
