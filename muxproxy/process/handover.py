"""Listening sockets the supervisor binds and hands to its workers, and the worker's payload.

The supervisor of ``serve --workers N`` (:mod:`muxproxy.process.workers`) binds every listening
socket itself, so that sockets outlive any one worker: a connection waiting in an accept queue is
never lost when the worker that would have accepted it stops, because the socket (and its
queue) is still open in the supervisor and in the worker that takes the slot over.

Per listener address, one socket per worker *slot* (and per address ``getaddrinfo`` gives for
the host), all in one ``SO_REUSEPORT`` group: the kernel spreads new connections over the
slots by a hash of the 4-tuple, as when each worker bound its own, and a connection wakes one
process, not all N. A worker listens on its slot's sockets; a rolling restart runs the old and
the new worker on the same slot's sockets for a moment, both accepting from one queue.

Why per slot rather than one socket shared by every worker: with a shared socket every worker
is woken for every connection (Trio's epoll has no ``EPOLLEXCLUSIVE``) and whichever loop gets
there first takes the connection, up to a whole accept batch; how the load spreads then depends
on which loop wakes first, which on Linux tends to pile connections on a few workers
(Cloudflare, "Why does one NGINX worker take all the load?", 2017), while the kernel's 4-tuple
hash does not depend on it, and the figures in ``docs/performance.md`` were measured with it.
Measured here with 2 workers and 200 streams held open, the two spread alike (per slot 90/110,
shared 85/115). The cost of per-slot sockets: connections the kernel hashes to a worker that
*died* wait in its slot's queue until the replacement listens (984 and 1,032 ms measured on a
busy 2-core machine), where a shared socket would have had another worker take them at once.
They wait; none is lost. A graceful stop or a rolling restart has no such gap: the old worker
leaves only once the new one on its slot listens.

The options are those of :func:`muxproxy.trio.listeners.open_listeners` (``SO_REUSEADDR``,
``IPV6_V6ONLY`` on IPv6, the same backlog). Port 0 is bound once, by slot 0, and the other
slots bind the port the kernel chose.

The payload a worker reads on stdin is a pickle of :class:`WorkerPayload`: the configuration,
the worker's slot, the number of its control-channel descriptor and, per listener address,
the descriptor numbers of its slot's listening sockets (``pass_fds`` keeps the numbers).
"""

from __future__ import annotations

import contextlib
import errno
import pickle
import socket
from collections.abc import Iterable, Mapping

import attrs

from muxproxy.config import Config, Listener
from muxproxy.trio.listeners import BACKLOG

SlotSockets = list[list[socket.socket]]
"""Per slot, the sockets of one listener address (one per resolved address)."""


@attrs.frozen(kw_only=True)
class WorkerPayload:
    """What a worker reads on stdin (pickled)."""

    config: Config
    slot: int
    control: int
    """Descriptor of the worker's end of its control channel."""
    listeners: dict[str, list[int]]
    """Listener address as configured -> descriptors of this slot's listening sockets."""
    runtime: dict[str, object] | None = None
    """The runtime state (``RuntimeState.to_json()``) to apply before serving, if any."""
    sessions: list[list[object]] | None = None
    """The host's memory of sessions (``entries_to_wire``), learned before serving, so a
    worker started later routes the conversations under way as the others do. Read with
    ``getattr``: a payload pickled by an older supervisor lacks it."""

    def dumps(self) -> bytes:
        return pickle.dumps(self)

    @staticmethod
    def loads(data: bytes) -> WorkerPayload:
        payload = pickle.loads(data)
        if not isinstance(payload, WorkerPayload):
            raise TypeError(f"a worker's payload is a WorkerPayload, not {type(payload)}")
        return payload


def bind_listener(listener: Listener, slots: int) -> SlotSockets:
    """Listening sockets for ``listener``, one set per slot. Raises ``OSError`` (closing
    whatever it had bound) when an address cannot be bound or no family is supported."""
    infos = socket.getaddrinfo(
        listener.host, listener.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    bound: SlotSockets = []
    try:
        for slot in range(slots):
            sockets: list[socket.socket] = []
            bound.append(sockets)
            for index, (family, type_, proto, _, sockaddr) in enumerate(infos):
                if slot and len(bound[0]) <= index:
                    continue  # a family slot 0 could not use
                if slot:
                    # The port slot 0 got, for a configured port 0.
                    sockaddr = (sockaddr[0], bound[0][index].getsockname()[1], *sockaddr[2:])
                try:
                    sock = socket.socket(family, type_, proto)
                except OSError as exc:
                    if exc.errno == errno.EAFNOSUPPORT and slot == 0:
                        continue
                    raise
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    sock.bind(sockaddr)
                except OSError as exc:
                    raise OSError(
                        exc.errno, f"cannot listen on {listener.address}: {exc.strerror}"
                    ) from exc
                sock.listen(BACKLOG)
            if not sockets:
                raise OSError(
                    errno.EAFNOSUPPORT,
                    f"none of the address families of {listener.host!r} is supported",
                )
    except BaseException:
        close_all(sock for sockets in bound for sock in sockets)
        raise
    return bound


def bind_listeners(listeners: Iterable[Listener], slots: int) -> dict[str, SlotSockets]:
    """:func:`bind_listener` for each of ``listeners``; all or nothing."""
    done: dict[str, SlotSockets] = {}
    try:
        for listener in listeners:
            done[listener.address] = bind_listener(listener, slots)
    except BaseException:
        close_listeners(done)
        raise
    return done


def slot_fds(listeners: Mapping[str, SlotSockets], slot: int) -> dict[str, list[int]]:
    """Descriptor numbers of ``slot``'s sockets, per listener address."""
    return {address: [s.fileno() for s in slots[slot]] for address, slots in listeners.items()}


def close_all(sockets: Iterable[socket.socket]) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.close()


def close_listeners(listeners: Mapping[str, SlotSockets]) -> None:
    close_all(sock for slots in listeners.values() for sockets in slots for sock in sockets)
