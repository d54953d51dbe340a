"""Tokens of conversation prefixes: keys, tokenize requests and answers, the bounded cache."""

from __future__ import annotations

import json

import pytest

from muxproxy.routing.kvtokens import (
    MAX_ANSWER_TOKENS,
    TokenCache,
    TokenizeError,
    conversation_keys,
    parse_tokenize_answer,
    tokenize_body,
)

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "hi"}
REPLY = {"role": "assistant", "content": "hello"}
NEXT = {"role": "user", "content": "and then?"}


def chat(*messages: dict[str, str], model: str = "m") -> dict[str, object]:
    return {"model": model, "messages": list(messages), "stream": True}


def test_a_next_turn_shares_the_keys_of_the_turns_before_it() -> None:
    first = conversation_keys(chat(SYSTEM, USER))
    second = conversation_keys(chat(SYSTEM, USER, REPLY, NEXT))
    assert len(first) == 2 and len(second) == 4
    assert second[:2] == first
    # Key order in a message's JSON does not matter; its content and the model do.
    reordered = {"content": "Be brief.", "role": "system"}
    assert conversation_keys(chat(reordered, USER)) == first
    assert conversation_keys(chat(SYSTEM, NEXT))[1] != first[1]
    assert conversation_keys(chat(SYSTEM, USER, model="other"))[0] != first[0]


def test_keys_of_prompts_and_of_what_is_no_request() -> None:
    assert len(conversation_keys({"model": "m", "prompt": "once upon"})) == 1
    assert conversation_keys({"model": "m", "prompt": [1, 2]}) == []
    assert conversation_keys([1, 2]) == []
    assert conversation_keys({"messages": "hi"}) == []


def test_tokenize_body_asks_for_a_prefix_without_the_generation_prompt() -> None:
    body = json.loads(tokenize_body(chat(SYSTEM, USER, REPLY), messages=2))
    assert body == {"model": "m", "messages": [SYSTEM, USER], "add_generation_prompt": False}
    assert json.loads(tokenize_body({"model": "m", "prompt": "x"})) == {"model": "m", "prompt": "x"}


def test_tokenize_answer_is_read_or_refused_with_a_reason() -> None:
    assert parse_tokenize_answer(b'{"count": 2, "max_model_len": 8, "tokens": [5, 7]}') == (5, 7)
    for body, reason in [
        (b"nope", "not JSON"),
        (b'{"count": 1}', "no tokens"),
        (b'{"tokens": [1, "a"]}', "integers"),
        (b'{"tokens": [-1]}', "integers"),
        (b'{"tokens": [true]}', "integers"),
    ]:
        with pytest.raises(TokenizeError, match=reason):
            parse_tokenize_answer(body)
    too_many = json.dumps({"tokens": [0] * (MAX_ANSWER_TOKENS + 1)}).encode()
    with pytest.raises(TokenizeError, match="over"):
        parse_tokenize_answer(too_many)


def test_the_longest_known_prefix_scores_a_new_turn() -> None:
    cache = TokenCache(max_entries=10, max_tokens=1000)
    turn1 = conversation_keys(chat(SYSTEM, USER))
    turn2 = conversation_keys(chat(SYSTEM, USER, REPLY, NEXT))
    assert cache.longest(turn2) is None
    assert cache.wanted(turn1)
    cache.put(turn1[-1], (1, 2, 3))
    assert not cache.wanted(turn1)
    assert cache.longest(turn2) == (2, (1, 2, 3))
    assert cache.wanted(turn2)
    assert not cache.wanted([])


def test_the_cache_keeps_within_its_entries_and_tokens() -> None:
    cache = TokenCache(max_entries=2, max_tokens=10)
    cache.put(b"a", (1,) * 4)
    cache.put(b"b", (2,) * 4)
    assert cache.longest([b"a"]) is not None  # a is now the most recent
    cache.put(b"c", (3,) * 4)  # over both bounds: b goes
    assert cache.longest([b"b"]) is None
    assert len(cache) == 2 and cache.tokens == 8
    cache.put(b"d", (4,) * 11)  # longer than the whole cache: not kept
    assert cache.longest([b"d"]) is None
    cache.put(b"a", (5,) * 2)  # replaced, counted once
    assert cache.tokens == 6
