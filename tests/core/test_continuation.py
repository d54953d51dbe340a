"""Continuation (``continue_on_failure``) in the sans-IO core, driven with bytes only."""

from __future__ import annotations

import json

import attrs
import h11
from playbook import H1BackendPeer, H1ClientPeer, Playbook

from muxproxy.config import Config, Route, quick_config
from muxproxy.core.commands import CloseConnection, Command, OpenConnection
from muxproxy.core.streams.continuation import AnswerSoFar, Splicer

BODY = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 9}
).encode()


def chunk(content: str | None = None, *, role: bool = False, finish: str | None = None) -> bytes:
    delta: dict[str, str] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    body = {
        "id": "c-1",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def two_servers() -> Config:
    config = quick_config("127.0.0.1:8080", ["127.0.0.1:9001", "127.0.0.1:9002"])
    route = Route(prefix="/", upstream="default", continue_on_failure=True)
    return attrs.evolve(config, routes=(route,))


def start(pb: Playbook) -> tuple[H1ClientPeer, int, H1BackendPeer]:
    client = H1ClientPeer()
    pb.accept(1)
    pb.receive(1, client.request("POST", "/v1/chat/completions", body=BODY))
    up = pb.opens()[0].conn
    pb.opened(up)
    pb.sent(up, len(pb.take(up)))
    backend = H1BackendPeer()
    backend.events(pb.take(up))
    pb.receive(up, backend.sse_head())
    return client, up, backend


def opens(commands: list[Command]) -> list[OpenConnection]:
    return [c for c in commands if isinstance(c, OpenConnection)]


def test_a_broken_answer_goes_to_the_next_server_with_the_text_so_far() -> None:
    pb = Playbook(two_servers())
    client, up, backend = start(pb)
    pb.receive(up, backend.chunk(chunk("", role=True) + chunk("tok0 ") + chunk("tok1 ")))
    broken = pb.closed(up, "reset")
    (again,) = opens(broken)
    assert again.origin != pb.opens()[0].origin  # another server
    pb.opened(again.conn)
    second = H1BackendPeer()
    request, *rest = second.events(pb.take(again.conn))
    sent = json.loads(b"".join(e.data for e in rest if isinstance(e, h11.Data)))
    assert sent["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 "}
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    assert sent["max_tokens"] == 7
    assert (b"content-length", str(len(json.dumps(sent, separators=(",", ":")))).encode()) in (
        request.headers
    )
    head = pb.receive(again.conn, second.sse_head())
    assert pb.take(1, head) == b""  # the client never sees a second head
    more = pb.receive(again.conn, second.chunk(chunk("", role=True) + chunk("tok2 ")))
    out = b"".join(e.data for e in client.events(pb.take(1)) if isinstance(e, h11.Data))
    assert out.count(b'"role"') == 1  # the first stream's, not the continuation's
    assert b'"content":"tok2 "' in pb.take(1, more) and b'"id":"c-1"' in pb.take(1, more)


def test_a_finished_answer_is_not_continued() -> None:
    pb = Playbook(two_servers())
    _, up, backend = start(pb)
    pb.receive(up, backend.chunk(chunk("tok0 ") + chunk(finish="stop")))
    broken = pb.closed(up, "reset")
    assert opens(broken) == []
    assert any(isinstance(c, CloseConnection) and c.conn == 1 for c in pb.log)


def test_an_answer_cut_after_its_last_token_is_ended_by_the_proxy_with_no_new_backend() -> None:
    pb = Playbook(two_servers())
    client, up, backend = start(pb)
    tokens = b"".join(chunk(f"tok{n} ") for n in range(9))  # max_tokens = 9: all of them
    pb.receive(up, backend.chunk(chunk("", role=True) + tokens))
    client.events(pb.take(1))
    ended = pb.closed(up, "reset")  # the finish chunk and [DONE] never came
    assert opens(ended) == []  # no server is asked for a tenth token
    events = client.events(pb.take(1, ended))
    out = b"".join(e.data for e in events if isinstance(e, h11.Data))
    finish, done = out.split(b"\n\n")[:2]
    assert json.loads(finish.removeprefix(b"data: "))["choices"] == [
        {"index": 0, "delta": {}, "finish_reason": "length"}
    ]
    assert b'"id":"c-1"' in finish and b'"model":"m"' in finish
    assert done == b"data: [DONE]"
    assert any(isinstance(e, h11.EndOfMessage) for e in events)  # a clean end, not a cut
    assert not any(isinstance(c, CloseConnection) and c.conn == 1 for c in pb.log)


def test_an_answer_cut_one_token_short_still_goes_to_the_next_server() -> None:
    pb = Playbook(two_servers())
    _, up, backend = start(pb)
    tokens = b"".join(chunk(f"tok{n} ") for n in range(8))  # 8 of 9
    pb.receive(up, backend.chunk(chunk("", role=True) + tokens))
    (again,) = opens(pb.closed(up, "reset"))
    pb.opened(again.conn)
    _, *rest = H1BackendPeer().events(pb.take(again.conn))
    sent = json.loads(b"".join(e.data for e in rest if isinstance(e, h11.Data)))
    assert sent["max_tokens"] == 1


def test_a_continuation_answered_with_an_error_leaves_the_truncation_visible() -> None:
    pb = Playbook(two_servers())
    _, up, backend = start(pb)
    pb.receive(up, backend.chunk(chunk("tok0 ")))
    (again,) = opens(pb.closed(up, "reset"))
    pb.opened(again.conn)
    second = H1BackendPeer()
    second.events(pb.take(again.conn))
    refused = pb.receive(again.conn, second.reply(b"busy"))  # a 200 that is not SSE
    assert any(isinstance(c, CloseConnection) and c.conn == again.conn for c in refused)
    assert opens(refused) == []  # the two servers are spent: no third try
    assert any(isinstance(c, CloseConnection) and c.conn == 1 for c in pb.log)


def test_the_splicer_keeps_one_role_and_the_original_names() -> None:
    answer = AnswerSoFar({"messages": [], "stream": True})
    answer.feed(chunk("", role=True) + chunk("a"))
    splicer = Splicer(answer)
    other = chunk("", role=True).replace(b'"c-1"', b'"c-2"') + chunk("b", role=True)
    out = splicer.feed(other.replace(b'"created": 1', b'"created": 5'))
    (event,) = out.strip().split(b"\n\n")
    spliced = json.loads(event[len(b"data: ") :])
    assert spliced["id"] == "c-1" and spliced["created"] == 1
    assert spliced["choices"][0]["delta"] == {"content": "b"}
