"""``core/exchange/hooked.py``: each extension hook's effect on a request, through the core.

Real h11 peers on both sides (``playbook.py``); an async hook's answer is fed as the driver
would feed it (``ExtensionAnswered``), and its ``ExtensionCall`` asserted in place. Each test
is a conversation: every command asserted in order, timers included; ``Log`` is asserted
where the log line is the behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import h2.events
import h11
from checks import h1_body, h1_request, h1_response, h2_ended
from playbook import (
    ANY,
    BACKEND,
    H1BackendPeer,
    H1ClientPeer,
    H2ClientPeer,
    Playbook,
    Sends,
    Where,
    closed,
    data,
    default_config,
    open_failed,
    opened,
    subset,
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
from muxproxy.core.events import ExtensionAnswered
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
FIRST, SECOND, THIRD = (Origin(host="127.0.0.1", port=p) for p in (9001, 9002, 9003))
HEADERS = [("Authorization", "Bearer k1"), ("X-Drop", "1")]


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


def asks(configured: Any, *, logs: bool = False) -> tuple[Playbook, H1ClientPeer]:
    """Client 1 sends ``GET /v1/models`` with ``HEADERS``; its head is read whole. ``logs``:
    the conversation asserts ``Log`` too."""
    pb, client = Playbook(configured, ignore=() if logs else (Log,)), H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("GET", "/v1/models", HEADERS))
    pb << CancelTimer(timer=("header", 1))
    return pb, client


def start(extension: Extension, **kw: Any) -> tuple[Playbook, H1ClientPeer]:
    return asks(config(extension, **kw))


def opens(pb: Playbook, origin: Any = ANY, *, ex: int = 1, conn: int = -1) -> None:
    """Exchange ``ex`` opens backend connection ``conn`` to ``origin``."""
    pb << SetTimer(timer=("connect", ex), at=pb.now + 5.0)
    pb << OpenConnection(conn=conn, origin=origin)


def forwards(pb: Playbook, backend: H1BackendPeer, *, ex: int = 1, conn: int = -1) -> Sends:
    """The backend accepts ``conn`` and reads the request; the head deadline starts."""
    pb >> opened(conn)
    pb << CancelTimer(timer=("connect", ex))
    pb << (request := Sends(conn, backend, h1_request(b"GET", b"/v1/models")))
    pb << SetTimer(timer=("head", ex), at=pb.now + 60.0)
    return request


def refuses(pb: Playbook, client: H1ClientPeer, status: int, conn: int = 1) -> Sends:
    """The proxy answers ``status`` itself and closes the client connection."""
    pb << SetTimer(timer=("send", conn), at=pb.now + 60.0)
    pb << (reply := Sends(conn, client, h1_response(status, end=True)))
    pb << CloseConnection(conn=conn)
    return reply


def sse_head(pb: Playbook, client: H1ClientPeer, backend: H1BackendPeer) -> Sends:
    """The backend on -1 answers with an SSE head: it goes out to client 1 at once."""
    pb >> data(-1, backend.sse_head())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=pb.now + 60.0)
    pb << (head := Sends(1, client, h1_response(200)))
    pb << SetTimer(timer=("read", 1), at=pb.now + 300.0)
    return head


def extension_error(hook: str, error: str) -> Where:
    """The ``extension_error`` log line of ``hook``, its error holding ``error``."""
    return Where(
        Log,
        lambda log: (
            log.event == "extension_error"
            and log.fields["hook"] == hook
            and error in log.fields["error"]
        ),
    )


def access(status: int) -> Log:
    return Log(event="access", fields=subset({"status": status}))


def test_an_answer_ends_the_request_before_any_backend() -> None:
    answer = Answer(status=401, message="unknown key", headers=[("WWW-Authenticate", "Bearer")])
    pb, client = start(Recorder({"decide": lambda r: Decision(answer=answer)}))
    reply = refuses(pb, client, 401)
    pb.done()  # no backend is opened
    assert (b"www-authenticate", b"Bearer") in reply.events[0].headers
    assert b"unknown key" in h1_body(reply.events)


def test_a_rewrite_reaches_the_backend_and_the_tenant_the_budget() -> None:
    decide = lambda r: Decision(set={"x-user": "alice"}, remove=["x-drop"], tenant="alice")  # noqa: E731
    pb, _ = start(Recorder({"decide": decide}))
    opens(pb)
    request = forwards(pb, H1BackendPeer())
    pb.done()
    head = request.events[0]
    assert (b"x-user", b"alice") in head.headers
    assert not [v for k, v in head.headers if k == b"x-drop"]
    (exchange,) = pb.core.exchanges.values()
    assert exchange.admission is not None and exchange.admission.tenant == tenant_of(b"alice")


def test_a_picked_group_is_where_the_request_goes() -> None:
    pb, _ = start(Recorder({"decide": lambda r: Decision(group="canary")}))
    opens(pb, Origin(host="127.0.0.1", port=9009))
    pb.done()


def test_an_unknown_group_is_a_500_naming_the_extension() -> None:
    pb, client = asks(config(Recorder({"decide": lambda r: Decision(group="nope")})), logs=True)
    pb << extension_error("on_request_head", "extension X chose group 'nope'")
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(500, end=True))
    pb << access(500)
    pb << CloseConnection(conn=1)
    pb.done()  # no backend is opened


def test_choose_server_overrides_the_balancer() -> None:
    pb, _ = start(Recorder({"choose": lambda candidates: "127.0.0.1:9002"}))
    opens(pb, SECOND)
    pb.done()


def test_a_server_that_is_no_candidate_follows_on_error() -> None:
    pb, client = start(Recorder({"choose": lambda c: "10.9.9.9:1"}))
    refuses(pb, client, 503)
    pb.done()  # no backend is opened
    pb, _ = start(Recorder({"choose": lambda c: "10.9.9.9:1"}), on_error=HookErrorPolicy.CONTINUE)
    opens(pb)  # the balancer's choice
    pb.done()


def test_response_head_rewrite_sse_events_and_finish_outcome() -> None:
    recorder = Recorder({})
    pb, client = start(recorder)
    backend = H1BackendPeer()
    opens(pb)
    forwards(pb, backend)
    head = sse_head(pb, client, backend)
    pb >> data(-1, backend.chunk(b"data: a\n\ndata: b"))
    pb << Sends(1, client, lambda got: h1_body(got) == b"data: a\n\ndata: b")
    pb >> data(-1, backend.chunk(b"\n\n") + backend.end())
    pb << Sends(1, client, lambda got: h1_body(got) == b"\n\n" and got[-1] == h11.EndOfMessage())
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    response = head.events[0]
    assert (b"x-seen-by", b"recorder") in response.headers
    assert not [v for k, v in response.headers if k == b"x-backend-id"]
    assert recorder.events == [b"data: a", b"data: b"]
    (outcome,) = recorder.outcomes
    assert outcome.status == 200 and outcome.reason == "ok" and outcome.tokens == 2
    assert outcome.server == BACKEND


def test_a_raising_hook_rejects_its_request_alone_and_is_counted() -> None:
    def boom(request: Request) -> Decision:
        if request.header("authorization") == "Bearer k1":
            raise RuntimeError("key service down")
        return Decision()

    pb, client = start(Recorder({"decide": boom}))
    refuses(pb, client, 503)
    pb.done()
    assert pb.core.measurements.extension_errors == {("X", "on_request_head"): 1}
    # Another client's request on the same worker goes on.
    other = H1ClientPeer()
    pb.accept(2)
    pb >> data(2, other.request("GET", "/v1/models", [("Authorization", "Bearer k2")]))
    pb << CancelTimer(timer=("header", 2))
    opens(pb, ex=2)
    pb.done()


def async_start(**kw: Any) -> tuple[Playbook, H1ClientPeer, ExtensionCall]:
    """Client 1's request waits for the async hook: one ``ExtensionCall`` and nothing else."""
    pb, client = start(Waits({}), **kw)
    calls: list[ExtensionCall] = []

    def awaited(call: ExtensionCall) -> bool:
        calls.append(call)
        return call.view.header("authorization") == "Bearer k1" and call.timeout == 1.0

    pb << Where(ExtensionCall, awaited)
    pb.done()  # no backend is opened while it waits
    (exchange,) = pb.core.exchanges.values()
    assert exchange.phase is Phase.AWAITING_HOOK
    return pb, client, calls[0]


def answer(call: ExtensionCall, decision: object = None, error: str = "") -> Any:
    """What the driver feeds when the hook of ``call`` returned ``decision`` (or failed)."""
    return lambda now: ExtensionAnswered(
        now=now, request=call.request, position=call.position, decision=decision, error=error
    )


def test_an_async_hook_that_lets_it_go_on_routes_the_request() -> None:
    pb, _, call = async_start()
    pb >> answer(call, Decision(group="canary"))
    opens(pb, Origin(host="127.0.0.1", port=9009))
    pb.done()


def test_an_async_hook_that_fails_rejects_or_continues_by_policy() -> None:
    pb, client, call = async_start()
    pb >> answer(call, error="no answer within 1 s")
    refuses(pb, client, 503)
    pb.done()  # no backend is opened
    pb, client, call = async_start(on_error=HookErrorPolicy.CONTINUE)
    pb >> answer(call, error="RuntimeError: down")
    opens(pb)
    pb.done()
    assert pb.core.measurements.extension_errors == {("X", "on_request_head_async"): 1}


def test_a_client_that_leaves_while_an_async_hook_runs_ends_the_exchange() -> None:
    pb, _, call = async_start()
    pb >> closed(1)
    assert pb.core.exchanges == {}
    pb >> answer(call, Decision())  # the late answer finds nobody: nothing is opened
    pb.done()


# -- choose_server on every placement ---------------------------------------------------------


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
    pb >> data(1, first.request())
    pb << CancelTimer(timer=("header", 1))
    opens(pb, FIRST)
    forwards(pb, backend)
    sse_head(pb, first, backend)
    pb.accept(2)
    pb >> data(2, second.request())
    pb << CancelTimer(timer=("header", 2))
    pb << SetTimer(timer=("queue", 2), at=30.0)  # the server is full: it waits
    pb.done()
    assert picks.offered == [[str(FIRST)], [str(FIRST)]]
    pb >> data(-1, backend.chunk(b"data: a\n\n") + backend.end())
    pb << Sends(1, first, lambda got: h1_body(got) == b"data: a\n\n")
    pb << SetTimer(timer=("pool", -1), at=60.0)
    pb << CancelTimer(timer=("read", 1))
    # Admitted: the hook is asked again (its third call raises), so the second request is
    # answered 503 by the extension's policy instead of being placed.
    pb << CancelTimer(timer=("queue", 2))
    pb << SetTimer(timer=("send", 2), at=60.0)
    pb << Sends(2, second, h1_response(503, end=True))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb << CloseConnection(conn=2)
    pb.done()  # no backend is opened for it
    assert picks.offered == [[str(FIRST)], [str(FIRST)], [str(FIRST)]]


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
    pb, client = asks(answering(Answers({}), traces))
    reply = refuses(pb, client, 401)
    pb.done()
    assert (b"x-trace", b"t1") in reply.events[0].headers
    traces = Traces({})
    pb, client = asks(answering(traces))
    opens(pb, FIRST)
    pb >> open_failed(-1)  # every server refuses: 502
    pb << CancelTimer(timer=("connect", 1))
    opens(pb, SECOND, conn=-2)
    pb >> open_failed(-2)
    pb << CancelTimer(timer=("connect", 1))
    reply = refuses(pb, client, 502)
    pb.done()
    assert (b"x-trace", b"t1") in reply.events[0].headers
    assert traces.seen == [(502, False)]


def test_a_failure_on_the_proxys_own_answer_sends_it_unchanged() -> None:
    traces = Traces({"fail": True})
    pb, client = asks(answering(Answers({}), traces), logs=True)
    pb << extension_error("on_response_head", "tracer down")
    pb << SetTimer(timer=("send", 1), at=60.0)
    # Not a 503: the answer goes out as it was.
    pb << (reply := Sends(1, client, h1_response(401, end=True)))
    pb << access(401)
    pb << CloseConnection(conn=1)
    pb.done()
    assert not [v for k, v in reply.events[0].headers if k == b"x-trace"]
    assert pb.core.measurements.extension_errors == {("E1", "on_response_head"): 1}


def test_the_backends_head_is_seen_as_the_backends() -> None:
    traces = Traces({})
    pb, client = asks(answering(traces))
    backend = H1BackendPeer()
    opens(pb)
    forwards(pb, backend)
    head = sse_head(pb, client, backend)
    pb.done()
    assert (b"x-trace", b"t1") in head.events[0].headers
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
