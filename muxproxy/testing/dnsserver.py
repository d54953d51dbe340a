"""A real DNS server for tests and examples: dnslib on a loopback UDP and TCP port, in threads.

It needs ``dnslib`` (the ``test`` extra); nothing in the proxy imports this module.

A test sets its records (A, AAAA, SRV, each name's TTL) while it runs, makes it answer
wrongly (``mode``: REFUSED, SERVFAIL, NXDOMAIN for every name, or silence: the client times
out), and stops and starts it on the same port (stopped: the port is closed, so a UDP query
gets ICMP port unreachable). Names are kept lower case with the final dot.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import attrs
from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A, DNSLabel, DNSRecord
from dnslib.server import BaseResolver, DNSError, DNSLogger, DNSServer

ANSWER, REFUSE, SERVFAIL, NXDOMAIN, SILENT = "answer", "refuse", "servfail", "nxdomain", "silent"


@attrs.define
class Zone:
    a: dict[str, list[str]] = attrs.Factory(dict)
    aaaa: dict[str, list[str]] = attrs.Factory(dict)
    srv: dict[str, list[tuple[int, int, int, str]]] = attrs.Factory(dict)
    ttl: dict[str, int] = attrs.Factory(dict)
    mode: str = ANSWER
    queries: int = 0


def _name(name: str) -> str:
    return name.lower().rstrip(".") + "."


class _Quiet(DNSLogger):  # type: ignore[misc]  # dnslib has no type hints
    def __init__(self) -> None:
        super().__init__(log="-request,-reply,-truncated,-error,-recv,-send,-data")


class _Resolver(BaseResolver):  # type: ignore[misc]  # dnslib has no type hints
    def __init__(self, server: DnsServer) -> None:
        self.server = server

    def resolve(self, request: DNSRecord, handler: object) -> DNSRecord:
        zone = self.server.zone
        with self.server.lock:
            zone.queries += 1
            mode = zone.mode
            reply = request.reply()
            if mode == SILENT:
                raise DNSError("silent: no answer")
            if mode in (REFUSE, SERVFAIL, NXDOMAIN):
                code = {REFUSE: RCODE.REFUSED, SERVFAIL: RCODE.SERVFAIL, NXDOMAIN: RCODE.NXDOMAIN}
                reply.header.rcode = code[mode]
                return reply
            name = _name(str(request.q.qname))
            kind = QTYPE[request.q.qtype]
            ttl = zone.ttl.get(name, 30)
            known = name in zone.a or name in zone.aaaa or name in zone.srv
            if not known:
                reply.header.rcode = RCODE.NXDOMAIN
                return reply
            label = DNSLabel(name)
            if kind == "A":
                for address in zone.a.get(name, []):
                    reply.add_answer(RR(label, QTYPE.A, rdata=A(address), ttl=ttl))
            elif kind == "AAAA":
                for address in zone.aaaa.get(name, []):
                    reply.add_answer(RR(label, QTYPE.AAAA, rdata=AAAA(address), ttl=ttl))
            elif kind == "SRV":
                for priority, weight, port, target in zone.srv.get(name, []):
                    rdata = SRV(priority=priority, weight=weight, port=port, target=target)
                    reply.add_answer(RR(label, QTYPE.SRV, rdata=rdata, ttl=ttl))
            return reply


class DnsServer:
    """The server; :func:`dns_server` runs one for a test."""

    def __init__(self) -> None:
        self.zone = Zone()
        self.lock = threading.Lock()
        self.port = 0
        self._servers: list[DNSServer] = []

    @property
    def nameserver(self) -> str:
        """``[resolver] nameservers``'s entry for it."""
        return f"127.0.0.1:{self.port}"

    def set_a(self, name: str, addresses: Sequence[str], ttl: int | None = None) -> None:
        with self.lock:
            self.zone.a[_name(name)] = list(addresses)
            if ttl is not None:
                self.zone.ttl[_name(name)] = ttl

    def set_aaaa(self, name: str, addresses: Sequence[str]) -> None:
        with self.lock:
            self.zone.aaaa[_name(name)] = list(addresses)

    def set_srv(
        self, name: str, records: Sequence[tuple[int, int, int, str]], ttl: int | None = None
    ) -> None:
        """``records``: (priority, weight, port, target) each."""
        with self.lock:
            self.zone.srv[_name(name)] = [(p, w, port, _name(t)) for p, w, port, t in records]
            if ttl is not None:
                self.zone.ttl[_name(name)] = ttl

    def set_mode(self, mode: str) -> None:
        with self.lock:
            self.zone.mode = mode

    @property
    def queries(self) -> int:
        with self.lock:
            return self.zone.queries

    def start(self) -> None:
        """Listen (on the port it had, when started before) on UDP and TCP."""
        resolver = _Resolver(self)
        for attempt in range(20):
            port = self.port or _free_port()
            try:
                udp = DNSServer(resolver, address="127.0.0.1", port=port, logger=_Quiet())
                try:
                    tcp = DNSServer(
                        resolver, address="127.0.0.1", port=port, tcp=True, logger=_Quiet()
                    )
                except OSError:
                    udp.server.server_close()
                    raise
            except OSError:
                if self.port or attempt == 19:
                    raise
                continue
            self.port = port
            self._servers = [udp, tcp]
            for server in self._servers:
                server.start_thread()
            return

    def stop(self) -> None:
        """Close the port: queries are refused by the kernel until :meth:`start`."""
        for server in self._servers:
            server.server.shutdown()
            server.server.server_close()
        self._servers = []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def dns_server() -> Iterator[DnsServer]:
    server = DnsServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
