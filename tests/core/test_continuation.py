"""Continuation (``continue_on_failure``) in the sans-IO core, driven with bytes only.

Real h11 peers on both sides; each test is a conversation: every command asserted in order,
timers included."""

from __future__ import annotations

import json
from typing import Any

import attrs
import h11
from checks import h1_body, h1_request, h1_response
from playbook import H1BackendPeer, H1ClientPeer, Playbook, Sends, closed, data, opened, sent

from muxproxy.config import Config, Route, quick_config
from muxproxy.core.commands import CancelTimer, CloseConnection, OpenConnection, Origin, SetTimer
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


NEXT = Origin(host="127.0.0.1", port=9002)


def start(pb: Playbook) -> tuple[H1ClientPeer, int, H1BackendPeer]:
    """Client 1 posts ``BODY``; the first server (backend connection -1) takes it whole and
    answers with an SSE head, which goes out to the client."""
    client = H1ClientPeer()
    pb.accept(1)
    pb >> data(1, client.request("POST", "/v1/chat/completions", body=BODY))
    pb << CancelTimer(timer=("header", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-1, origin=Origin(host="127.0.0.1", port=9001))
    pb << SetTimer(timer=("body", 1), at=30.0)
    backend = H1BackendPeer()
    pb >> opened(-1)
    pb << CancelTimer(timer=("connect", 1))
    pb << (request := Sends(-1, backend, h1_request(b"POST", b"/v1/chat/completions", BODY)))
    pb << SetTimer(timer=("head", 1), at=60.0)
    pb >> sent(-1, len(request.data))
    pb >> data(-1, backend.sse_head())
    pb << CancelTimer(timer=("head", 1))
    pb << SetTimer(timer=("send", 1), at=60.0)
    pb << Sends(1, client, h1_response(200))
    pb << SetTimer(timer=("read", 1), at=300.0)
    return client, -1, backend


def streams(pb: Playbook, backend: H1BackendPeer, client: H1ClientPeer, events: bytes) -> None:
    """The backend on -1 sends ``events`` in one chunk; the client gets exactly them."""
    pb >> data(-1, backend.chunk(events))
    pb << Sends(1, client, lambda got: h1_body(got) == events)


def continues(pb: Playbook) -> H1BackendPeer:
    """The first backend resets mid-answer: the exchange goes on with the second server
    (backend connection -2) under the read deadline, which accepts; returns its peer."""
    pb >> closed(-1, "reset")
    pb << CancelTimer(timer=("read", 1))
    pb << SetTimer(timer=("connect", 1), at=5.0)
    pb << OpenConnection(conn=-2, origin=NEXT)  # another server
    pb << CancelTimer(timer=("connect", 1))
    pb << SetTimer(timer=("read", 1), at=300.0)
    return H1BackendPeer()


def continuation(pb: Playbook, second: H1BackendPeer) -> tuple[h11.Request, dict[str, Any]]:
    """The second server accepts and reads the continuation request: its head and body."""
    pb >> opened(-2)
    pb << (request := Sends(-2, second, h1_request(b"POST", b"/v1/chat/completions")))
    head = request.events[0]
    assert isinstance(head, h11.Request)
    return head, json.loads(h1_body(request.events))


def test_a_broken_answer_goes_to_the_next_server_with_the_text_so_far() -> None:
    pb = Playbook(two_servers())
    client, _, backend = start(pb)
    streams(pb, backend, client, chunk("", role=True) + chunk("tok0 ") + chunk("tok1 "))
    second = continues(pb)
    request, asked = continuation(pb, second)
    assert asked["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 "}
    assert asked["continue_final_message"] is True and asked["add_generation_prompt"] is False
    assert asked["max_tokens"] == 7
    assert (b"content-length", str(len(json.dumps(asked, separators=(",", ":")))).encode()) in (
        request.headers
    )
    pb >> data(-2, second.sse_head())  # the client never sees a second head: nothing goes out
    pb >> data(-2, second.chunk(chunk("", role=True) + chunk("tok2 ")))
    pb << (more := Sends(1, client))
    pb.done()
    out = h1_body(more.events)
    assert b'"role"' not in out  # the first stream's role only, not the continuation's
    assert b'"content":"tok2 "' in out and b'"id":"c-1"' in out


def ended_here(pb: Playbook, client: H1ClientPeer) -> bytes:
    """The first backend resets; the proxy ends the answer itself, no server asked, and the
    client's connection stays (a clean end, not a cut); returns the body bytes it sent."""
    pb >> closed(-1, "reset")
    pb << CancelTimer(timer=("read", 1))
    pb << (ended := Sends(1, client))
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)
    pb.done()
    assert isinstance(ended.events[-1], h11.EndOfMessage)
    return h1_body(ended.events)


def test_a_finished_answer_cut_before_its_done_is_ended_by_the_proxy() -> None:
    # The finish chunk came, [DONE] did not: the answer is whole, no other server is asked
    # for it and the client gets the [DONE] it lacks (once a cut: a demo's stream failed).
    pb = Playbook(two_servers())
    client, _, backend = start(pb)
    streams(pb, backend, client, chunk("tok0 ") + chunk(finish="stop"))
    assert ended_here(pb, client) == b"data: [DONE]\n\n"


def test_an_answer_cut_after_its_done_is_ended_with_nothing_added() -> None:
    pb = Playbook(two_servers())
    client, _, backend = start(pb)
    streams(pb, backend, client, chunk("tok0 ") + chunk(finish="stop") + b"data: [DONE]\n\n")
    assert ended_here(pb, client) == b""


def test_an_answer_cut_inside_an_event_after_its_finish_is_cut_for_the_client() -> None:
    # Half a usage chunk went out: nothing the proxy adds could mend it, and no other server
    # is asked for a finished answer.
    pb = Playbook(two_servers())
    client, _, backend = start(pb)
    streams(pb, backend, client, chunk("tok0 ") + chunk(finish="stop") + b'data: {"usa')
    pb >> closed(-1, "reset")
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << CloseConnection(conn=1)
    pb.done()


def test_an_answer_cut_after_its_last_token_is_ended_by_the_proxy_with_no_new_backend() -> None:
    pb = Playbook(two_servers())
    client, _, backend = start(pb)
    tokens = b"".join(chunk(f"tok{n} ") for n in range(9))  # max_tokens = 9: all of them
    streams(pb, backend, client, chunk("", role=True) + tokens)
    pb >> closed(-1, "reset")  # the finish chunk and [DONE] never came
    pb << CancelTimer(timer=("read", 1))
    pb << (ended := Sends(1, client))  # no server is asked for a tenth token
    pb << CancelTimer(timer=("body", 1))
    pb << SetTimer(timer=("idle", 1), at=75.0)  # a clean end, not a cut: the client stays
    pb.done()
    finish, done = h1_body(ended.events).split(b"\n\n")[:2]
    assert json.loads(finish.removeprefix(b"data: "))["choices"] == [
        {"index": 0, "delta": {}, "finish_reason": "length"}
    ]
    assert b'"id":"c-1"' in finish and b'"model":"m"' in finish
    assert done == b"data: [DONE]"
    assert isinstance(ended.events[-1], h11.EndOfMessage)


def test_an_answer_cut_one_token_short_still_goes_to_the_next_server() -> None:
    pb = Playbook(two_servers())
    client, _, backend = start(pb)
    tokens = b"".join(chunk(f"tok{n} ") for n in range(8))  # 8 of 9
    streams(pb, backend, client, chunk("", role=True) + tokens)
    _, asked = continuation(pb, continues(pb))
    pb.done()
    assert asked["max_tokens"] == 1


def test_a_continuation_answered_with_an_error_leaves_the_truncation_visible() -> None:
    pb = Playbook(two_servers())
    client, _, backend = start(pb)
    streams(pb, backend, client, chunk("tok0 "))
    second = continues(pb)
    continuation(pb, second)
    pb >> data(-2, second.reply(b"busy"))  # a 200 that is not SSE
    pb << CloseConnection(conn=-2)
    pb << CancelTimer(timer=("read", 1))
    pb << CancelTimer(timer=("body", 1))
    pb << CloseConnection(conn=1)  # the two servers are spent: no third try, a visible cut
    pb.done()


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
