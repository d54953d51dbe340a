"""What routing reads from an OpenAI-style body (``routing/llmrequest.py``)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muxproxy.routing.llmrequest import INVALID, parse_json_body, read_request

SYSTEM = "You are a careful assistant. " * 60  # longer than the default 1024 bytes


def chat(system: str | None, user: str, *later: str, **fields: Any) -> object:
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": user})
    for i, text in enumerate(later):
        messages.append({"role": "assistant" if i % 2 == 0 else "user", "content": text})
    return {"model": "m", "messages": messages, **fields}


def key(document: object, length: int = 1024, source: str = "auto") -> bytes | None:
    return read_request(document, source=source, length=length).prefix_key


def test_max_tokens_prefers_max_completion_tokens_and_multiplies_by_n() -> None:
    assert read_request({"max_tokens": 50}).max_tokens == 50
    assert read_request({"max_tokens": 50, "max_completion_tokens": 70}).max_tokens == 70
    # The Responses API's name, where the others are missing.
    assert read_request({"input": "hi", "max_output_tokens": 40}).max_tokens == 40
    assert read_request({"max_tokens": 50, "max_output_tokens": 40}).max_tokens == 50
    assert read_request({"max_tokens": 50, "n": 3}).max_tokens == 150
    assert read_request({"max_tokens": 50, "n": 10**9}).max_tokens == 50 * 128


def test_max_tokens_that_is_not_a_positive_integer_is_not_a_fact() -> None:
    for value in (0, -5, 1.5, "100", True, None, [10]):
        assert read_request({"max_tokens": value}).max_tokens is None, value
    assert read_request([1, 2]).max_tokens is None
    assert read_request(INVALID).max_tokens is None


def test_no_prefix_key_unless_asked_for() -> None:
    assert read_request(chat(SYSTEM, "hi")).prefix_key is None


def test_single_questions_behind_one_long_system_prompt_get_different_keys() -> None:
    # The system prompt is longer than ``length``: it no longer swallows the question.
    a = key(chat(SYSTEM, "What is 2+2?"))
    b = key(chat(SYSTEM, "Write a poem"))
    assert a is not None and b is not None and a != b
    assert len(a) == 16
    assert key(chat(SYSTEM.replace("careful", "cheerful"), "What is 2+2?")) != a


def test_a_conversation_behind_a_long_system_prompt_keeps_its_first_turns_key() -> None:
    first = key(chat(SYSTEM, "Write a poem"))
    assert first == key(chat(SYSTEM, "Write a poem", "Roses are red...", "longer please"))
    assert first == key(chat(SYSTEM, "Write a poem", "ok", "more", "here", "x" * 100_000))


def test_each_part_is_bounded_on_its_own() -> None:
    # Past ``length`` bytes neither the system part nor the first turn changes the key.
    assert key(chat(SYSTEM + "tail one", "q" * 2000 + "a")) == key(
        chat(SYSTEM + "tail two", "q" * 2000 + "b")
    )
    assert key(chat(SYSTEM, "q" * 1000 + "a")) != key(chat(SYSTEM, "q" * 1000 + "b"))


def test_a_short_system_prompt_takes_in_the_first_user_turn() -> None:
    short = "Be brief."
    first = key(chat(short, "Tell me about Rome"))
    assert first == key(chat(short, "Tell me about Rome", "Rome is...", "and Paris?"))
    assert first != key(chat(short, "Tell me about Oslo"))


def test_later_turns_never_change_the_key() -> None:
    base = chat("sys", "question")
    assert key(base) == key(chat("sys", "question", "answer", "follow-up " * 500))


def test_developer_messages_count_as_system_and_parts_are_read() -> None:
    parts = {
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "rules"}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                ],
            },
        ]
    }
    other = json.loads(json.dumps(parts))
    other["messages"][1]["content"][1]["image_url"]["url"] = "https://x/dog.png"
    assert key(parts) is not None and key(parts) != key(other)


def test_prompt_source_reads_completions_prompts() -> None:
    text = {"prompt": "x" * 5000}
    assert key(text, source="prompt") == key({"prompt": "x" * 1024 + "y"}, source="prompt")
    assert key({"prompt": ["abc", "def"]}, source="prompt") == key(
        {"prompt": "abc"}, source="prompt"
    )
    ids = key({"prompt": [1, 2, 3]}, source="prompt")
    assert ids is not None and ids != key({"prompt": [1, 2, 4]}, source="prompt")
    assert key({"prompt": "abc"}, source="messages") is None
    assert key(chat("s", "u"), source="prompt") is None
    assert key({"prompt": ""}) is None


def test_length_bounds_the_text_keyed() -> None:
    a = chat("s" * 10, "u" * 100)
    b = chat("s" * 10, "u" * 99 + "v")
    assert key(a, length=50) == key(b, length=50)
    assert key(a, length=500) != key(b, length=500)


def test_malformed_messages_give_no_key_and_never_raise() -> None:
    for messages in ([], "text", [1, 2], [{"content": "no role"}], [{"role": 5}], None):
        assert key({"messages": messages}) is None, messages


def test_parse_json_body() -> None:
    assert parse_json_body(b'{"a": 1}') == {"a": 1}
    assert parse_json_body(b"{nope") is INVALID
    assert parse_json_body(b"\xff\xfe") is INVALID
    assert parse_json_body(b"[" * 100_000) is INVALID


SCALAR = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
PART = st.fixed_dictionaries({}, optional={"type": st.text(max_size=5), "text": SCALAR})
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "developer", "user", "assistant"]) | SCALAR,
        "content": SCALAR | st.lists(PART | SCALAR, max_size=3),
    },
)
FIELD = SCALAR | st.lists(MESSAGE | SCALAR, max_size=4) | st.lists(st.integers(), max_size=4)


# Generation speed is not what is tested: on a loaded machine the first draws can be slow.
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(["messages", "prompt", "max_tokens", "n", "max_completion_tokens"]), FIELD
    ),
    st.integers(0, 2000),
    st.sampled_from(["auto", "messages", "prompt"]),
)
def test_any_document_gives_facts_without_raising(
    document: object, length: int, source: str
) -> None:
    facts = read_request(document, source=source, length=length)
    assert facts.max_tokens is None or facts.max_tokens >= 1
    assert facts.prefix_key is None or len(facts.prefix_key) == 16
