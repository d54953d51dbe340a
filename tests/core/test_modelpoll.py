"""``core/upstream/modelpoll.py`` and the proxy's own ``GET /v1/models`` as whole
conversations: bytes in, commands out.

The rules under test: a group with ``learn_models`` has each server's ``/v1/models`` read
over a pooled backend connection every ``models_refresh``; a client's ``GET /v1/models`` is
then answered by the proxy, no backend asked; a poll that fails or brings what is not a model
list keeps the last good list, is logged once (not at every poll) and shows in ``/status``;
an extension's request-head hook runs first (one that authenticates guards the list); a group
that neither lists nor learns models leaves ``GET /v1/models`` to its backend, as before.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import h11
from playbook import (
    BACKEND,
    H1BackendPeer,
    H1ClientPeer,
    Playbook,
    data,
    default_config,
    opened,
    wakeup,
)

from muxproxy.config import Config, Server, Upstream
from muxproxy.config.extensions import ExtensionConfig
from muxproxy.core.commands import Command, Log, OpenConnection, SetTimer
from muxproxy.core.events import ConfigChanged
from muxproxy.extensions import Answer, Decision, Extension, Request

LIST = json.dumps(
    {
        "object": "list",
        "data": [
            {"id": "llama-3.1-8b", "object": "model", "created": 1, "owned_by": "vllm"},
            {"id": "sql-lora", "object": "model", "created": 2, "owned_by": "vllm"},
        ],
    }
).encode()


def learning(*extensions: Extension) -> Config:
    group = Upstream(
        name="default", servers=(Server(address=BACKEND),), learn_models=True, models_refresh=30.0
    )
    config = default_config(upstreams={"default": group})
    entries = tuple(ExtensionConfig(module=f"t:E{i}", instance=e) for i, e in enumerate(extensions))
    return attrs.evolve(config, extensions=entries)


def polls(commands: list[Command]) -> list[dict[str, Any]]:
    return [c.fields for c in commands if isinstance(c, Log) and c.event == "models_poll"]


def first_poll(pb: Playbook, backend: H1BackendPeer) -> None:
    pb >> ConfigChanged(now=pb.now, config=pb.core.config)
    assert SetTimer(timer=("probe", 1), at=0.0) in pb.rest()
    pb >> wakeup("probe", 1)
    assert any(isinstance(c, OpenConnection) for c in pb.rest())
    pb >> opened(-1)
    (request, _) = backend.events(pb.take(-1, pb.rest()))
    assert isinstance(request, h11.Request)
    assert request.method == b"GET" and request.target == b"/v1/models"
    assert (b"user-agent", b"muxproxy-models") in request.headers


def next_poll(pb: Playbook, backend: H1BackendPeer, answer: bytes) -> list[dict[str, Any]]:
    """The next poll over the pooled connection, answered 200 with ``answer``."""
    backend.conn.start_next_cycle()
    pb.now += 30.0
    pb >> wakeup("probe", 1)
    sent = pb.rest()
    assert not any(isinstance(c, OpenConnection) for c in sent)
    assert backend.events(pb.take(-1, sent))[0].target == b"/v1/models"
    pb >> data(-1, backend.reply(answer))
    return polls(pb.rest())


def client_get(pb: Playbook, conn: int, target: str) -> tuple[h11.Response, bytes]:
    client = H1ClientPeer()
    pb.accept(conn)
    pb >> data(conn, client.request("GET", target))
    commands = pb.rest()
    assert not any(isinstance(c, OpenConnection) for c in commands)  # no backend asked
    events = client.events(pb.take(conn, commands))
    response, body = events[0], b"".join(e.data for e in events if isinstance(e, h11.Data))
    assert isinstance(response, h11.Response)
    return response, body


def test_learnt_models_answer_clients_and_a_bad_poll_keeps_the_last_good_list() -> None:
    pb = Playbook(learning(), ignore=())
    backend = H1BackendPeer()
    first_poll(pb, backend)
    pb >> data(-1, backend.reply(LIST))
    assert polls(pb.rest()) == [
        {"upstream": "default", "server": BACKEND, "ok": True, "models": 2, "detail": "ok"}
    ]
    response, body = client_get(pb, 7, "/v1/models")
    assert response.status_code == 200
    assert (b"content-type", b"application/json") in response.headers
    assert [m["id"] for m in json.loads(body)["data"]] == ["llama-3.1-8b", "sql-lora"]

    bad = next_poll(pb, backend, b"<html>Not Found</html>")
    assert [(p["ok"], p["models"]) for p in bad] == [(False, 2)]  # the old list stands
    assert bad[0]["detail"].startswith("unreadable model list: not JSON")
    assert next_poll(pb, backend, b'{"data": 1}') == []  # still failing: not logged again
    response, body = client_get(pb, 9, "/v1/models/sql-lora")
    assert (response.status_code, json.loads(body)["owned_by"]) == (200, "vllm")
    server = pb.core.status()["groups"]["default"]["models"]["servers"][BACKEND]
    assert server["models"] == ["llama-3.1-8b", "sql-lora"]
    assert server["last_error"] == 'unreadable model list: not a model list: no "data" array'

    recovered = next_poll(pb, backend, LIST)
    assert [(p["ok"], p["models"]) for p in recovered] == [(True, 2)]


def test_an_unknown_model_is_404_model_not_found() -> None:
    pb = Playbook(learning(), ignore=())
    backend = H1BackendPeer()
    first_poll(pb, backend)
    pb >> data(-1, backend.reply(LIST))
    pb.rest()
    response, body = client_get(pb, 7, "/v1/models/gpt-nothing")
    assert response.status_code == 404
    assert json.loads(body)["error"]["code"] == "model_not_found"


def test_without_models_listed_or_learnt_the_backend_answers_as_before() -> None:
    group = Upstream(name="default", servers=(Server(address=BACKEND),))
    pb = Playbook(default_config(upstreams={"default": group}), ignore=())
    pb >> ConfigChanged(now=pb.now, config=pb.core.config)
    assert not any(isinstance(c, SetTimer) for c in pb.rest())  # nothing polled
    client = H1ClientPeer()
    pb.accept(7)
    pb >> data(7, client.request("GET", "/v1/models"))
    assert [c.origin.port for c in pb.rest() if isinstance(c, OpenConnection)] == [9001]
    assert pb.core.status()["groups"]["default"]["models"] == {"source": "none", "models": []}


class KeyRequired(Extension):
    def on_request_head(self, request: Request) -> Decision | None:
        if request.header("Authorization") is None:
            return Decision(answer=Answer(status=401, message="no key"))
        return None


def test_an_extension_that_authenticates_guards_the_list() -> None:
    pb = Playbook(learning(KeyRequired({})), ignore=())
    backend = H1BackendPeer()
    first_poll(pb, backend)
    pb >> data(-1, backend.reply(LIST))
    pb.rest()
    response, _ = client_get(pb, 7, "/v1/models")
    assert response.status_code == 401
    client = H1ClientPeer()
    pb.accept(9)
    pb >> data(9, client.request("GET", "/v1/models", [("Authorization", "Bearer k")]))
    events = client.events(pb.take(9, pb.rest()))
    assert events[0].status_code == 200
