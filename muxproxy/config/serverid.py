"""A server's stable, opaque id: its rendezvous-hashing identity and its sticky cookie's value.

A configured server is named by its group and address; what leaves the proxy (a sticky cookie,
``/status``, the runtime state's keys) names it by this id instead, so a cookie does not reveal
the address, and with ``sticky.secret`` it cannot be computed from the address either. It sits
with the configuration because the runtime state (``config/runtime.py``) resolves server names
with it, below the routing policies that hash with it.
"""

from __future__ import annotations

import hashlib


def server_id(group: str, address: str, secret: str = "") -> bytes:
    """A stable, opaque id of a server: 16 lower-case hex digits (ASCII bytes).

    Used as the server's rendezvous-hashing identity and as the sticky cookie's value. It is
    ``blake2b(f"{group}\\0{address}", digest_size=8)`` keyed with ``secret`` (secrets longer
    than blake2b's 64-byte key limit are hashed to 64 bytes first), so it does not reveal
    the address, and with a secret it cannot be computed from the address either.
    """
    key = secret.encode()
    if len(key) > hashlib.blake2b.MAX_KEY_SIZE:
        key = hashlib.blake2b(key, digest_size=hashlib.blake2b.MAX_KEY_SIZE).digest()
    digest = hashlib.blake2b(f"{group}\0{address}".encode(), digest_size=8, key=key)
    return digest.hexdigest().encode("ascii")
