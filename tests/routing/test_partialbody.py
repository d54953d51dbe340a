"""Facts read from the first bytes of a body held only in part (``routing/partialbody.py``)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from muxproxy.routing.llmrequest import read_request
from muxproxy.routing.partialbody import leading_document

SYSTEM = "You are a careful assistant. " * 60


def conversation(first: str, turns: int, **fields: object) -> dict[str, object]:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": first},
    ]
    for turn in range(turns):
        messages.append({"role": "assistant", "content": f"answer {turn} " + "words " * 300})
        messages.append({"role": "user", "content": f"question {turn}"})
    return {"model": "m", "messages": messages, **fields}


def key_of(document: object) -> bytes | None:
    return read_request(document, length=1024).prefix_key


def test_a_200_kib_conversation_keeps_the_key_of_its_first_turn() -> None:
    first = conversation("Tell me about Rome", 0)
    long = json.dumps(conversation("Tell me about Rome", 110, max_tokens=64)).encode()
    assert len(long) > 200 * 1024
    held = long[: 64 * 1024]  # what ``sticky.body_limit`` lets the proxy hold
    document = leading_document(held)
    assert document is not None
    assert key_of(document) == key_of(first) is not None
    assert document["model"] == "m"
    other = json.dumps(conversation("Tell me about Oslo", 110)).encode()[: 64 * 1024]
    assert key_of(leading_document(other)) != key_of(first)


def test_the_members_before_the_keys_messages_are_read_and_the_read_ends_there() -> None:
    whole = conversation("q", 3)
    body = json.dumps({"max_tokens": 7, "n": 2, "tools": [{"x": "[{"}], **whole, "user": "u"})
    document = leading_document(body.encode())
    assert document == {
        "max_tokens": 7,
        "n": 2,
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}],
    }


def test_a_completion_prompt_is_read_and_the_same_key_results() -> None:
    whole = {"model": "m", "prompt": "x" * 3000, "suffix": "y" * 100_000}
    body = json.dumps(whole).encode()[:8192]
    document = leading_document(body)
    assert document is not None and document["prompt"] == "x" * 3000
    assert read_request(document, length=1024) == read_request(
        {"model": "m", "prompt": "x" * 3000}, length=1024
    )


def test_a_first_turn_cut_off_leaves_the_system_part() -> None:
    body = json.dumps(conversation("u" * 100_000, 0)).encode()[:8192]
    document = leading_document(body)
    assert document is not None
    assert document["messages"] == [{"role": "system", "content": SYSTEM}]


def test_what_is_not_a_json_object_gives_nothing() -> None:
    for body in (b"", b"[1, 2]", b"nope", b'{"messages": 5}', b"{", b'{"a": 1} trailing'):
        document = leading_document(body)
        assert document is None or key_of(document) is None, body


@settings(max_examples=300)
@given(st.binary(max_size=200) | st.text(alphabet='{}[]",:\\ ab1', max_size=120).map(str.encode))
def test_any_bytes_give_a_document_or_none_without_raising(body: bytes) -> None:
    document = leading_document(body)
    assert document is None or isinstance(document, dict)
    read_request(document, length=64)
