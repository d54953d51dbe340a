"""The shared fuzz harness: drive one ``ProxyCore`` like the Trio driver would, assert invariants.

The driving is ``muxproxy.testing.simdriver.SimDriver`` (the driver contract with no sockets,
shared with tests and embedders); this module turns fuzzer input into conversations and checks
how they end.

``run_case(kind, data, splits, stop=None)`` plays one conversation:

- ``client_h1`` / ``client_h2``: ``data`` is what a client sends on a plain listener, delivered
  in pieces cut at ``splits``; a well-behaved HTTP/1.1 backend (an h11 server) answers every
  request the proxy forwards with ``200 ok``.
- ``backend_h1`` / ``backend_h2``: a well-formed HTTP/1.1 client request, then ``data`` is what
  the backend (HTTP/1.1, or h2c with prior knowledge) answers, cut at ``splits``.

With ``llm`` (bit 6 of the input's first byte: ``llm_of``) the group is an LLM fleet's:
least load with prefix affinity (so every request's JSON body is read before it is routed),
one stream per server (a second request waits in the admission queue, fair between tenants
by ``Authorization``, for at most 1 s), and a token budget per tenant settled from the
response's usage (so backend bodies are scanned for it).

With ``fleet`` (bit 7 of the input's first byte, then one more byte after the split points:
``fleet_of``) the LLM fleet's group has the fleet store (``[fleet]``), with ``max_concurrent``
in its budget: each admission waits in RESERVING for the simulated store's answer, which the
fleet byte picks per reservation (``store_answers``): reserved, refused (429), a reply no
script gives (read by ``fleet.budgets.read_reply``, so a store error: ``on_store_error``,
also from the fleet byte, decides), or reserved but late (after every connection closed: the
exchange ended first, so the answer is given back). Sessions are shared (what the core
remembers goes out as ``SessionsRemembered``) and a batch learned from elsewhere comes in
first. Invariant 6: every reservation the store granted is settled exactly once (its lease
released), and nothing else is.

With ``stop`` (seconds, from the input's first byte: ``stop_of``), a graceful stop
(``ShutdownRequested`` with its deadline ``stop`` seconds on; 0 cuts at once) comes after the
first read of the fuzzed bytes, so the fuzzer also drives the stop through every state a
connection can be in.

A peer's end is fed as the Trio driver feeds it: ``InputEnded`` (its EOF), then
``ConnectionClosed`` once the core closes the connection. Then every timer fires in time order
and every connection ends its side, then closes. Invariants (an
``AssertionError`` names the one that broke; any other exception escaped ``handle``, which is a
bug by ``proxy.py``'s contract; the core runs with ``raise_errors``, so fault isolation does
not hide it):

1. no ``SendData`` for a connection after the core's ``CloseConnection`` or ``ShutdownWrite``
   for it;
2. every stream's buffered bytes (``statistics()``) stay within ``limits.stream_buffer``;
3. every exchange that started ends exactly once: one ``Log(event="access")`` each, and none
   is left in ``core.exchanges`` once all connections are closed;
4. the driver contract holds: reads are at most ``core.read_size``, a paused connection is not
   read, and the conversation settles (no endless event loop);
5. after a stop, once every connection is closed, ``core.drained`` holds;
6. (``fleet``) every reservation granted is settled once, and only those.

Only the standard library, h11, h2 and muxproxy: the test suite replays the seed corpus through
this module without atheris.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import attrs

from muxproxy.config import (
    AdmissionQueue,
    AffinityMode,
    Balance,
    Config,
    FleetSettings,
    RateLimit,
    Resume,
    Route,
    Server,
    SessionSource,
    Sticky,
    StoreErrorPolicy,
    quick_config,
)
from muxproxy.config.records import ModelAlias, ModelTarget
from muxproxy.core.commands import BudgetReserve
from muxproxy.core.events import BudgetAnswered, SessionsLearned
from muxproxy.core.proxy import ProxyCore
from muxproxy.core.streams import resume
from muxproxy.fleet.budgets import BadReply, read_reply
from muxproxy.fleet.sessions import SessionEntry
from muxproxy.routing.affinity import key_hash
from muxproxy.routing.loadreport import ReportError, parse_load_report
from muxproxy.routing.lora import MAX_ADAPTERS
from muxproxy.testing.simdriver import SimDriver

KINDS = ("client_h1", "client_h2", "backend_h1", "backend_h2")
CLIENT = 1
BACKEND = "127.0.0.1:9001"

CHAT_BODY = b'{"stream":true,"messages":[{"role":"user","content":"hi"}]}'
MESSAGES_BODY = (
    b'{"model":"m","max_tokens":9,"stream":true,"messages":[{"role":"user","content":"hi"}]}'
)
RESPONSES_BODY = b'{"model":"m","input":"hi","stream":true}'


def _post(path: bytes, body: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: proxy.example\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
    ) % (path, len(body), body)


CLIENT_REQUEST = _post(b"/v1/chat/completions", CHAT_BODY)
CLIENT_REQUESTS = (
    CLIENT_REQUEST,
    _post(b"/v1/messages", MESSAGES_BODY),
    _post(b"/v1/responses", RESPONSES_BODY),
)
"""The backend targets' requests, one per API the proxy reads (``core/apis``), picked by the
backend bytes' length (mod 3): a chat completion or an Anthropic message that breaks
mid-answer is continued (``continue_on_failure``) on a second connection, and an answer held
until its first event (``retry_until_first_event``) may fail over on an error event."""


def request_for(data: bytes) -> bytes:
    """The client request of a backend case whose backend sends ``data``."""
    return CLIENT_REQUESTS[len(data) % len(CLIENT_REQUESTS)]


def decode(buf: bytes) -> tuple[bytes, list[int]]:
    """An atheris input as (data, splits): byte 0 counts the splits (mod 8), two bytes each
    (big-endian, taken modulo the data's length), then (with ``FLEET_BIT``) the fleet byte,
    then the data."""
    if not buf:
        return b"", []
    count = buf[0] % 8
    raw = buf[1 : 1 + 2 * count]
    data = buf[1 + 2 * count + (1 if buf[0] & FLEET_BIT else 0) :]
    splits = [int.from_bytes(raw[i : i + 2], "big") for i in range(0, len(raw) - 1, 2)]
    return data, splits


def stop_of(buf: bytes) -> float | None:
    """The graceful stop an atheris input asks for: bit 3 of byte 0 set means a stop, whose
    grace is bits 4-5 (0 to 3 seconds; 0 cuts at once); None: no stop."""
    if not buf or not buf[0] & STOP_BIT:
        return None
    return float((buf[0] >> 4) & 3)


STOP_BIT = 0x08
LLM_BIT = 0x40
FLEET_BIT = 0x80


def llm_of(buf: bytes) -> bool:
    """Whether an atheris input asks for the LLM fleet's group (bit 6 of byte 0, or the
    fleet's, bit 7)."""
    return bool(buf) and bool(buf[0] & (LLM_BIT | FLEET_BIT))


def fleet_of(buf: bytes) -> int | None:
    """The fleet byte of an atheris input with ``FLEET_BIT`` (the byte after the split
    points; 0 when the input ends before it); None: no fleet store."""
    if not buf or not buf[0] & FLEET_BIT:
        return None
    at = 1 + 2 * (buf[0] % 8)
    return buf[at] if at < len(buf) else 0


def encode(
    data: bytes,
    splits: list[int] = [],  # noqa: B006 - never mutated
    stop: int | None = None,
    *,
    llm: bool = False,
    fleet: int | None = None,
) -> bytes:
    """The inverse of ``decode``, ``stop_of``, ``llm_of`` and ``fleet_of`` (for the seed
    corpus)."""
    splits = splits[:7]
    first = len(splits) if stop is None else len(splits) | STOP_BIT | (stop & 3) << 4
    if llm:
        first |= LLM_BIT
    if fleet is not None:
        first |= FLEET_BIT
    head = bytes([first]) + b"".join(s.to_bytes(2, "big") for s in splits)
    return head + (b"" if fleet is None else bytes([fleet])) + data


POLICIES = (
    StoreErrorPolicy.LOCAL,
    StoreErrorPolicy.OPEN,
    StoreErrorPolicy.CLOSED,
    StoreErrorPolicy.LOCAL,
)
"""``on_store_error`` by the fleet byte's bits 0-1."""
RESERVED, REFUSED, BAD_REPLY, LATE = range(4)
"""The store's answer to the first three reservations, by the fleet byte's bits 2-7 (two
each; later ones are reserved)."""
REPLIES = {
    RESERVED: [0, b"0", b"9000", b"99", 1],
    REFUSED: [5, b"1.5", b"-3", b"0", 2],
    BAD_REPLY: [0, b"nan", b"1", b"1", 0],
}
"""What the reservation script answers, as the client library gives it."""


def config_for(kind: str, llm: bool = False, fleet: int | None = None) -> Config:
    config = quick_config("127.0.0.1:8080", [BACKEND])
    group = config.upstreams["default"]
    protocol = "h2" if kind == "backend_h2" else "h1"
    if llm:
        group = attrs.evolve(
            group,
            servers=(Server(address=BACKEND, protocol=protocol, max_streams=1),),
            balance=Balance.LEAST_LOAD,
            affinity=AffinityMode.PREFIX,
            queue=AdmissionQueue(max=4, timeout=1.0),
            tenant=SessionSource(kind="header", name="authorization"),
            rate_limit=RateLimit(
                tokens_per_minute=10_000,
                requests_per_minute=100,
                max_concurrent=None if fleet is None else 2,
            ),
        )
    elif protocol == "h2":
        group = attrs.evolve(group, servers=(Server(address=BACKEND, protocol="h2"),))
    # Every SSE response is resumable, with a small window so that it overflows, held until
    # its first event, and a chat or Messages answer that breaks is continued.
    route = Route(
        prefix="/",
        upstream="default",
        resume=Resume(window=4096, linger=1.0),
        continue_on_failure=True,
        retry_until_first_event=True,
    )
    config = attrs.evolve(config, upstreams={"default": group}, routes=(route,))
    if llm:
        # Routing by the body's model, read before the route (``core/exchange/bymodel.py``),
        # and an alias whose target is written into the body.
        targets = (ModelTarget(model="m", weight=1), ModelTarget(model="gpt-4o", weight=1))
        config = attrs.evolve(
            config,
            routes=(attrs.evolve(route, models=("m", "gpt-*")), route),
            models={"chat": ModelAlias(name="chat", targets=targets)},
        )
    if fleet is not None:
        # Conversations keyed by their credential: what the core remembers is shared.
        sticky = Sticky(sources=(SessionSource(kind="header", name="authorization"),))
        config = attrs.evolve(config, upstreams={"default": attrs.evolve(group, sticky=sticky)})
        store = FleetSettings(
            store="redis://fleet.invalid:6379", on_store_error=POLICIES[fleet & 3]
        )
        config = attrs.evolve(config, fleet=store)
    return config


class SimStore:
    """The fleet store of a fleet byte, as ``SimDriver.budget_store``: what it answers each
    reservation (the byte's bits 2-7), and which reservations it granted."""

    def __init__(self, fleet: int) -> None:
        self.fleet = fleet
        self.asked = 0
        self.granted: list[int] = []
        """The ``Ask.request`` of every reservation answered reserved."""

    def __call__(self, command: BudgetReserve, now: float) -> BudgetAnswered | None:
        kind = (self.fleet >> (2 + 2 * self.asked)) & 3 if self.asked < 3 else RESERVED
        self.asked += 1
        return None if kind == LATE else self.answer(command, now, kind)

    def answer(self, command: BudgetReserve, now: float, kind: int) -> BudgetAnswered:
        try:
            verdict, error = read_reply(REPLIES[kind]), ""
        except BadReply as exc:
            verdict, error = None, repr(exc)
        if verdict is not None and verdict.reserved:
            self.granted.append(command.ask.request)
        return BudgetAnswered(
            now=now, store=command.store, ask=command.ask, verdict=verdict, error=error, replicas=3
        )

    def answer_late(self, driver: SimDriver) -> None:
        """Grant the reservations held back (``LATE``): their exchanges are gone by now."""
        held, driver.unanswered = driver.unanswered, []
        for command in held:
            driver.queue.append(self.answer(command, driver.now, RESERVED))
        driver.settle()


LEARNED = (
    SessionEntry(group="default", key=key_hash(b"Bearer a"), address=BACKEND, at=0.0),
    SessionEntry(group="default", key=key_hash(b"Bearer a"), address="127.0.0.1:1", at=-1.0),
    SessionEntry(group="elsewhere", key=1, address=BACKEND, at=0.0),
    SessionEntry(group="default", key=2, address=BACKEND, at=-1e9),
)
"""A batch learned from another replica before the conversation: one taken, one older for
the same key, one of a group not here, one expired."""


RESUME_TOKENS = [bytes([c]) * 22 for c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
"""The tokens of a case's resumable streams, in order (random in production): a fuzzed
``Last-Event-ID: AAAAAAAAAAAAAAAAAAAAAA.1`` names the case's first stream."""


_RANDOM_TOKEN = resume.new_token


@contextlib.contextmanager
def _deterministic_tokens() -> Iterator[None]:
    """For one case; the random tokens come back after it (other code shares the module)."""
    tokens = iter(RESUME_TOKENS)
    resume.new_token = lambda: next(tokens, b"Z" * 22)  # type: ignore[assignment]
    try:
        yield
    finally:
        resume.new_token = _RANDOM_TOKEN  # type: ignore[assignment]


def run_case(
    kind: str,
    data: bytes,
    splits: list[int],
    stop: float | None = None,
    llm: bool = False,
    fleet: int | None = None,
) -> None:
    """Play one conversation (see the module docstring); raise AssertionError on a broken
    invariant."""
    assert kind in KINDS, kind
    # A bug must crash the case, not be contained as one connection's internal error.
    with _deterministic_tokens():
        core = ProxyCore(config_for(kind, llm or fleet is not None, fleet), raise_errors=True)
        store = None if fleet is None else SimStore(fleet)
        driver = SimDriver(core, answer_backends=kind.startswith("client"), budget_store=store)
        if store is not None:
            core.sessions.enable()
            driver.feed(SessionsLearned(now=driver.now, entries=LEARNED))
            driver.settle()
        driver.accept(CLIENT)
        if kind.startswith("client"):
            driver.stop = stop
            driver.deliver(CLIENT, data, splits)
        else:
            driver.deliver(CLIENT, request_for(data), [])
            driver.stop = stop
            if driver.backends:
                driver.deliver(driver.backends[0], data, splits)
                # The backend ends: h11's read-until-close framing, a truncation, or (in a
                # tunnel) one direction's end.
                driver.end_input(driver.backends[0])
        driver.request_stop()  # no backend was reached: the stop comes all the same
        driver.fire_timers()
        driver.close_everything()
        if store is not None:
            store.answer_late(driver)
        driver.fire_timers()
        check_endings(driver)
        if store is not None:
            settled = sorted(command.ask.request for command in driver.settles)
            assert settled == sorted(store.granted), f"granted {store.granted}, settled {settled}"
        if stop is not None:
            assert driver.core.drained, "stopped, every connection closed, yet not drained"


def check_endings(driver: SimDriver) -> None:
    core: Any = driver.core
    started = core._next_exchange
    accessed = [log for log in driver.logs if log.event == "access"]
    assert not core.exchanges, f"exchanges left after every connection closed: {core.exchanges}"
    assert len(accessed) == started, f"{started} exchanges, {len(accessed)} access logs"
    stats = core.statistics()
    assert stats.client_connections == 0, "a client connection outlived its close"
    resumes = core.resumes
    assert resumes.held_bytes == sum(s.cost for s in resumes.streams.values()), "resume bytes"
    assert all(s.owner is None for s in resumes.streams.values()), "a resumable owner outlived"


def check_report(body: bytes) -> None:
    """The ``load_report`` target: a backend's ``/metrics`` body through ``parse_load_report``,
    which may raise ``ReportError`` and nothing else; a report it returns holds counts >= 0,
    a KV-cache fraction in [0, 1], and LoRA adapters (vLLM's only) within their bound."""
    try:
        report = parse_load_report(body)
    except ReportError:
        return
    for count in (report.running, report.waiting):
        assert count is None or count >= 0, report
    kv = report.kv_cache
    assert kv is None or (math.isfinite(kv) and 0.0 <= kv <= 1.0), report
    assert report.engine in ("vllm", "sglang"), report
    lora = report.lora
    if lora is not None:
        assert report.engine == "vllm" and len(lora.loaded) <= MAX_ADAPTERS, report
        assert all(lora.loaded) and (lora.max_lora is None or lora.max_lora >= 0), report
