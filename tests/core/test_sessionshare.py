"""The core's side of the shared memory of sessions (``core/exchange/sessionshare.py``), driven with
bytes only: what a core remembers leaves in one batch per ``SHARE_DELAY`` (one timer, one
command), nothing at all while sharing is off, and what it learns from elsewhere routes a
conversation to the server it was on (newest wins, expired and unknown entries ignored).
"""

from __future__ import annotations

import attrs
from test_routing_exchange import A, B, C, Rig, fleet
from test_runtime_routing import KEYED, chat, keys_owned_by, served_by, set_runtime

from muxproxy.core.commands import SessionsRemembered, SetTimer
from muxproxy.core.events import SessionsLearned
from muxproxy.core.timers import CoreTimer
from muxproxy.fleet.sessions import SHARE_DELAY, SessionEntry
from muxproxy.routing.affinity import key_hash


def batches(rig: Rig) -> list[SessionsRemembered]:
    return [c for c in rig.pb.log if isinstance(c, SessionsRemembered)]


def session_timers(rig: Rig) -> list[SetTimer]:
    return [c for c in rig.pb.log if isinstance(c, SetTimer) and c.timer[0] == CoreTimer.SESSIONS]


def sharing(rig: Rig) -> Rig:
    rig.pb.core.sessions.enable()
    return rig


def test_nothing_is_shared_unless_the_driver_asks() -> None:
    rig = Rig(fleet(A, B, sticky=KEYED))
    for n in range(5):
        served_by(rig, chat(f"k{n}"))
    assert batches(rig) == [] and session_timers(rig) == []
    assert rig.router.affinity.share is None


def test_what_is_remembered_leaves_in_one_batch_per_delay() -> None:
    rig = sharing(Rig(fleet(A, B, C, sticky=KEYED)))
    start = rig.pb.now
    served = {f"k{n}": served_by(rig, chat(f"k{n}")) for n in range(5)}
    served_by(rig, chat("k0"))  # the same key again: one entry, the latest
    (timer,) = session_timers(rig)
    assert timer.at == start + SHARE_DELAY
    assert batches(rig) == []
    rig.pb.now += SHARE_DELAY
    rig.pb.wakeup("sessions", 0)
    (batch,) = batches(rig)
    assert {entry.key: entry.address for entry in batch.entries} == {
        key_hash(key.encode()): address for key, address in served.items()
    }
    assert {entry.group for entry in batch.entries} == {"default"}
    assert rig.pb.core.sessions.shared == 5
    served_by(rig, chat("k9"))  # a new batch arms the timer again
    assert len(session_timers(rig)) == 2


def test_a_learned_entry_keeps_a_conversation_on_its_server_after_a_weight_change() -> None:
    rig = sharing(Rig(fleet(A, B, C, sticky=KEYED)))
    (key,) = keys_owned_by(rig, A, 1)
    entry = SessionEntry(group="default", key=key_hash(key.encode()), address=B, at=rig.pb.now)
    rig.pb.feed(SessionsLearned(now=rig.pb.now, entries=(entry,)))
    set_runtime(rig, **{B: {"weight": 0}})  # B drains: conversations under way stay
    assert served_by(rig, chat(key)) == B
    assert rig.pb.core.sessions.learned == 1


def test_newest_wins_and_expired_or_unknown_entries_are_ignored() -> None:
    rig = sharing(Rig(fleet(A, B, C, sticky=attrs.evolve(KEYED, session_idle=60.0))))
    (key,) = keys_owned_by(rig, A, 1)
    digest = key_hash(key.encode())
    rig.pb.now = 1000.0
    assert served_by(rig, chat(key)) == A  # remembered here at 1000
    older = SessionEntry(group="default", key=digest, address=B, at=999.0)
    expired = SessionEntry(group="default", key=key_hash(b"other"), address=B, at=900.0)
    unknown = SessionEntry(group="nope", key=digest, address=B, at=1000.5)
    rig.pb.feed(SessionsLearned(now=rig.pb.now, entries=(older, expired, unknown)))
    assert served_by(rig, chat(key)) == A
    assert rig.pb.core.sessions.ignored == 3 and rig.pb.core.sessions.learned == 0
    newer = SessionEntry(group="default", key=digest, address=C, at=rig.pb.now + 0.5)
    rig.pb.feed(SessionsLearned(now=rig.pb.now + 1, entries=(newer,)))
    rig.pb.now += 1
    assert served_by(rig, chat(key)) == C
    status = rig.pb.core.status()["sessions"]
    assert status["learned"] == 1 and status["shared"] is True
