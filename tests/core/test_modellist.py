"""``core/apis/modellist.py``: the proxy's own ``GET /v1/models`` and ``GET /v1/models/{id}``
answers, in the OpenAI shape or (with ``anthropic-version``) in Anthropic's, as data."""

from __future__ import annotations

import json
from typing import Any

import pytest

from muxproxy.core.apis.modellist import models_answer
from muxproxy.core.messages import RequestHead
from muxproxy.routing.modelcatalog import ModelInfo

KNOWN = (
    ModelInfo(id="llama-3.1-70b", created=1700000000, owned_by="vllm"),
    ModelInfo(id="meta-llama/Llama-3.1-8B"),
    ModelInfo(id="chat-default"),
)
ANTHROPIC = [(b"anthropic-version", b"2023-06-01")]


def head(target: bytes, method: bytes = b"GET", headers: Any = ()) -> RequestHead:
    return RequestHead(
        stream=1,
        method=method,
        target=target,
        authority=b"proxy",
        scheme=b"http",
        headers=list(headers),
    )


def answer(target: bytes, headers: Any = (), known: Any = KNOWN) -> tuple[int, Any]:
    found = models_answer(head(target, headers=headers), known)
    assert found is not None
    status, body = found
    assert body.content_type == b"application/json"
    return status, json.loads(body.data)


def test_the_openai_list_holds_every_known_model_in_order() -> None:
    status, document = answer(b"/v1/models")
    assert status == 200
    assert document == {
        "object": "list",
        "data": [
            {"id": "llama-3.1-70b", "object": "model", "created": 1700000000, "owned_by": "vllm"},
            {
                "id": "meta-llama/Llama-3.1-8B",
                "object": "model",
                "created": 0,
                "owned_by": "muxproxy",
            },
            {"id": "chat-default", "object": "model", "created": 0, "owned_by": "muxproxy"},
        ],
    }


@pytest.mark.parametrize("target", [b"/v1/models/llama-3.1-70b", b"/v1/models/llama-3.1-70b?x=1"])
def test_one_model_is_its_object(target: bytes) -> None:
    status, document = answer(target)
    assert (status, document["id"], document["owned_by"]) == (200, "llama-3.1-70b", "vllm")


@pytest.mark.parametrize(
    "target", [b"/v1/models/meta-llama/Llama-3.1-8B", b"/v1/models/meta-llama%2FLlama-3.1-8B"]
)
def test_a_name_with_a_slash_is_found_encoded_or_not(target: bytes) -> None:
    assert answer(target)[1]["id"] == "meta-llama/Llama-3.1-8B"


def test_an_unknown_model_is_404_model_not_found_in_the_openai_shape() -> None:
    status, document = answer(b"/v1/models/gpt-nothing")
    assert status == 404
    assert document["error"]["code"] == "model_not_found"
    assert document["error"]["type"] == "invalid_request_error"
    assert "gpt-nothing" in document["error"]["message"]


def test_the_anthropic_list_is_paged_by_limit_and_after_id() -> None:
    status, first = answer(b"/v1/models?limit=2", ANTHROPIC)
    assert status == 200
    assert [m["id"] for m in first["data"]] == ["llama-3.1-70b", "meta-llama/Llama-3.1-8B"]
    assert first["data"][0] == {
        "type": "model",
        "id": "llama-3.1-70b",
        "display_name": "llama-3.1-70b",
        "created_at": "2023-11-14T22:13:20Z",
    }
    assert (first["has_more"], first["first_id"], first["last_id"]) == (
        True,
        "llama-3.1-70b",
        "meta-llama/Llama-3.1-8B",
    )
    _, rest = answer(b"/v1/models?limit=2&after_id=meta-llama%2FLlama-3.1-8B", ANTHROPIC)
    assert [m["id"] for m in rest["data"]] == ["chat-default"]
    assert rest["has_more"] is False
    _, before = answer(b"/v1/models?limit=1&before_id=chat-default", ANTHROPIC)
    assert [m["id"] for m in before["data"]] == ["meta-llama/Llama-3.1-8B"]
    assert before["has_more"] is True


def test_the_anthropic_default_page_holds_twenty() -> None:
    many = tuple(ModelInfo(id=f"m{i}") for i in range(25))
    _, page = answer(b"/v1/models", ANTHROPIC, many)
    assert len(page["data"]) == 20 and page["has_more"] is True and page["last_id"] == "m19"


@pytest.mark.parametrize("limit", [b"0", b"1001", b"abc", b"%C2%B2", b"9" * 5000, b"-1"])
def test_a_bad_anthropic_limit_is_400_invalid_request_error(limit: bytes) -> None:
    status, document = answer(b"/v1/models?limit=" + limit, ANTHROPIC)
    assert status == 400
    assert document["type"] == "error"
    assert document["error"]["type"] == "invalid_request_error"


def test_an_unknown_model_is_anthropics_not_found_error() -> None:
    status, document = answer(b"/v1/models/claude-nothing", ANTHROPIC)
    assert status == 404
    assert document == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "model: claude-nothing"},
    }
    status, found = answer(b"/v1/models/chat-default", ANTHROPIC)
    assert (status, found["type"], found["id"]) == (200, "model", "chat-default")


@pytest.mark.parametrize(
    ("method", "target", "known"),
    [
        (b"GET", b"/v1/models", ()),  # nothing known: proxied as before
        (b"POST", b"/v1/models", KNOWN),
        (b"DELETE", b"/v1/models/chat-default", KNOWN),
        (b"GET", b"/v1/models/", KNOWN),
        (b"GET", b"/v1/modelsx", KNOWN),
        (b"GET", b"/openai/v1/models", KNOWN),
        (b"GET", b"/v1/chat/completions", KNOWN),
    ],
)
def test_not_ours_to_answer(method: bytes, target: bytes, known: Any) -> None:
    assert models_answer(head(target, method), known) is None


def test_head_is_answered_like_get() -> None:
    assert models_answer(head(b"/v1/models", b"HEAD"), KNOWN) is not None
