"""The demo's script: what happens to the fleet while the traffic runs, on a timetable.

The phases, as fractions of ``--duration`` (:data:`KILL_AT`, :data:`GRAY_STEPS`):

1. **steady**: v1 (gpu0..gpu2) takes every conversation; v2 (gpu3) has weight 0.
2. **gpuN killed** at :data:`KILL_AT`: at the first moment one v1 backend has a stream
   mid-answer (the client has some of its tokens) *and* a stream that just started (its
   head is held by ``retry_until_first_event`` until the first token), that backend is
   killed, so both kinds of failure happen: the one before its first token is retried, the
   one mid-answer continued (``continue_on_failure``). Later conversations of that backend
   move (the proxy marks it down); none of them fails.
3. **gray release**: v2's weight goes up through the admin API in :data:`GRAY_STEPS`, the last
   drains v1 (weight 0): new conversations land on v2 by weight, conversations already on a
   v1 backend stay there (the proxy remembers where each session key went).

Timings are real time: this is a demo to watch. What it checks, it checks on the records of
:mod:`.board`, never on time.
"""

from __future__ import annotations

import signal

import trio

from muxproxy.demo.clients import admin_request
from muxproxy.demo.fleet import GROUP, FakeGPU
from muxproxy.demo.stage import Demo, read_status
from muxproxy.demo.traffic import run_traffic

KILL_AT = 0.28
"""When the kill phase begins (a fraction of the duration)."""
KILL_WAIT = 0.08
"""How long, at most, the kill waits for a backend with both a stream mid-answer and a stream
before its first token (then it kills the busiest one)."""
GRAY_STEPS = ((0.45, "v2", 1), (0.58, "v2", 2), (0.71, "v2", 4), (0.84, "v1", 0))
"""(when, which version, its new weight) of each gray release step: v2's share of new
conversations goes 1/3, 1/2, 2/3 (of two v1 backends left at weight 1), then all of it."""


# -- what happens to the fleet ------------------------------------------------------------


def mid_answer(demo: Demo, name: str) -> int:
    """Streams of ``name`` whose client has some tokens, and at least three to come."""
    return sum(
        t.running and t.producers[-1:] == [name] and len(t.text) <= t.tokens - 3
        for t in demo.board.turns
        if t.backend == name
    )


async def _watch_for_moment(
    demo: Demo, gpu: FakeGPU, found: trio.MemorySendChannel[FakeGPU]
) -> None:
    fake = gpu.fake
    while True:
        await fake.wait_streams_started(fake.streams_started + 1)
        if mid_answer(demo, gpu.name) > 0:
            found.send_nowait(gpu)
            return


async def choose_victim(demo: Demo) -> FakeGPU:
    """The first v1 backend seen starting a stream while another of its streams is
    mid-answer; if none is within ``KILL_WAIT``, the v1 backend with the most streams."""
    live = [g for g in demo.v1 if demo.board.backends[g.name].killed_at is None]
    send, receive = trio.open_memory_channel[FakeGPU](len(live))
    victim = None
    async with trio.open_nursery() as nursery:
        for gpu in live:
            nursery.start_soon(_watch_for_moment, demo, gpu, send)
        with trio.move_on_at(demo.at(KILL_AT + KILL_WAIT)):
            victim = await receive.receive()
        nursery.cancel_scope.cancel()
    if victim is not None:
        return victim
    turns = demo.board.turns
    return max(live, key=lambda g: sum(t.running and t.final_backend == g.name for t in turns))


async def kill_phase(demo: Demo) -> None:
    await trio.sleep_until(demo.at(KILL_AT))
    victim = await choose_victim(demo)
    board, fake = demo.board, victim.fake
    running = fake.streams_started - fake.streams_completed - fake.disconnects
    board.enter(demo.now(), f"{victim.name} killed")
    board.note(
        demo.now(),
        f"killing {victim.name}: its listener and every connection closed at once, as a"
        f" crashed GPU server's, with {running} streams running on it",
    )
    board.backends[victim.name].killed_at = demo.now()
    await victim.kill()


async def set_weight(demo: Demo, gpu: FakeGPU, weight: int) -> None:
    """``PATCH /upstreams/gpus/servers/ADDRESS {"weight": N}`` on the admin API."""
    path = f"/upstreams/{GROUP}/servers/{gpu.address}"
    status, answer = await admin_request(
        demo.proxy.admin_port, "PATCH", path, demo.token, {"weight": weight}
    )
    shown = f"{status}" if status == 200 else f"{status} {answer}"
    demo.board.note(demo.now(), f"admin: PATCH {path} weight={weight} ({gpu.name}) -> {shown}")


async def gray_release(demo: Demo) -> None:
    for at, version, weight in GRAY_STEPS:
        await trio.sleep_until(demo.at(at))
        phase = f"gray release: {version} weight {weight}"
        # A new conversation is counted in the phase in which it began; the phase begins
        # where what it shows holds: before a change that gives v2 more (until the change
        # applies, conversations still go by the old weights, which the phase allows), after
        # one that takes v1's share away (no new conversation on v1 in it).
        if version == "v2":
            demo.board.enter(demo.now(), phase)
        for gpu in demo.v1 if version == "v1" else demo.v2:
            if demo.board.backends[gpu.name].killed_at is None:
                await set_weight(demo, gpu, weight)
        if version == "v1":
            demo.board.enter(demo.now(), phase)


# -- the whole run ------------------------------------------------------------------------


async def run_script(demo: Demo) -> None:
    """The scripted run: traffic from the start to the end, the kill and the gray release
    on their timetable."""
    demo.board.enter(demo.now(), "steady")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(kill_phase, demo)
        nursery.start_soon(gray_release, demo)
        await run_traffic(demo)
        nursery.cancel_scope.cancel()  # a step past the end (--duration too short) is moot
    await read_status(demo)


async def wait_for_interrupt() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return
