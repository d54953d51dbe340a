"""The core's side of the shared memory of sessions (``core/exchange/sessionshare.py``), as
conversations: what a core remembers leaves in one batch per ``SHARE_DELAY`` (one timer, one
command), nothing at all while sharing is off, and what it learns from elsewhere routes a
conversation to the server it was on (newest wins, expired and unknown entries ignored).

Requests come from real h11 client peers and are answered by real h11 backends
(``Routing`` of ``test_routing_exchange``); every command is asserted, timers included.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
from playbook import Where, data, wakeup
from test_routing_exchange import CHAT, A, B, C, Routing, fleet
from test_runtime_routing import KEYED, chat, keys_owned_by, set_runtime

from muxproxy.core.commands import CancelTimer, SessionsRemembered, SetTimer
from muxproxy.core.events import SessionsLearned
from muxproxy.fleet.sessions import SHARE_DELAY, SessionEntry
from muxproxy.routing.affinity import key_hash


def sharing(rig: Routing) -> Routing:
    rig.pb.core.sessions.enable()
    return rig


def served_by(
    rig: Routing,
    key: str,
    *,
    to: str | None = None,
    avoid: Iterable[str] = (),
    arms: bool = False,
) -> str:
    """A request of conversation ``key`` (to ``to``, not to one of ``avoid``) answered 200;
    ``arms``: the session it remembers starts a batch, whose timer is set as it is routed.
    Returns its server."""
    pb = rig.pb
    conn, client = rig.connect()
    pb >> data(conn, client.request("GET", CHAT, chat(key)))
    pb << CancelTimer(timer=("header", conn))
    if arms:
        pb << SetTimer(timer=("sessions", 0), at=pb.now + SHARE_DELAY)
    opens = rig.attempt(conn, to=to, avoid=avoid)
    rig.serve(conn, client, opens)
    return opens.server


def learned(rig: Routing, *entries: SessionEntry, now: float | None = None) -> None:
    """Entries from elsewhere come in: nothing comes out."""
    rig.pb >> SessionsLearned(now=rig.pb.now if now is None else now, entries=entries)
    rig.pb.done()


def test_nothing_is_shared_unless_the_driver_asks() -> None:
    rig = Routing(fleet(A, B, sticky=KEYED))
    for n in range(5):
        served_by(rig, f"k{n}")  # no session timer, no batch
    assert rig.router.affinity.share is None


def test_what_is_remembered_leaves_in_one_batch_per_delay() -> None:
    rig = sharing(Routing(fleet(A, B, C, sticky=KEYED)))
    pb = rig.pb
    served = {f"k{n}": served_by(rig, f"k{n}", arms=n == 0) for n in range(5)}
    served_by(rig, "k0", to=served["k0"])  # the same key again: one entry, the latest
    pb.now += SHARE_DELAY
    pb >> wakeup("sessions", 0)

    def one_batch(batch: SessionsRemembered) -> None:
        assert {entry.key: entry.address for entry in batch.entries} == {
            key_hash(key.encode()): address for key, address in served.items()
        }
        assert {entry.group for entry in batch.entries} == {"default"}

    pb << Where(SessionsRemembered, one_batch)
    pb.done()
    assert rig.pb.core.sessions.shared == 5
    served_by(rig, "k9", arms=True)  # a new batch arms the timer again


def test_a_learned_entry_keeps_a_conversation_on_its_server_after_a_weight_change() -> None:
    rig = sharing(Routing(fleet(A, B, C, sticky=KEYED)))
    (key,) = keys_owned_by(rig, A, 1)
    learned(rig, SessionEntry(group="default", key=key_hash(key.encode()), address=B, at=0.0))
    set_runtime(rig, **{B: {"weight": 0}})  # B drains: conversations under way stay
    served_by(rig, key, to=B, arms=True)
    assert rig.pb.core.sessions.learned == 1


def test_newest_wins_and_expired_or_unknown_entries_are_ignored() -> None:
    rig = sharing(Routing(fleet(A, B, C, sticky=attrs.evolve(KEYED, session_idle=60.0))))
    (key,) = keys_owned_by(rig, A, 1)
    digest = key_hash(key.encode())
    rig.pb.now = 1000.0
    served_by(rig, key, to=A, arms=True)  # remembered here at 1000
    older = SessionEntry(group="default", key=digest, address=B, at=999.0)
    expired = SessionEntry(group="default", key=key_hash(b"other"), address=B, at=900.0)
    unknown = SessionEntry(group="nope", key=digest, address=B, at=1000.5)
    learned(rig, older, expired, unknown)
    served_by(rig, key, to=A)
    assert rig.pb.core.sessions.ignored == 3 and rig.pb.core.sessions.learned == 0
    newer = SessionEntry(group="default", key=digest, address=C, at=rig.pb.now + 0.5)
    learned(rig, newer, now=rig.pb.now + 1)
    rig.pb.now += 1
    served_by(rig, key, to=C)
    status = rig.pb.core.status()["sessions"]
    assert status["learned"] == 1 and status["shared"] is True
