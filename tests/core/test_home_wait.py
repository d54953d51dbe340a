"""A keyed request waits a little for its home server before taking another
(``core/exchange/placement.py`` and ``admit.py``: ``queue.affinity_wait``), and a body longer
than ``sticky.body_limit`` keeps its prefix key (``routing/partialbody.py``). Conversations
with the core (``tests/core/README.md``)."""

from __future__ import annotations

import json

from playbook import data, wakeup
from test_llm_routing import SYSTEM, Llm, chat, limited, owned
from test_routing_exchange import CHAT, A, B, fleet

from muxproxy.config import AdmissionQueue, AffinityMode, PrefixAffinity
from muxproxy.core.commands import CancelTimer, SetTimer
from muxproxy.core.ports import Phase

WAIT = 0.1
JSON = ("Content-Type", "application/json")


def home_rig(limit: int = 1) -> Llm:
    return Llm(
        limited(
            A,
            B,
            limit=limit,
            affinity=AffinityMode.PREFIX,
            prefix=PrefixAffinity(load_factor=4.0),
            queue=AdmissionQueue(affinity_wait=WAIT),
        )
    )


def waits_for_home(rig: Llm, body: bytes) -> int:
    """A JSON POST whose home is full while another server has room: it waits in the queue,
    its ``queue`` timer set for the end of its wait for home (not its deadline)."""
    pb = rig.pb
    conn, client = rig.connect()
    pb >> data(conn, client.request("POST", CHAT, [JSON], body))
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("body", conn), at=pb.now + rig.body_gap_s)
    pb << SetTimer(timer=("queue", conn), at=pb.now + WAIT)
    pb.done()
    return conn


def queued(rig: Llm) -> list[bytes]:
    exchanges = rig.pb.core.exchanges.values()
    return [e.upload.body.prefix() for e in exchanges if e.phase is Phase.QUEUED]


def test_a_request_whose_home_is_full_waits_for_it_and_goes_there_when_it_frees() -> None:
    rig = home_rig()
    up_a, _ = rig.posted(owned(rig, A, "first"), to=A)  # A is full, B has room
    mine = waits_for_home(rig, owned(rig, A, "mine"))
    assert rig.queue_len() == 1
    rig.pb.now += WAIT / 2
    rig.finish(up_a, admits=mine, to=A)  # A frees within the wait: home it goes
    assert rig.queue_len() == 0


def test_a_request_whose_home_stays_full_takes_another_server_after_the_wait() -> None:
    rig = home_rig()
    rig.posted(owned(rig, A, "first"), to=A)
    mine = waits_for_home(rig, owned(rig, A, "mine"))
    pb = rig.pb
    pb.now += WAIT
    pb >> wakeup("queue", mine)  # the wait for home ends; the deadline's timer stays
    pb << SetTimer(timer=("queue", mine), at=pb.now - WAIT + rig.group.queue.timeout)
    pb << CancelTimer(timer=("queue", mine))  # admitted: B has room
    rig.attempt(mine, to=B)
    pb.done()
    assert rig.queue_len() == 0


def test_a_slot_elsewhere_is_not_handed_to_a_request_waiting_for_its_home() -> None:
    rig = home_rig(limit=2)
    for text in ("one", "two"):
        rig.posted(owned(rig, A, text), to=A)  # A full
    up_b, _ = rig.posted(owned(rig, B, "three"), to=B)  # B has one slot left
    waits_for_home(rig, owned(rig, A, "mine"))
    rig.finish(up_b)  # a slot on B frees: not for a request that waits for A
    assert queued(rig) and b"mine" in queued(rig)[0]


def test_without_a_wait_for_home_a_full_home_spills_at_once() -> None:
    rig = Llm(
        limited(
            A,
            B,
            affinity=AffinityMode.PREFIX,
            prefix=PrefixAffinity(load_factor=4.0),
            queue=AdmissionQueue(affinity_wait=0),
        )
    )
    rig.posted(owned(rig, A, "first"), to=A)
    rig.posted(owned(rig, A, "mine"), to=B)


def conversation(first: str, turns: int) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]
    for turn in range(turns):
        messages.append({"role": "assistant", "content": f"answer {turn} " + "words " * 300})
        messages.append({"role": "user", "content": f"question {turn}"})
    return json.dumps({"model": "m", "messages": messages, "stream": True}).encode()


def test_a_200_kib_conversation_goes_where_its_first_turn_went() -> None:
    rig = Llm(fleet(A, B, affinity=AffinityMode.PREFIX, prefix=PrefixAffinity(load_factor=8.0)))
    pb = rig.pb
    homes = {rig.posted(chat(f"question {n}", system=SYSTEM))[1] for n in range(8)}
    assert homes == {A, B}  # single questions spread by their question
    _, home = rig.posted(conversation("Tell me about Rome", 0))
    body = conversation("Tell me about Rome", 110)
    assert len(body) > 200 * 1024 > 3 * rig.group.sticky.body_limit
    conn, client = rig.connect()
    request = client.request("POST", CHAT, [JSON], body)
    pb >> data(conn, request[: len(request) - len(body) + rig.group.sticky.body_limit + 10])
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("body", conn), at=pb.now + rig.body_gap_s)
    rig.attempt(conn, to=home)  # routed from its first 64 KiB, to its first turn's server
    pb.done()


def test_a_request_whose_deadline_is_shorter_than_the_wait_spills_at_once() -> None:
    rig = Llm(
        limited(
            A,
            B,
            affinity=AffinityMode.PREFIX,
            prefix=PrefixAffinity(load_factor=4.0),
            queue=AdmissionQueue(affinity_wait=WAIT, timeout=WAIT / 2),
        )
    )
    rig.posted(owned(rig, A, "first"), to=A)
    rig.posted(owned(rig, A, "mine"), to=B)
