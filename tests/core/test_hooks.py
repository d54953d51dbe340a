"""``core/exchange/hooked.py``: each extension hook's effect on a request, through the core.

Real h11 peers on both sides (``playbook.py``); an async hook's answer is fed as the driver
would feed it (``ExtensionAnswered``), and its ``ExtensionCall`` read back as data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import h2.events
import h11
from checks import h1_response, h2_ended
from playbook import (
    BACKEND,
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    data,
    default_config,
    open_failed,
)

from muxproxy.config import AdmissionQueue, RateLimit, Route, Server, Upstream
from muxproxy.config.extensions import ExtensionConfig, HookErrorPolicy
from muxproxy.core.commands import (
    CancelTimer,
    CloseConnection,
    ExtensionCall,
    Log,
    OpenConnection,
    Origin,
    SetTimer,
)
from muxproxy.core.events import ExtensionAnswered, OpenFailed
from muxproxy.core.exchange.admit import tenant_of
from muxproxy.core.ports import Phase
from muxproxy.extensions import (
    Answer,
    Decision,
    Extension,
    HeaderRewrite,
    Outcome,
    Request,
    Response,
)

CANARY = "127.0.0.1:9009"


class Recorder(Extension):
    """Does what its settings say, and records what it saw."""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.events: list[bytes] = []
        self.outcomes: list[Outcome] = []

    def on_request_head(self, request: Request) -> Decision | None:
        decide = self.settings.get("decide")
        return decide(request) if decide else None

    def choose_server(self, request: Request, candidates: Sequence[str]) -> str | None:
        choose = self.settings.get("choose")
        return choose(candidates) if choose else None

    def on_response_head(self, request: Request, response: Response) -> HeaderRewrite | None:
        return HeaderRewrite(set={"x-seen-by": "recorder"}, remove=["x-backend-id"])

    def on_sse_event(self, request: Request, event: bytes) -> None:
        self.events.append(event)

    def on_finish(self, request: Request, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


class Waits(Extension):
    async def on_request_head_async(self, request: Request) -> Decision | None:
        raise AssertionError("the tests answer for the driver")


def config(extension: Extension, on_error: HookErrorPolicy = HookErrorPolicy.REJECT) -> Any:
    base = default_config()
    servers = (Server(address=BACKEND), Server(address="127.0.0.1:9002"))
    group = Upstream(name="default", servers=servers, rate_limit=RateLimit(max_concurrent=5))
    canary = Upstream(name="canary", servers=(Server(address=CANARY),))
    entry = ExtensionConfig(module="tests:X", instance=extension, on_error=on_error)
    return attrs.evolve(
        base,
        upstreams={"default": group, "canary": canary},
        routes=(Route(prefix="/", upstream="default"),),
        extensions=(entry,),
    )


def start(extension: Extension, **kw: Any) -> tuple[Playbook, H1ClientPeer, list[Any]]:
    return start_with(config(extension, **kw))


def start_with(configured: Any) -> tuple[Playbook, H1ClientPeer, list[Any]]:
    pb, client = Playbook(configured, ignore=()), H1ClientPeer()
    pb.accept(1)
    headers = [("Authorization", "Bearer k1"), ("X-Drop", "1")]
    commands = pb.receive(1, client.request("GET", "/v1/models", headers))
    return pb, client, commands


def opened(commands: list[Any]) -> list[OpenConnection]:
    return [c for c in commands if isinstance(c, OpenConnection)]


def status(pb: Playbook, client: H1ClientPeer) -> int:
    (response, *_) = [e for e in client.events(pb.take(1)) if isinstance(e, h11.Response)]
    return int(response.status_code)


def test_an_answer_ends_the_request_before_any_backend() -> None:
    answer = Answer(status=401, message="unknown key", headers=[("WWW-Authenticate", "Bearer")])
    pb, client, commands = start(Recorder({"decide": lambda r: Decision(answer=answer)}))
    assert opened(commands) == []
    events = client.events(pb.take(1))
    assert events[0].status_code == 401
    assert (b"www-authenticate", b"Bearer") in events[0].headers
    assert b"unknown key" in b"".join(e.data for e in events if isinstance(e, h11.Data))


def test_a_rewrite_reaches_the_backend_and_the_tenant_the_budget() -> None:
    decide = lambda r: Decision(set={"x-user": "alice"}, remove=["x-drop"], tenant="alice")  # noqa: E731
    pb, _, commands = start(Recorder({"decide": decide}))
    (opening,) = opened(commands)
    backend = H1BackendPeer()
    (request, *_) = backend.events(pb.take(opening.conn, pb.opened(opening.conn)))
    assert (b"x-user", b"alice") in request.headers
    assert not [v for k, v in request.headers if k == b"x-drop"]
    (exchange,) = pb.core.exchanges.values()
    assert exchange.admission is not None and exchange.admission.tenant == tenant_of(b"alice")


def test_a_picked_group_is_where_the_request_goes() -> None:
    _, _, commands = start(Recorder({"decide": lambda r: Decision(group="canary")}))
    (opening,) = opened(commands)
    assert opening.origin.port == 9009


def test_an_unknown_group_is_a_500_naming_the_extension() -> None:
    pb, client, commands = start(Recorder({"decide": lambda r: Decision(group="nope")}))
    assert opened(commands) == [] and status(pb, client) == 500
    (line,) = [c for c in commands if isinstance(c, Log) and c.event == "extension_error"]
    assert "extension X chose group 'nope'" in line.fields["error"]


def test_choose_server_overrides_the_balancer() -> None:
    _, _, commands = start(Recorder({"choose": lambda candidates: "127.0.0.1:9002"}))
    (opening,) = opened(commands)
    assert opening.origin.port == 9002


def test_a_server_that_is_no_candidate_follows_on_error() -> None:
    pb, client, commands = start(Recorder({"choose": lambda c: "10.9.9.9:1"}))
    assert opened(commands) == [] and status(pb, client) == 503
    _, _, commands = start(
        Recorder({"choose": lambda c: "10.9.9.9:1"}), on_error=HookErrorPolicy.CONTINUE
    )
    assert len(opened(commands)) == 1


def test_response_head_rewrite_sse_events_and_finish_outcome() -> None:
    recorder = Recorder({})
    pb, client, commands = start(recorder)
    (opening,) = opened(commands)
    backend = H1BackendPeer()
    backend.events(pb.take(opening.conn, pb.opened(opening.conn)))
    pb.receive(opening.conn, backend.sse_head())
    pb.receive(opening.conn, backend.chunk(b"data: a\n\ndata: b"))
    pb.receive(opening.conn, backend.chunk(b"\n\n") + backend.end())
    events = client.events(pb.take(1))
    assert (b"x-seen-by", b"recorder") in events[0].headers
    assert not [v for k, v in events[0].headers if k == b"x-backend-id"]
    assert recorder.events == [b"data: a", b"data: b"]
    (outcome,) = recorder.outcomes
    assert outcome.status == 200 and outcome.reason == "ok" and outcome.tokens == 2
    assert outcome.server == BACKEND


def test_a_raising_hook_rejects_its_request_alone_and_is_counted() -> None:
    def boom(request: Request) -> Decision:
        if request.header("authorization") == "Bearer k1":
            raise RuntimeError("key service down")
        return Decision()

    pb, client, _ = start(Recorder({"decide": boom}))
    assert status(pb, client) == 503
    assert pb.core.measurements.extension_errors == {("X", "on_request_head"): 1}
    # Another client's request on the same worker goes on.
    other = H1ClientPeer()
    pb.accept(2)
    more = pb.receive(2, other.request("GET", "/v1/models", [("Authorization", "Bearer k2")]))
    assert len(opened(more)) == 1


def async_start(**kw: Any) -> tuple[Playbook, H1ClientPeer, ExtensionCall]:
    pb, client, commands = start(Waits({}), **kw)
    (call,) = [c for c in commands if isinstance(c, ExtensionCall)]
    assert opened(commands) == []
    (exchange,) = pb.core.exchanges.values()
    assert exchange.phase is Phase.AWAITING_HOOK
    assert call.view.header("authorization") == "Bearer k1" and call.timeout == 1.0
    return pb, client, call


def answer(pb: Playbook, call: ExtensionCall, decision: object = None, error: str = "") -> Any:
    event = ExtensionAnswered(
        now=pb.now, request=call.request, position=call.position, decision=decision, error=error
    )
    return pb.feed(event)


def test_an_async_hook_that_lets_it_go_on_routes_the_request() -> None:
    pb, _, call = async_start()
    assert len(opened(answer(pb, call, Decision(group="canary")))) == 1


def test_an_async_hook_that_fails_rejects_or_continues_by_policy() -> None:
    pb, client, call = async_start()
    commands = answer(pb, call, error="no answer within 1 s")
    assert opened(commands) == [] and status(pb, client) == 503
    pb, client, call = async_start(on_error=HookErrorPolicy.CONTINUE)
    assert len(opened(answer(pb, call, error="RuntimeError: down"))) == 1
    assert pb.core.measurements.extension_errors == {("X", "on_request_head_async"): 1}


def test_a_client_that_leaves_while_an_async_hook_runs_ends_the_exchange() -> None:
    pb, _, call = async_start()
    pb.closed(1)
    assert pb.core.exchanges == {}
    assert opened(answer(pb, call, Decision())) == []  # the late answer finds nobody


# -- choose_server on every placement ---------------------------------------------------------

FIRST, SECOND, THIRD = (Origin(host="127.0.0.1", port=p) for p in (9001, 9002, 9003))


class Picks(Extension):
    """Names the last of the servers it is offered (a server of the settings' ``fail_on``-th
    call raises), and records what it was offered."""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.offered: list[list[str]] = []

    def choose_server(self, request: Request, candidates: Sequence[str]) -> str | None:
        self.offered.append(list(candidates))
        if len(self.offered) == self.settings.get("fail_on"):
            raise RuntimeError("placement service down")
        return candidates[-1]


def placing(extension: Extension, *servers: Server, **group: Any) -> Any:
    upstream = Upstream(name="default", servers=servers, **group)
    entry = ExtensionConfig(module="tests:Picks", instance=extension)
    return attrs.evolve(
        default_config(),
        upstreams={"default": upstream},
        routes=(Route(prefix="/", upstream="default"),),
        extensions=(entry,),
    )


def test_choose_server_names_the_retry_among_the_servers_not_tried() -> None:
    picks = Picks({})
    servers = (Server(address=str(o)) for o in (FIRST, SECOND, THIRD))
    pb = Playbook(placing(picks, *servers))
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request())
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=THIRD)
    pb >> open_failed(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-2, origin=SECOND)  # the hook's, not the balancer's FIRST
    pb.done()
    assert picks.offered == [[str(FIRST), str(SECOND), str(THIRD)], [str(FIRST), str(SECOND)]]


def test_choose_server_failing_on_a_retry_follows_on_error() -> None:
    picks = Picks({"fail_on": 2})
    pb = Playbook(placing(picks, Server(address=str(FIRST)), Server(address=str(SECOND))))
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request())
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=SECOND)
    pb >> open_failed(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(503, end=True))  # not the next server: reject
    pb << CloseConnection(conn=1)
    pb.done()
    assert pb.core.measurements.extension_errors == {("Picks", "choose_server"): 1}


def test_choose_server_runs_again_when_the_queue_admits_and_its_failure_answers() -> None:
    picks = Picks({"fail_on": 3})
    queue = AdmissionQueue(max=10, timeout=30)
    pb = Playbook(placing(picks, Server(address=str(FIRST), max_streams=1), queue=queue))
    first, second, backend = H1ClientPeer(), H1ClientPeer(), H1BackendPeer()
    pb.accept(1)
    (opening,) = opened(pb.receive(1, first.request()))
    backend.events(pb.take(opening.conn, pb.opened(opening.conn)))
    pb.receive(opening.conn, backend.sse_head())
    pb.accept(2)
    assert opened(pb.receive(2, second.request())) == []  # the server is full: it waits
    assert picks.offered == [[str(FIRST)], [str(FIRST)]]
    commands = pb.receive(opening.conn, backend.chunk(b"data: a\n\n") + backend.end())
    # Admitted: the hook is asked again (its third call raises), so the second request is
    # answered 503 by the extension's policy instead of being placed.
    assert picks.offered == [[str(FIRST)], [str(FIRST)], [str(FIRST)]]
    assert opened(commands) == []
    (answer, *_) = second.events(pb.take(2, commands))
    assert answer.status_code == 503


# -- on_response_head sees the proxy's own answers ------------------------------------------


class Traces(Extension):
    """Adds a trace field to every response head (and tries to change an answer's framing);
    records each head it saw; raises on the heads the settings' ``fail`` says."""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.seen: list[tuple[int, bool]] = []

    def on_response_head(self, request: Request, response: Response) -> HeaderRewrite | None:
        self.seen.append((response.status, response.from_backend))
        if self.settings.get("fail"):
            raise RuntimeError("tracer down")
        assert response.header("Content-Type") is not None
        return HeaderRewrite(set={"x-trace": "t1", "content-length": "0"}, remove=["date"])


class Answers(Extension):
    def on_request_head(self, request: Request) -> Decision | None:
        return Decision(answer=Answer(status=401, message="no key"))


def answering(*extensions: Extension, routes: tuple[Route, ...] | None = None) -> Any:
    base = config(extensions[0])
    entries = tuple(ExtensionConfig(module=f"t:E{i}", instance=e) for i, e in enumerate(extensions))
    return attrs.evolve(base, extensions=entries, routes=routes or base.routes)


def test_the_proxys_own_answers_pass_on_response_head_framing_kept() -> None:
    traces = Traces({})
    pb = Playbook(answering(traces, routes=(Route(prefix="/v1/chat", upstream="default"),)))
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("GET", "/elsewhere"))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    no_route = h1_response(404, b"no route for this path\n", end=True, headers={b"x-trace": b"t1"})
    pb << (reply := Sends(1, client, no_route))  # its body still framed by its own length
    pb << CloseConnection(conn=1)
    pb.done()
    assert b"date" not in dict(reply.events[0].headers)
    assert traces.seen == [(404, False)]


def test_another_extensions_answer_and_a_502_pass_on_response_head_too() -> None:
    traces = Traces({})
    pb, client, _ = start_with(answering(Answers({}), traces))
    (head, *_) = client.events(pb.take(1))
    assert head.status_code == 401 and (b"x-trace", b"t1") in head.headers
    traces = Traces({})
    pb, client, commands = start_with(answering(traces))
    while openings := opened(commands):  # every server refuses: 502
        commands = pb.feed(OpenFailed(now=pb.now, conn=openings[0].conn, reason="refused"))
    (head, *_) = client.events(pb.take(1))
    assert head.status_code == 502 and (b"x-trace", b"t1") in head.headers
    assert traces.seen == [(502, False)]


def test_a_failure_on_the_proxys_own_answer_sends_it_unchanged() -> None:
    traces = Traces({"fail": True})
    pb, client, commands = start_with(answering(Answers({}), traces))
    (head, *_) = client.events(pb.take(1))
    assert head.status_code == 401  # not a 503: the answer goes out as it was
    assert not [v for k, v in head.headers if k == b"x-trace"]
    assert pb.core.measurements.extension_errors == {("E1", "on_response_head"): 1}
    (line,) = [c for c in commands if isinstance(c, Log) and c.event == "extension_error"]
    assert line.fields["hook"] == "on_response_head"


def test_the_backends_head_is_seen_as_the_backends() -> None:
    traces = Traces({})
    pb, client, commands = start_with(answering(traces))
    (opening, *_) = opened(commands)
    backend = H1BackendPeer()
    backend.events(pb.take(opening.conn, pb.opened(opening.conn)))
    pb.receive(opening.conn, backend.sse_head())
    (head, *_) = client.events(pb.take(1))
    assert (b"x-trace", b"t1") in head.headers
    assert traces.seen == [(200, True)]


def test_an_h2_clients_own_answer_is_rewritten_too() -> None:
    traces = Traces({})
    pb = Playbook(answering(traces, routes=(Route(prefix="/v1/chat", upstream="default"),)))
    pb.accept(1)
    client = H2ClientPeer()
    sid, request = client.request(b"GET", b"/elsewhere")
    pb >> data(1, client.preface() + request)
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client)  # our SETTINGS
    pb << CancelTimer(timer=("header", 1))
    pb << (reply := Sends(1, client, h2_ended(sid)))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    (head,) = [e for e in reply.events if isinstance(e, h2.events.ResponseReceived)]
    fields = dict(head.headers)
    assert fields[b":status"] == b"404" and fields[b"x-trace"] == b"t1"
    assert traces.seen == [(404, False)]
