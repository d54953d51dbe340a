"""Routing by the body's model and model aliases inside the core (``core/exchange/bymodel.py``),
as conversations: the group that serves the model, the API's own 404 for a model none
serves, 400 for a repeated model, a body without a model routed by path, an alias's target
written into the body (Content-Length with it), kept per conversation and moved by runtime
weights.

Clients are real h11 peers, backends real h11 server peers; each conversation asserts every
command, timers included (``Routing`` of ``test_routing_exchange``).
"""

from __future__ import annotations

import json
from typing import Any

import h11
from checks import h1_body, h1_response
from playbook import H1ClientPeer, H2ClientPeer, Playbook, Sends, Where, data, default_config
from resume_setup import Stream, body_of
from test_routing_exchange import CHAT, A, B, Opens, Routing

from muxproxy.config import Limits, Resume, Route, Server, SessionSource, Sticky, Upstream
from muxproxy.config.extensions import ExtensionConfig
from muxproxy.config.records import ModelAlias, ModelTarget
from muxproxy.config.runtime import RuntimeState
from muxproxy.core.commands import CancelTimer, CloseConnection, ExtensionCall, SetTimer
from muxproxy.core.events import ExtensionAnswered, RuntimeChanged
from muxproxy.core.exchange.bymodel import model_not_found
from muxproxy.core.ports import Phase
from muxproxy.extensions import Decision, Extension, Request

MESSAGES = "/v1/messages"
JSON = ("Content-Type", "application/json")
STICKY = Sticky(sources=(SessionSource(kind="header", name="x-chat-id"),))


def by_model(
    *, fallback: bool = False, aliases: bool = True, extra: tuple[Route, ...] = (), **config: Any
) -> Routing:
    """Group ``default`` (A) serves ``llama-v1*``, group ``big`` (B) serves ``llama-v2``;
    ``fallback``: a route without models sends the rest to ``default``; the alias
    ``chat-default`` stands for both, 9 to 1."""
    groups = {
        "default": Upstream(
            name="default", servers=(Server(address=A),), pool_max_idle=0, sticky=STICKY
        ),
        "big": Upstream(name="big", servers=(Server(address=B),), pool_max_idle=0, sticky=STICKY),
    }
    routes = [
        Route(prefix="/", upstream="default", models=("llama-v1*",)),
        Route(prefix="/", upstream="big", models=("llama-v2",)),
    ]
    if fallback:
        routes.append(Route(prefix="/", upstream="default"))
    routes.extend(extra)
    alias = ModelAlias(
        name="chat-default",
        targets=(ModelTarget(model="llama-v1", weight=9), ModelTarget(model="llama-v2", weight=1)),
    )
    rig = Routing(
        default_config(
            upstreams=groups,
            routes=tuple(routes),
            models={"chat-default": alias} if aliases else {},
            **config,
        )
    )
    rig.body_key = True  # the body is held (for its model) before the route is known
    return rig


def chat(model: str | None, **extra: Any) -> bytes:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], **extra}
    if model is not None:
        body = {"model": model, **body}
    return json.dumps(body).encode()


def routed(
    rig: Routing,
    body: bytes,
    *,
    to: str,
    headers: list[tuple[str, str]] | None = None,
    target: str = CHAT,
) -> tuple[int, H1ClientPeer, Opens]:
    return rig.ask(target, [JSON, *(headers or [])], body, to=to)


def sent(rig: Routing, conn: int, client: H1ClientPeer, opens: Opens) -> h11.Request:
    """The backend gets the request and answers; returns what it got (its body checked by
    h11 against its Content-Length)."""
    request = rig.accept(opens.conn, conn, lambda events: None)
    rig.reply(opens.conn, conn, client, posted=True)
    return request  # type: ignore[return-value]


def refused(
    rig: Routing, body: bytes, status: int, *, target: str = CHAT
) -> tuple[h11.Response, bytes]:
    """A POST of ``body`` answered by the proxy itself with ``status``: no backend."""
    pb = rig.pb
    conn, client = rig.connect()
    pb >> data(conn, client.request("POST", target, [JSON], body))
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("body", conn), at=pb.now + rig.body_gap_s)
    pb << SetTimer(timer=("send", conn), at=pb.now + rig.send_s)
    pb << (answer := Sends(conn, client, h1_response(status, end=True)))
    pb << CancelTimer(timer=("body", conn))
    pb << CloseConnection(conn=conn)
    pb.done()
    head = answer.events[0]
    assert isinstance(head, h11.Response)
    return head, h1_body(answer.events)


def backend_body(rig: Routing, conn: int, client: H1ClientPeer, opens: Opens) -> bytes:
    """The backend gets the request of ``conn`` whole and answers; returns its body (h11
    has checked it against the request's Content-Length)."""
    request = rig.accept(opens.conn, conn, lambda events: None)
    rig.reply(opens.conn, conn, client, posted=True)
    return h1_body(request.events)


def test_each_model_goes_to_the_group_that_serves_it_by_name_or_glob() -> None:
    rig = by_model()
    for model, server in (("llama-v2", B), ("llama-v1", A), ("llama-v1-instruct", A)):
        body = chat(model)
        conn, client, opens = rig.ask(CHAT, [JSON], body, to=server)
        assert backend_body(rig, conn, client, opens) == body


def test_a_model_no_route_serves_is_the_api_s_own_404() -> None:
    rig = by_model()
    head, body = refused(rig, chat("gpt-4o"), 404)
    assert (b"content-type", b"application/json") in head.headers
    assert json.loads(body) == {
        "error": {
            "message": "The model `gpt-4o` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    head, body = refused(rig, chat("claude-x", max_tokens=5), 404, target=MESSAGES)
    assert json.loads(body) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "model: claude-x"},
    }
    assert (
        model_not_found(b"/v1/embeddings", "e").data
        == json.dumps(
            {
                "error": {
                    "message": "The model `e` does not exist or you do not have access to it.",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            }
        ).encode()
    )


def test_a_model_no_route_with_models_serves_takes_the_route_without() -> None:
    rig = by_model(fallback=True)
    conn, client, opens = rig.ask(CHAT, [JSON], chat("gpt-4o"), to=A)
    assert json.loads(backend_body(rig, conn, client, opens))["model"] == "gpt-4o"


def test_a_body_without_a_model_is_routed_by_path_skipping_routes_with_models() -> None:
    rig = by_model()
    _, body = refused(rig, chat(None), 404)
    assert body == b"no route for this path\n"
    rig = by_model(fallback=True)
    conn, client, opens = rig.ask(CHAT, [JSON], b"not json", to=A)
    assert backend_body(rig, conn, client, opens) == b"not json"


def test_a_body_that_names_its_model_twice_is_refused_400() -> None:
    rig = by_model(fallback=True)
    body = b'{"model": "llama-v1", "messages": [], "model": "llama-v2"}'
    _, answer = refused(rig, body, 400)
    error = json.loads(answer)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "model"
    _, answer = refused(rig, body, 400, target=MESSAGES)
    assert json.loads(answer)["error"]["type"] == "invalid_request_error"


def alias_target(rig: Routing, chat_id: str, to: str | None = None) -> str:
    """A request naming the alias in conversation ``chat_id``: the model its backend got
    (its server must be that model's group's, and h11 checks the new Content-Length)."""
    body = chat("chat-default", stream=True)
    conn, client, opens = rig.ask(CHAT, [JSON, ("X-Chat-ID", chat_id)], body, to=to)
    got = json.loads(backend_body(rig, conn, client, opens))
    assert opens.server == {"llama-v1": A, "llama-v2": B}[got["model"]]
    assert got == {**json.loads(body), "model": got["model"]}  # nothing else changed
    return str(got["model"])


def test_an_alias_picks_a_target_per_conversation_and_rewrites_the_body() -> None:
    rig = by_model()
    chosen = {f"c{i}": alias_target(rig, f"c{i}") for i in range(30)}
    assert set(chosen.values()) == {"llama-v1", "llama-v2"}  # 9 to 1 over 30 conversations
    for chat_id, model in list(chosen.items())[:10]:
        assert alias_target(rig, chat_id) == model  # each keeps its version


def test_runtime_weights_move_new_choices_of_an_alias() -> None:
    rig = by_model()
    state = RuntimeState.empty().models_changed("chat-default", {"llama-v1": 0, "llama-v2": 5})
    rig.pb >> RuntimeChanged(now=rig.pb.now, state=state)
    rig.pb.done()
    assert {alias_target(rig, f"c{i}", to=B) for i in range(10)} == {"llama-v2"}
    status = rig.pb.core.status()["models"]["chat-default"]["targets"]
    assert status == [
        {"model": "llama-v1", "configured_weight": 9, "runtime_weight": 0, "weight": 0},
        {"model": "llama-v2", "configured_weight": 1, "runtime_weight": 5, "weight": 5},
    ]


class Waits(Extension):
    async def on_request_head_async(self, request: Request) -> Decision | None:
        raise AssertionError("the test answers for the driver")


def test_an_async_hook_runs_once_the_body_s_model_found_the_route() -> None:
    extension = ExtensionConfig(module="tests:Waits", instance=Waits({}))
    rig = by_model(extensions=(extension,))
    pb = rig.pb
    conn, client = rig.connect()
    calls: list[ExtensionCall] = []
    pb >> data(conn, client.request("POST", CHAT, [JSON], chat("llama-v2")))
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("body", conn), at=pb.now + rig.body_gap_s)
    pb << Where(ExtensionCall, lambda call: calls.append(call) is None)
    pb.done()
    (exchange,) = pb.core.exchanges.values()
    assert exchange.phase is Phase.AWAITING_HOOK
    assert calls[0].view.group == "big"  # the hook sees the route the model chose
    call = calls[0]
    pb >> (
        lambda now: ExtensionAnswered(
            now=now, request=call.request, position=call.position, decision=None, error=""
        )
    )
    opens = rig.attempt(conn, to=B)
    assert backend_body(rig, conn, client, opens) == chat("llama-v2")


def test_a_chunked_body_is_routed_once_its_object_ends_and_goes_on_chunked() -> None:
    rig = by_model()
    pb = rig.pb
    conn, client = rig.connect()
    body = chat("chat-default")
    fields = [("Host", "p"), JSON, ("Transfer-Encoding", "chunked"), ("X-Chat-ID", "c1")]
    head = client.conn.send(h11.Request(method="POST", target=CHAT, headers=fields)) or b""
    cut = body.index(b"messages")  # past the model's value: a repeat could still come
    pb >> data(conn, head + (client.conn.send(h11.Data(data=body[:cut])) or b""))
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("body", conn), at=pb.now + rig.body_gap_s)
    pb.done()  # the model is read, the object has not ended: nothing opened yet
    pb >> data(conn, client.conn.send(h11.Data(data=body[cut:])) or b"")
    opens = rig.attempt(conn)
    pb.done()
    pb >> data(conn, client.conn.send(h11.EndOfMessage()) or b"")
    pb.done()
    request = rig.accept(opens.conn, conn, lambda events: None)
    got = json.loads(h1_body(request.events))
    assert opens.server == {"llama-v1": A, "llama-v2": B}[got["model"]]
    (head_event,) = [e for e in request.events if isinstance(e, h11.Request)]
    names = {name.lower() for name, _ in head_event.headers}
    assert b"transfer-encoding" in names and b"content-length" not in names


def test_an_alias_in_a_body_longer_than_is_read_keeps_its_declared_length_right() -> None:
    # The model is found in the first max_route_body bytes while the rest of a sized body
    # is still to come: its Content-Length moves by what the rewrite added, not to the
    # length of the part held (the backend would get more than declared).
    rig = by_model(limits=Limits(max_route_body=128))
    pb = rig.pb
    conn, client = rig.connect()
    body = chat("chat-default", padding="x" * 400)
    fields = [("Host", "p"), JSON, ("Content-Length", str(len(body))), ("X-Chat-ID", "c1")]
    head = client.conn.send(h11.Request(method="POST", target=CHAT, headers=fields)) or b""
    cut = 200  # past the limit: the model is read, the body goes on
    pb >> data(conn, head + (client.conn.send(h11.Data(data=body[:cut])) or b""))
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("body", conn), at=pb.now + rig.body_gap_s)
    opens = rig.attempt(conn)
    pb.done()
    pb >> data(conn, client.conn.send(h11.Data(data=body[cut:])) or b"")
    pb.done()
    request = rig.accept(opens.conn, conn, lambda events: None)
    sent_body = h1_body(request.events)  # h11 checked it against its Content-Length
    got = json.loads(sent_body)
    assert got == {**json.loads(body), "model": got["model"]}  # whole, the model rewritten
    assert opens.server == {"llama-v1": A, "llama-v2": B}[got["model"]]
    (head_event,) = [e for e in request.events if isinstance(e, h11.Request)]
    assert (b"content-length", str(len(sent_body)).encode()) in head_event.headers


def test_an_h2_request_naming_an_alias_reaches_its_target_with_its_new_length() -> None:
    rig = by_model()
    pb = rig.pb
    conn, _ = rig.connect()
    client = H2ClientPeer()
    body = chat("chat-default")
    fields = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-chat-id", b"c1"),
    ]
    _, request = client.request(b"POST", CHAT.encode(), headers=fields, body=body)
    pb >> data(conn, client.preface() + request)
    pb << SetTimer(timer=("send", conn), at=pb.now + rig.send_s)
    pb << Sends(conn, client)  # the proxy's SETTINGS
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("body", conn), at=pb.now + rig.body_gap_s)
    opens = rig.attempt(conn)
    pb << Sends(conn, client)  # the SETTINGS ack
    request_sent = rig.accept(opens.conn, conn, lambda events: None)
    sent_body = h1_body(request_sent.events)  # h11 checked it against its Content-Length
    got = json.loads(sent_body)
    assert opens.server == {"llama-v1": A, "llama-v2": B}[got["model"]]
    (head_event,) = [e for e in request_sent.events if isinstance(e, h11.Request)]
    assert (b"content-length", str(len(sent_body)).encode()) in head_event.headers
    assert len(sent_body) != len(body)


def test_a_body_too_long_to_find_its_model_is_routed_by_path() -> None:
    rig = by_model(fallback=True, limits=Limits(max_route_body=64))
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 100}], "model": "llama-v2"})
    conn, client, opens = rig.ask(CHAT, [JSON], body.encode(), to=A)  # not B: by path
    assert backend_body(rig, conn, client, opens) == body.encode()


def test_a_path_whose_route_no_model_can_change_is_not_held_for_its_body() -> None:
    plain = Route(prefix="/v1/chat/", upstream="big")  # longer than the routes with models
    rig = by_model(aliases=False, extra=(plain,))
    rig.body_key = False  # routed from the head: the connect comes before the body timer
    conn, client, opens = rig.ask(CHAT, [JSON], chat("llama-v1"), to=B)
    assert json.loads(backend_body(rig, conn, client, opens))["model"] == "llama-v1"
    rig.body_key = True  # the same model elsewhere is read first, and routed by it
    conn, client, opens = rig.ask("/v1/completions", [JSON], chat("llama-v1"), to=A)
    backend_body(rig, conn, client, opens)


def test_a_post_routed_by_its_model_resumes_the_stream_its_route_kept() -> None:
    # The route (with ``resume``) is known once the body names the model; a POST re-sent with
    # the id of the last event it had is answered from the kept stream, BUFFERING -> REPLAY,
    # and no backend is asked for a second answer.
    routes = (
        Route(prefix="/", upstream="default", models=("m",), resume=Resume()),
        Route(prefix="/", upstream="default"),
    )
    pb = Playbook(default_config(routes=routes))
    first = Stream(pb, body=chat("m"))
    first.send(b"data: a\n\n")
    first.send(b"data: b\n\n")
    opened = len(pb.opens())
    client = H1ClientPeer()
    pb.accept(2)
    first_id = first.last_id()[:-1].decode() + "1"
    headers = [("Accept", "text/event-stream"), ("Last-Event-ID", first_id)]
    commands = pb.receive(2, client.request("POST", "/v1/chat/completions", headers, chat("m")))
    replayed = body_of(client, pb, 2, commands)
    assert replayed.startswith(b"data: b\nid: ") and b"data: a" not in replayed
    assert len(pb.opens()) == opened  # no backend asked
    assert pb.core.resumes.resumed == 1
