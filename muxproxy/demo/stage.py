"""The demo's stage: its settings, the fleet and the proxy started, what the proxy reports.

:class:`Demo` holds what every part of the demo shares: the fleet, the proxy, the board, the
shared HTTP/2 client connection, the clock (seconds since the demo began). The proxy's
``Log`` records (retries, continuations, health changes) and the admin API's ``/status``
(weights, states) are written to the board here.
"""

from __future__ import annotations

import secrets
from functools import partial

import attrs
import trio

from muxproxy.core.commands import Log
from muxproxy.demo.board import Backend, Board, plural
from muxproxy.demo.clients import H1Client, H2Client, admin_request
from muxproxy.demo.fleet import (
    GROUP,
    FakeGPU,
    Proxy,
    build_config,
    config_table,
    start_gpu,
    start_proxy,
)
from muxproxy.testing.fakellm import FakeLLM

STATUS_EVERY = 0.25
"""Seconds between two reads of the admin API's ``/status`` (the view's weights and states)."""


@attrs.frozen(kw_only=True)
class Settings:
    duration: float = 25.0
    tokens: int = 24
    delay: float = 0.04
    conversations: int = 12
    """Conversations at once: half over HTTP/1.1 (a connection each), half on one HTTP/2
    connection."""
    seed: int = 1

    @property
    def first_delay(self) -> float:
        """The fakes' time to the first token (their "prefill")."""
        return 4 * self.delay


@attrs.define
class Demo:
    """The running demo: its fleet, its proxy, its clients, its board."""

    settings: Settings
    board: Board
    gpus: dict[str, FakeGPU]
    proxy: Proxy
    token: str
    h2: H2Client
    started: float
    stop_at: float
    h1_clients: list[H1Client] = attrs.Factory(list)
    _keys: int = 0

    def now(self) -> float:
        return trio.current_time() - self.started

    def at(self, fraction: float) -> float:
        """The Trio time at ``fraction`` of the duration."""
        return self.started + fraction * self.settings.duration

    def new_key(self) -> str:
        self._keys += 1
        return f"chat-{self._keys:02d}"

    @property
    def v1(self) -> list[FakeGPU]:
        return [g for g in self.gpus.values() if self.board.backends[g.name].version == "v1"]

    @property
    def v2(self) -> list[FakeGPU]:
        return [g for g in self.gpus.values() if self.board.backends[g.name].version == "v2"]


# -- setting up ---------------------------------------------------------------------------


async def start_demo(nursery: trio.Nursery, settings: Settings) -> Demo:
    """Start the fleet (gpu0..gpu2 serving v1 with weight 1, gpu3 serving v2 with weight 0),
    the proxy with its admin API, and the shared HTTP/2 client connection."""
    gpus: dict[str, FakeGPU] = {}
    weights: list[tuple[FakeGPU, int]] = []
    for index, version in enumerate(("v1", "v1", "v1", "v2")):
        fake = FakeLLM(
            backend_id=f"gpu{index}",
            model_version=version,
            tokens=settings.tokens,
            delay=settings.delay,
            first_delay=settings.first_delay,
        )
        gpu = await start_gpu(nursery, fake)
        gpus[gpu.name] = gpu
        weights.append((gpu, 1 if version == "v1" else 0))
    token = secrets.token_urlsafe(12)
    config = build_config(config_table(weights, token, health_interval=1.0))
    backends = {
        gpu.name: Backend(name=gpu.name, version=str(gpu.fake.model_version), address=gpu.address)
        for gpu in gpus.values()
    }
    board = Board(backends=backends)
    proxy = await start_proxy(nursery, config)
    h2 = await H2Client.connect(proxy.port)
    nursery.start_soon(h2.serve)
    started = trio.current_time()
    demo = Demo(
        settings=settings,
        board=board,
        gpus=gpus,
        proxy=proxy,
        token=token,
        h2=h2,
        started=started,
        stop_at=started + settings.duration,
    )
    assert proxy.server.driver is not None
    proxy.server.driver.on_log = partial(on_proxy_log, demo)
    return demo


# -- what the proxy says ---------------------------------------------------------------


def on_proxy_log(demo: Demo, record: Log) -> None:
    """Note what the proxy logs about retries and health, on the turns they concern."""
    board, fields, now = demo.board, record.fields, demo.now()
    if record.event == "retry":
        name = board.backend_at(str(fields.get("server")))
        turn = board.turn(str(fields.get("request_id")))
        rid = turn.request_id if turn is not None else fields.get("request_id")
        reason = fields.get("reason")
        if fields.get("condition") == "continuation":
            if turn is not None:
                turn.continued_from.append(name)
            done = "some" if turn is None else plural(len(turn.text), "token")
            board.note(
                now,
                f"continue: {rid} cut mid-answer on {name} after {done} ({reason});"
                " the next server finishes it",
            )
        else:
            if turn is not None:
                turn.retried_from.append(name)
            board.note(
                now,
                f"retry: {rid} failed on {name} before its first token"
                f" ({fields.get('condition')}: {reason}); sent to the next server",
            )
    elif record.event == "health":
        name = board.backend_at(str(fields.get("server")))
        state = "up" if fields.get("up") else "down"
        board.note(now, f"health: {name} {state} ({fields.get('detail')})")
    elif record.event == "retry_skipped":
        board.note(now, f"no retry: {fields.get('reason')}")


async def watch_status(demo: Demo) -> None:
    """Keep the board's weights and states as the admin API tells them."""
    while True:
        await read_status(demo)
        await trio.sleep(STATUS_EVERY)


async def read_status(demo: Demo) -> None:
    try:
        status, document = await admin_request(demo.proxy.admin_port, "GET", "/status")
    except OSError:
        return
    if status != 200 or not isinstance(document, dict):
        return
    board = demo.board
    for server in document["groups"][GROUP]["servers"]:
        backend = board.backends.get(board.backend_at(server["address"]))
        if backend is not None:
            backend.weight, backend.state = server["weight"], server["state"]
