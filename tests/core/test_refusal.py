"""The proxy's own refusals say why (``core/exchange/refusal.py``), as conversations: the
``x-muxproxy-reason`` field and the API's own error body for each reason, and the queue's
deadline per priority class (``queue.max_wait``).

Clients are real h11 peers, backends real h11 server peers (the rigs of
``test_routing_exchange`` and ``test_llm_routing``); each conversation asserts every command,
timers included. Time moves only through ``pb.now``.
"""

from __future__ import annotations

import json
from typing import Any

import h11
from checks import h1_body, h1_response
from playbook import Sends, data, wakeup
from test_llm_routing import JSON, Llm, budget_fleet, chat, limited
from test_routing_exchange import CHAT, A, B, Routing, fails_over, fleet, gave_up, no_server

from muxproxy.config import AdmissionQueue, SessionSource
from muxproxy.core.commands import CancelTimer, CloseConnection, SetTimer
from muxproxy.core.exchange.refusal import Reason, body_for

MESSAGES = "/v1/messages"
PRIORITY = SessionSource(kind="header", name="x-priority")


def refused(
    rig: Llm,
    target: str,
    body: bytes | None,
    status: int = 429,
    headers: list[tuple[str, str]] | None = None,
) -> tuple[dict[bytes, bytes], bytes]:
    """A request for ``target`` (a JSON POST of ``body``, or a GET) answered ``status`` at
    once by the proxy: no backend; the fields and the body the client got."""
    pb = rig.pb
    conn, client = rig.connect()
    method, fields = ("GET", headers) if body is None else ("POST", [JSON, *(headers or [])])
    pb >> data(conn, client.request(method, target, fields, body))
    pb << CancelTimer(timer=("header", conn))
    held = body is not None and rig.body_key  # refused once the body was read
    if held:
        pb << SetTimer(timer=("body", conn), at=pb.now + rig.body_gap_s)
    pb << SetTimer(timer=("send", conn), at=pb.now + rig.send_s)
    pb << (answer := Sends(conn, client, h1_response(status, end=True)))
    if held:
        pb << CancelTimer(timer=("body", conn))
    pb << CloseConnection(conn=conn)
    pb.done()
    head = answer.events[0]
    assert isinstance(head, h11.Response)
    return dict(head.headers), h1_body(answer.events)


def waits(rig: Llm, level: str, deadline: float) -> tuple[int, Any]:
    """A chat request of priority class ``level`` waits in the queue until ``deadline``."""
    pb = rig.pb
    conn, client = rig.connect()
    pb >> data(conn, client.request("POST", CHAT, [JSON, ("X-Priority", level)], chat()))
    pb << CancelTimer(timer=("header", conn))
    pb << SetTimer(timer=("queue", conn), at=deadline)
    pb << SetTimer(timer=("body", conn), at=pb.now + rig.body_gap_s)
    pb.done()
    return conn, client


# -- the queue's deadline per priority class ------------------------------------------------


def test_a_low_class_times_out_while_a_high_class_still_waits() -> None:
    queue = AdmissionQueue(max=10, timeout=30, max_wait=((9, 2.0),))
    rig = Llm(limited(A, priority=PRIORITY, queue=queue))
    pb = rig.pb
    up, _ = rig.posted(chat())
    low, low_client = waits(rig, "9", deadline=pb.now + 2)  # its class's max_wait
    high, high_client = waits(rig, "0", deadline=pb.now + 30)  # queue.timeout: not named
    pb.now += 2
    pb >> wakeup("queue", low)
    pb << SetTimer(timer=("send", low), at=pb.now + rig.send_s)
    pb << (answer := Sends(low, low_client, h1_response(429, end=True)))
    pb << CancelTimer(timer=("body", low))
    pb << CloseConnection(conn=low)
    pb.done()
    head = answer.events[0]
    assert dict(head.headers)[b"x-muxproxy-reason"] == b"queue_timeout"
    assert dict(head.headers)[b"retry-after"] == b"1"
    error = json.loads(h1_body(answer.events))["error"]
    assert error["code"] == "queue_timeout" and error["type"] == "requests"
    assert rig.queue_len() == 1  # the high class still waits, past the low one's deadline
    opens = rig.finish(up, admits=high)
    assert opens is not None
    rig.stream(high, high_client, opens, chat())
    assert rig.pb.core.measurements.refusals == {("default", "queue_timeout"): 1}


def test_classes_keep_their_strict_order_whatever_their_deadlines() -> None:
    # The low class's deadline is shorter, not its place: the high class goes first.
    queue = AdmissionQueue(max=10, timeout=5, max_wait=((0, 60.0), (9, 1.0)))
    rig = Llm(limited(A, priority=PRIORITY, queue=queue))
    pb = rig.pb
    up, _ = rig.posted(chat())
    low, _ = waits(rig, "9", deadline=pb.now + 1)
    high, high_client = waits(rig, "0", deadline=pb.now + 60)
    opens = rig.finish(up, admits=high)
    assert opens is not None
    rig.stream(high, high_client, opens, chat())
    assert rig.queue_len() == 1 and low in {e for e in rig.pb.core.exchanges}


# -- one reason each, in its API's shape ----------------------------------------------------


def test_a_full_queue_on_the_messages_api_is_an_anthropic_overloaded_error() -> None:
    rig = Llm(limited(A, queue=AdmissionQueue(max=1, timeout=30, retry_after=3)))
    rig.posted(chat())
    rig.waits(chat())
    fields, body = refused(rig, MESSAGES, chat())
    assert fields[b"x-muxproxy-reason"] == b"queue_full" and fields[b"retry-after"] == b"3"
    assert fields[b"content-type"] == b"application/json"
    document = json.loads(body)
    assert document["type"] == "error"
    assert document["error"]["type"] == "overloaded_error"
    assert "queue is full" in document["error"]["message"]
    assert rig.pb.core.measurements.refusals == {("default", "queue_full"): 1}


def test_the_request_rate_is_rate_limited_in_the_openai_shape() -> None:
    rig = Llm(budget_fleet(requests_per_minute=1))
    key = [("Authorization", "Bearer t1")]
    rig.posted(chat(), key)
    fields, body = refused(rig, CHAT, chat(), headers=key)
    assert fields[b"x-muxproxy-reason"] == b"rate_limited"
    assert fields[b"x-ratelimit-limit-requests"] == b"1" and int(fields[b"retry-after"]) >= 1
    error = json.loads(body)["error"]
    assert error == {
        "message": "rate limit reached: 1 requests per minute",
        "type": "requests",
        "param": None,
        "code": "rate_limited",
    }
    assert rig.pb.core.measurements.refusals == {("default", "rate_limited"): 1}


def test_a_spent_token_budget_is_budget_and_an_anthropic_rate_limit_error() -> None:
    rig = Llm(budget_fleet(tokens_per_minute=1000))
    key = [("Authorization", "Bearer t1")]
    fields, body = refused(rig, MESSAGES, chat(max_tokens=2000), headers=key)
    assert fields[b"x-muxproxy-reason"] == b"budget"
    assert b"retry-after" not in fields  # larger than the whole budget: no wait makes it fit
    assert fields[b"x-ratelimit-limit-tokens"] == b"1000"
    document = json.loads(body)
    assert document["error"]["type"] == "rate_limit_error"
    assert "exceeds the limit of 1000 tokens per minute" in document["error"]["message"]
    rig.posted(chat(max_tokens=600), key)
    fields, body = refused(rig, CHAT, chat(max_tokens=600), headers=key)
    assert fields[b"x-muxproxy-reason"] == b"budget"
    assert json.loads(body)["error"]["type"] == "tokens"  # OpenAI's type for a token limit
    assert rig.pb.core.measurements.refusals == {("default", "budget"): 2}


def test_no_server_is_said_on_the_502_and_the_503_in_each_shape() -> None:
    rig = Routing(fleet(A, B))
    pb = rig.pb
    conn, client, first = rig.ask()
    second = fails_over(rig, first.conn, conn, avoid={first.server})
    # Every try failed, on a chat path: OpenAI's error object.
    gave_up(rig, second.conn, conn, client, 502, no_server("upstream unavailable"))
    # Both servers are down now: 503 at once, no connection opened.
    answers = {}
    for target in ("/generate", MESSAGES, "/v1/responses"):
        conn, client = rig.connect()
        pb >> data(conn, client.request("GET", target))
        pb << CancelTimer(timer=("header", conn))
        pb << SetTimer(timer=("send", conn), at=pb.now + rig.send_s)
        pb << (answer := Sends(conn, client, h1_response(503, end=True)))
        pb << CloseConnection(conn=conn)
        pb.done()
        head = answer.events[0]
        assert dict(head.headers)[b"x-muxproxy-reason"] == b"no_server"
        answers[target] = h1_body(answer.events)
    assert answers["/generate"] == b"no backend available\n"  # no API: the body as before
    anthropic = json.loads(answers[MESSAGES])
    assert anthropic == {
        "type": "error",
        "error": {"type": "api_error", "message": "no backend available"},
    }
    openai = json.loads(answers["/v1/responses"])["error"]
    assert openai["code"] == "no_server" and openai["type"] == "server_error"
    assert rig.pb.core.measurements.refusals == {("default", "no_server"): 4}


def test_an_answer_without_a_reason_keeps_its_body() -> None:
    assert body_for(CHAT.encode(), "upstream timed out", [(b"retry-after", b"1")]) is None
    assert body_for(b"/v1/messages_old", "x", [(b"x-muxproxy-reason", b"budget")]) is None
    shaped = body_for(b"/anthropic/v1/messages?beta=true", "x", [(b"x-muxproxy-reason", b"budget")])
    assert shaped is not None and json.loads(shaped.data)["error"]["type"] == "rate_limit_error"
    assert {reason.value for reason in Reason} == {
        "queue_full",
        "queue_timeout",
        "rate_limited",
        "budget",
        "no_server",
    }
