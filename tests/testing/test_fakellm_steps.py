"""Tests of the fake LLM backend's step model: the pure step planner (steps.py), the loop of
steps (batch.py) and the engine with it (scheduler.py) under MockClock, and the step model
served over real sockets on 127.0.0.1 (app.py).

Every IO test runs under fail_after; waits are on events and the fake's own counters.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import httpx
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fakellm import ready_line

from muxproxy.process.cli import main as muxproxy_main
from muxproxy.testing.fakellm import FakeLLM, add_arguments, reply_text
from muxproxy.testing.fakellm.batch import Batch
from muxproxy.testing.fakellm.engine import EngineConfig
from muxproxy.testing.fakellm.scheduler import Engine
from muxproxy.testing.fakellm.steps import plan_step, step_seconds

if TYPE_CHECKING:
    from conftest import StartBackend

CHAT = "/v1/chat/completions"

# ---- the step planner ------------------------------------------------------------------


def test_a_step_decodes_every_prefilled_one_and_fills_the_chunk_in_arrival_order() -> None:
    plan = plan_step([0, 500, 300, 0, 7], 512)
    assert plan.prefill == (0, 500, 12, 0, 0)
    assert plan.emits == (True, True, False, True, False)
    assert plan.prefill_tokens == 512


def test_a_prompt_longer_than_the_chunk_takes_the_whole_chunk_and_emits_nothing() -> None:
    plan = plan_step([1000, 3], 256)
    assert (plan.prefill, plan.emits) == ((256, 0), (False, False))


def test_step_seconds_are_the_decode_plus_the_prefill_tokens() -> None:
    assert step_seconds(0, decode=0.02, per_token=0.001) == 0.02
    assert step_seconds(500, decode=0.02, per_token=0.001) == pytest.approx(0.52)


@given(left=st.lists(st.integers(0, 2000), max_size=12), chunk=st.integers(1, 1024))
def test_a_step_never_prefills_more_than_the_chunk_and_serves_first_come_first(
    left: list[int], chunk: int
) -> None:
    plan = plan_step(left, chunk)
    assert len(plan.prefill) == len(plan.emits) == len(left)
    assert plan.prefill_tokens <= chunk
    # Greedy: the budget is used up unless every prompt is done.
    assert plan.prefill_tokens == min(chunk, sum(left))
    for i, (need, got, emits) in enumerate(zip(left, plan.prefill, plan.emits, strict=True)):
        assert 0 <= got <= need
        assert emits == (got == need)  # decoding (need 0) or done prefilling in this step
        if got < need:  # cut short: nobody after it gets any prefill this step
            assert all(later == 0 for later in plan.prefill[i + 1 :])


@settings(deadline=None)  # up to 2,000 steps: no deadline on a loaded machine
@given(left=st.lists(st.integers(0, 200), min_size=1, max_size=10), chunk=st.integers(1, 256))
def test_stepping_to_the_end_conserves_prefill_and_every_step_progresses(
    left: list[int], chunk: int
) -> None:
    remaining = list(left)
    prefilled = [0] * len(left)
    first_token_step: list[int | None] = [None] * len(left)
    step = 0
    while any(remaining) or None in first_token_step:
        plan = plan_step(remaining, chunk)
        # The first one still prefilling gets some of the chunk; all prefilled ones decode.
        assert plan.prefill_tokens > 0 or all(plan.emits)
        for i, (got, emits) in enumerate(zip(plan.prefill, plan.emits, strict=True)):
            remaining[i] -= got
            prefilled[i] += got
            if emits and first_token_step[i] is None:
                first_token_step[i] = step
            assert remaining[i] > 0 or emits  # once prefilled, a token every step
        step += 1
    assert prefilled == left
    assert step == max(1, math.ceil(sum(left) / chunk))
    # First come first served: prompts to prefill finish in arrival order.
    steps = [s for s, need in zip(first_token_step, left, strict=True) if need]
    assert steps == sorted(steps)


# ---- the loop of steps, under MockClock ------------------------------------------------


def no_op() -> None:
    pass


async def test_a_cold_prompt_joining_stretches_every_step_it_prefills_in(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batch = Batch(chunk=100, decode_seconds=1.0, prefill_per_token=0.01, on_change=no_op)
    t0 = trio.current_time()
    warm_times: list[float] = []
    cold_times: list[float] = []
    two_out = trio.Event()

    async def warm() -> None:
        async with batch.joined(0, 10) as generation:
            for i in range(1, 11):
                await generation.wait_generated(i)
                warm_times.append(trio.current_time() - t0)
                if i == 2:
                    two_out.set()

    async def cold() -> None:
        await two_out.wait()  # joins during step 3: first in step 4
        async with batch.joined(250, 2) as generation:
            for i in (1, 2):
                await generation.wait_generated(i)
                cold_times.append(trio.current_time() - t0)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(warm)
            nursery.start_soon(cold)
    # Steps 4-6 prefill 100, 100 and 50 tokens: 2, 2 and 1.5 s instead of 1.
    assert warm_times == pytest.approx([1, 2, 3, 5, 7, 8.5, 9.5, 10.5, 11.5, 12.5])
    assert cold_times == pytest.approx([8.5, 9.5])  # the first with the step its prefill ends
    assert batch.size == 0


async def test_a_generation_leaves_at_once_and_an_idle_loop_stops_and_restarts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    changes: list[int] = []
    batch = Batch(chunk=8, decode_seconds=1.0, prefill_per_token=0.0, on_change=no_op)
    batch.on_change = lambda: changes.append(batch.size)
    with trio.fail_after(60):
        with trio.move_on_after(0.5):
            async with batch.joined(0, 1000) as generation:
                await generation.wait_generated(1000)
        assert (batch.size, changes) == (0, [0])  # left in the middle of step 1
        await trio.sleep(10)
        assert batch.steps == 1  # step 1 ended with nobody left: no more steps
        start = trio.current_time()
        async with batch.joined(4, 0) as generation:
            await generation.wait_generated(0)  # no tokens: waits for its prefill
            assert trio.current_time() - start == pytest.approx(1.0)
            assert generation.generated == 1
    assert batch.steps == 2


async def test_a_finished_generation_is_owed_no_steps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batch = Batch(chunk=8, decode_seconds=1.0, prefill_per_token=0.0, on_change=no_op)
    with trio.fail_after(60):
        async with batch.joined(0, 2) as generation:
            await generation.wait_generated(2)
            await trio.sleep(5)  # its writer is slow: the engine does not step for it
            assert (batch.steps, generation.generated, generation.has_work) == (2, 2, False)


async def test_the_engine_waits_the_base_then_prefills_only_what_is_not_cached(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = EngineConfig(
        max_running=1,
        kv_blocks=64,
        block_tokens=4,
        ttft_base=0.5,
        prefill_per_token=0.01,
        prefill_chunk=100,
        decode_seconds=0.1,
    )
    engine = Engine(config, "m", no_op)
    text = "x" * 400  # 100 tokens, 25 blocks of 4
    first_tokens: list[float] = []
    with trio.fail_after(60):
        for _ in range(2):
            start = trio.current_time()
            async with engine.batched_generation(text, tokens=2, first_delay=0.25) as generation:
                assert engine.cache is not None and engine.cache.pinned_blocks == 25
                await generation.wait_generated(1)
                first_tokens.append(trio.current_time() - start)
                await generation.wait_generated(2)
    # Cold: 0.5 + 0.25 before its first step, which prefills all 100 tokens (1 s) and
    # decodes (0.1 s). Warm: 24 blocks hit, the last one's 4 tokens are computed again.
    assert first_tokens == pytest.approx([0.75 + 1.1, 0.75 + 0.14])
    assert (engine.running, engine.cache.pinned_blocks) == (0, 0)


async def test_batched_generation_needs_the_step_model() -> None:
    engine = Engine(EngineConfig(max_running=1), "m", no_op)
    assert engine.batch is None
    with pytest.raises(RuntimeError, match="prefill_chunk"):
        async with engine.batched_generation("hi", tokens=1):
            pass
    assert engine.running == 0


def test_the_chunk_turns_the_engine_and_the_step_model_on() -> None:
    assert EngineConfig(prefill_chunk=1).enabled
    assert EngineConfig(prefill_chunk=1).stepped
    assert not EngineConfig(max_running=1).stepped
    assert not EngineConfig(decode_seconds=0.5).enabled
    with pytest.raises(ValueError, match="prefill_chunk"):
        EngineConfig(prefill_chunk=0)
    batch = FakeLLM(prefill_chunk=64, delay=0.03, prefill_per_token=0.001).engine.batch
    assert batch is not None
    assert (batch.chunk, batch.decode_seconds, batch.prefill_per_token) == (64, 0.03, 0.001)
    assert FakeLLM(max_running=2).engine.batch is None


# ---- served: the step model behind real sockets ----------------------------------------


def chat(system: str, user: str = "hi", stream: bool = True) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return json.dumps({"model": "m", "messages": messages, "stream": stream}).encode()


def content_text(raw: bytes) -> str:
    text = ""
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: {"):
            choices = json.loads(block[len("data: ") :])["choices"]
            text += "".join(c["delta"].get("content", "") for c in choices)
    return text


@attrs.define
class Tokens:
    """When each content chunk of one stream arrived (client clock), filled in as it goes."""

    times: list[float] = attrs.field(factory=list)
    sent_at: float = 0.0
    raw: bytes = b""
    done: trio.Event = attrs.field(factory=trio.Event)
    _more: trio.Event = attrs.field(factory=trio.Event)

    async def wait_count(self, n: int) -> None:
        while len(self.times) < n:
            await self._more.wait()

    def gaps_ending_in(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive tokens, for each token that arrived in (start, end]."""
        pairs = zip(self.times, self.times[1:], strict=False)
        return [b - a for a, b in pairs if start < b <= end]

    async def read(
        self, client: httpx.AsyncClient, body: bytes, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        self.sent_at = trio.current_time()
        async with client.stream("POST", CHAT, content=body, headers=list(headers)) as response:
            assert response.status_code == 200
            async for data in response.aiter_bytes():
                now = trio.current_time()
                for _ in range(data.count(b'"content":"tok')):
                    self.times.append(now)
                self.raw += data
                self._more.set()
                self._more = trio.Event()
        self.done.set()


# Large costs, so that the stall stands far above a loaded machine's jitter: a step with a
# full chunk of prefill lasts 0.05 + 0.002 * 256 = 0.56 s, one without it 0.05 s.
DELAY, PER_TOKEN, CHUNK = 0.05, 0.002, 256
STALL = PER_TOKEN * CHUNK
SYSTEM_A = "Alpha " * 400  # 2400 bytes: with the roles, 605 tokens, over two chunks
SYSTEM_B = "Bravo " * 400  # as long, cold: it differs from its first block on


async def gaps_while_a_second_prompt_prefills(
    start_backend: StartBackend, second: bytes
) -> tuple[list[float], list[float], float]:
    """A stream of SYSTEM_A runs warm, then ``second`` arrives: (the running stream's gaps
    before it arrived, its gaps until just after the second's first token, the second's TTFT)."""
    fake, port = await start_backend(
        kv_blocks=2000, prefill_per_token=PER_TOKEN, prefill_chunk=CHUNK, delay=DELAY
    )
    running, arriving = Tokens(), Tokens()
    with trio.fail_after(30):
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
            trio.open_nursery() as nursery,
        ):
            many = [("x-fake-tokens", "100000")]
            nursery.start_soon(running.read, client, chat(SYSTEM_A), many)
            await running.wait_count(6)  # its own prefill is over: 5 gaps of decode alone
            nursery.start_soon(arriving.read, client, second, [("x-fake-tokens", "1")])
            await arriving.done.wait()
            await running.wait_count(len(running.times) + 2)
            nursery.cancel_scope.cancel()
    await fake.wait_until(lambda: fake.running == 0)
    [first_token] = arriving.times
    before = running.gaps_ending_in(running.times[0], arriving.sent_at)
    during = running.gaps_ending_in(arriving.sent_at, first_token + DELAY / 2)
    return before, during, first_token - arriving.sent_at


async def test_a_cold_prompt_arriving_stalls_the_running_streams_tokens(
    start_backend: StartBackend,
) -> None:
    before, during, ttft = await gaps_while_a_second_prompt_prefills(start_backend, chat(SYSTEM_B))
    assert statistics.median(before) < DELAY + STALL / 2
    # Each step with a full chunk of the cold prompt's prefill delays the running stream's
    # next token by its cost (a tenth of it as margin for the client's clock).
    assert max(during) >= DELAY + 0.9 * STALL
    assert ttft >= 600 * PER_TOKEN


async def test_the_same_prompt_warm_does_not_stall_the_running_stream(
    start_backend: StartBackend,
) -> None:
    before, during, ttft = await gaps_while_a_second_prompt_prefills(start_backend, chat(SYSTEM_A))
    assert statistics.median(before) < DELAY + STALL / 2
    assert during  # the step that brought the second one's first token brought one here too
    # Its prefill is the last block's 13 tokens, 26 ms: no step near a chunk's cost.
    assert max(during) < DELAY + STALL / 2
    assert ttft < STALL


async def test_step_model_slots_disconnects_free_the_slot_and_leave_the_batch(
    start_backend: StartBackend,
) -> None:
    fake, port = await start_backend(
        max_running=1, kv_blocks=64, prefill_chunk=64, prefill_per_token=0.0001, delay=0.01
    )
    assert fake.engine.batch is not None and fake.engine.cache is not None
    batch, cache = fake.engine.batch, fake.engine.cache
    holder, waiter = Tokens(), Tokens()
    with trio.fail_after(20):
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
            trio.open_nursery() as nursery,
        ):
            leave = trio.CancelScope()

            async def hold() -> None:
                with leave:
                    await holder.read(client, chat("hold " * 40), [("x-fake-tokens", "100000")])

            nursery.start_soon(hold)
            await holder.wait_count(1)
            held_blocks = cache.pinned_blocks
            nursery.start_soon(waiter.read, client, chat("wait " * 40), [("x-fake-tokens", "3")])
            await fake.wait_until(lambda: fake.waiting == 1)
            assert (fake.running, batch.size) == (1, 1)
            leave.cancel()  # httpx closes the connection
            await fake.wait_disconnect()
            await waiter.done.wait()
    assert held_blocks > 0
    assert not holder.done.is_set() and len(waiter.times) == 3
    assert content_text(waiter.raw) == reply_text(3)
    assert (fake.running, fake.waiting, fake.disconnects) == (0, 0, 1)
    assert (batch.size, cache.pinned_blocks, fake.streams_completed) == (0, 0, 1)


async def test_step_model_answers_whole_completions_and_empty_streams(
    start_backend: StartBackend,
) -> None:
    fake, port = await start_backend(prefill_chunk=8, delay=0.0, tokens=3)
    with trio.fail_after(10):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            whole = await client.post(CHAT, content=chat("short", stream=False))
            empty = await client.post(CHAT, content=chat("short"), headers={"x-fake-tokens": "0"})
    assert content_text(empty.content) == ""
    assert whole.json()["choices"][0]["message"]["content"] == reply_text(3)
    assert empty.text.endswith("data: [DONE]\n\n") and '"finish_reason":"stop"' in empty.text
    assert fake.engine.batch is not None and fake.engine.batch.size == 0
    # "system: short\nuser: hi\n" is 6 tokens, prefilled in one step of 8 with the first
    # token: 3 steps for the whole reply, 1 for the empty stream's prefill.
    assert fake.engine.batch.steps == 4


# ---- the command line ------------------------------------------------------------------


def test_prefill_chunk_parses_and_defaults_to_off() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).prefill_chunk is None
    assert parser.parse_args(["--prefill-chunk", "512"]).prefill_chunk == 512
    for bad in ("0", "-3", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--prefill-chunk", bad])


def test_fakellm_help_lists_prefill_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    assert muxproxy_main(["fakellm", "--help"]) == 0
    assert "--prefill-chunk N" in capsys.readouterr().out


async def test_cli_prefill_chunk_paces_tokens_by_the_engine_not_the_request() -> None:
    # With the step model the engine's --delay (0) paces every stream: a request's
    # x-fake-delay of 30 s would otherwise hold its second token for 30 s.
    options = ["--prefill-chunk", "16", "--delay", "0", "--tokens", "2"]
    async with trio.open_nursery() as nursery:
        process, line = await ready_line(nursery, *options)
        try:
            match = re.search(rb"listening on 127\.0\.0\.1:(\d+)", line)
            assert match, line
            with trio.fail_after(10):
                url = f"http://127.0.0.1:{int(match[1])}"
                async with httpx.AsyncClient(base_url=url) as client:
                    response = await client.post(
                        CHAT, content=chat("short", stream=False), headers={"x-fake-delay": "30"}
                    )
        finally:
            process.terminate()
    assert response.json()["choices"][0]["message"]["content"] == reply_text(2)
