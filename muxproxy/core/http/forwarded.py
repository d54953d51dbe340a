"""Forwarded fields: what a request says about the hops before us, believed only from a proxy
we trust.

``X-Forwarded-For``, ``-Proto``, ``-Host``, ``-Port``, ``X-Real-IP`` (de facto fields, no RFC)
and ``Forwarded`` (RFC 7239) are claims about the hops a request took before it reached us.
Any client can write them, and a backend that believes them (for an allow-list, a per-address
limit, an audit log, a redirect to ``https``) believes the client. So, per listener
(``[[listeners]] trusted_proxies``, CIDRs), what it obeys:

- From a peer outside every trusted network (any peer, by default: no network is trusted,
  as Traefik's ``forwardedHeaders`` and Envoy's ``xff_num_trusted_hops = 0``), all six are
  dropped and the proxy says what it knows from the connection: ``X-Forwarded-For`` is the
  peer's address and ``X-Forwarded-Proto`` the transport it used (``https`` over TLS, else
  ``http``; never an HTTP/2 ``:scheme``, which is the client's word, RFC 9113 §8.3.1).
- From a trusted peer (the load balancer in front), the chain goes on: ``X-Forwarded-For``
  gets the peer's address appended (the list, its field lines joined with ", " by RFC 9110
  §5.3, then ours: each proxy appends the address it got the request from), ``Forwarded``
  gets an element ``for=<peer>;proto=<scheme>`` appended (RFC 7239 §4: a proxy appends to
  the list; §5.2 ``for``, §5.4 ``proto``; §6 an IPv6 address quoted in brackets), and
  ``X-Forwarded-Proto``, ``-Host``, ``-Port`` and ``X-Real-IP`` are kept as it set them (it
  terminated the client's connection and knows them; ``X-Forwarded-Proto`` is set from our
  connection when it sent none). The proxy adds no ``Forwarded`` the trusted peer did not
  start, nor an ``X-Real-IP`` (``set_headers`` does, with ``$remote_addr``).

Only the fields change: the access log's ``client`` stays the peer's address.

Pure functions over field lists, run once per request; ``headers.upstream_h1_headers`` hands
over the forwarded fields it found (less any the Connection field nominated, RFC 9110
§7.6.1) and places what comes back.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from muxproxy.core.messages import Headers

__all__ = ["FORWARDED_FIELDS", "append_list", "forwarded_fields", "is_trusted"]

X_FORWARDED_FOR = b"x-forwarded-for"
X_FORWARDED_PROTO = b"x-forwarded-proto"
FORWARDED = b"forwarded"
FORWARDED_FIELDS = frozenset(
    {
        X_FORWARDED_FOR,
        X_FORWARDED_PROTO,
        b"x-forwarded-host",
        b"x-forwarded-port",
        FORWARDED,
        b"x-real-ip",
    }
)
"""The fields a client's word on earlier hops travels in."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def is_trusted(peer_ip: str, networks: Sequence[Network]) -> bool:
    """Whether ``peer_ip`` (a connection's peer address as the socket gave it) is in one of
    ``networks``. An IPv4 peer on a dual-stack socket (``::ffff:10.0.0.7``) is matched as
    its IPv4 address; anything that is not an address (``unknown``) is not trusted."""
    if not networks:
        return False
    try:
        address = ipaddress.ip_address(peer_ip)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in network for network in networks)


def append_list(existing: Iterable[bytes], item: bytes) -> bytes:
    """``item`` appended to the comma-separated list field values ``existing`` (RFC 9110
    §5.3: field lines of one name combine with ", "), skipping empty ones."""
    return b", ".join([*(v for v in existing if v), item])


def forwarded_fields(found: Headers, *, peer_ip: str, proto: bytes, trusted: bool) -> Headers:
    """The forwarded fields to send upstream, for the ones a request carried (``found``, in
    order, names lower-case) from a peer at ``peer_ip`` over transport ``proto``
    (``b"http"`` or ``b"https"``); ``trusted``: the peer is a trusted proxy
    (:func:`is_trusted`). See the module header."""
    ip = peer_ip.encode("ascii")
    if not trusted:
        return [(X_FORWARDED_FOR, ip), (X_FORWARDED_PROTO, proto)]
    chain: list[bytes] = []
    elements: list[bytes] = []
    kept: Headers = []
    proto_sent = False
    for field in found:
        name = field[0]
        if name == X_FORWARDED_FOR:
            chain.append(field[1])
        elif name == FORWARDED:
            elements.append(field[1])
        else:
            proto_sent = proto_sent or name == X_FORWARDED_PROTO
            kept.append(field)
    out: Headers = [(X_FORWARDED_FOR, append_list(chain, ip))]
    if not proto_sent:
        out.append((X_FORWARDED_PROTO, proto))
    out.extend(kept)
    if elements:
        out.append((FORWARDED, append_list(elements, _element(peer_ip, proto))))
    return out


def _element(peer_ip: str, proto: bytes) -> bytes:
    """A Forwarded element for this hop: ``for=<node>;proto=<scheme>`` (RFC 7239 §4, §5.2,
    §5.4, §6: an IPv6 node is quoted in brackets; one we cannot name is ``unknown``)."""
    try:
        address = ipaddress.ip_address(peer_ip)
    except ValueError:
        node = b"unknown"
    else:
        if isinstance(address, ipaddress.IPv6Address):
            node = b'"[' + str(address).encode("ascii") + b']"'
        else:
            node = str(address).encode("ascii")
    return b"for=" + node + b";proto=" + proto
