"""Routing by model (``routing/models.py``): reading the model from a body's first bytes,
patterns, rewriting, and the choice among an alias's weighted targets."""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muxproxy.routing.models import (
    Duplicate,
    Found,
    NeedMore,
    NotFound,
    find_model,
    matches,
    pick_target,
    rewrite_model,
)

LIMIT = 64 * 1024


def whole(body: bytes, limit: int = LIMIT) -> Found | Duplicate | NeedMore | NotFound:
    return find_model(body, complete=True, limit=limit)


def byte_by_byte(body: bytes, limit: int = LIMIT) -> Found | Duplicate | NeedMore | NotFound:
    """The answer when the body arrives one byte at a time: the first decided answer, which
    must stay the answer for every longer prefix."""
    for size in range(len(body) + 1):
        answer = find_model(body[:size], complete=size == len(body), limit=limit)
        if not isinstance(answer, NeedMore):
            for longer in range(size, len(body) + 1):
                later = find_model(body[:longer], complete=longer == len(body), limit=limit)
                assert later == answer, (size, longer)
            return answer
    raise AssertionError("a complete body was left undecided")


BODIES = [
    b'{"model": "gpt-4o", "messages": []}',
    b'  {"messages": [{"role": "user", "content": "a \\"model\\": \\"x\\" {["}],'
    b' "model":"llama-3.1-70b"}',
    b'{"n": 1, "stream": true, "x": null, "y": -1.5e3, "z": {"model": "inner"}, "model": "m"}',
    b'{"mod\\u0065l": "escaped-key"}',
    b'{"model": "a\\\\b\\"c\\u00e9\\ud83d\\ude00"}',
    b'{"messages": "\\\\", "model": "after-backslash"}',
    b"{}",
    b'{"model": 4}',
    b'{"model": null}',
    b'{"model": ["a"]}',
    b'{"models": "no", "messages": []}',
    b'["model", "x"]',
    b'"model"',
    b"",
    b"   ",
    b'{"model": "bad \\x escape"}',
    b'{"model" "missing colon"}',
    b'{"a": 1 "model": "x"}',
    b'{"a": [1}, "model": "x"}',
    b'{"model": "\xff\xfe"}',
    b'\xef\xbb\xbf{"model": "after-bom"}',
    b'{"model": "a", "messages": [], "model": "b"}',
    b'{"model": "a", "mod\\u0065l": 4}',
]


def test_pieces_one_byte_at_a_time_give_the_answer_of_the_whole() -> None:
    for body in BODIES:
        assert byte_by_byte(body) == whole(body), body


def test_found_models_and_spans() -> None:
    answer = whole(BODIES[1])
    assert isinstance(answer, Found)
    assert answer.model == "llama-3.1-70b"
    assert BODIES[1][answer.span[0] : answer.span[1]] == b'"llama-3.1-70b"'
    assert whole(BODIES[2]) == Found("m", (BODIES[2].rindex(b'"m"'), len(BODIES[2]) - 1))
    assert isinstance(found := whole(BODIES[3]), Found) and found.model == "escaped-key"
    assert isinstance(found := whole(BODIES[4]), Found)
    assert found.model == 'a\\b"c\u00e9\U0001f600'
    assert isinstance(found := whole(BODIES[5]), Found) and found.model == "after-backslash"
    assert isinstance(found := whole(BODIES[-3]), Found) and found.model == "after-bom"


def test_bodies_without_a_model_string_are_not_found() -> None:
    for body in BODIES[6:-3]:
        assert isinstance(whole(body), NotFound), body


def test_an_unfinished_body_needs_more_until_it_is_complete() -> None:
    body = b'{"messages": [{"content": "hello'
    assert find_model(body, complete=False, limit=LIMIT) == NeedMore()
    assert isinstance(find_model(body, complete=True, limit=LIMIT), NotFound)
    assert find_model(b'{"model": "gpt', complete=False, limit=LIMIT) == NeedMore()
    # The object's end decides (a second "model" could follow), or the body's, or the limit's.
    partial = b'{"model": "gpt-4o", "mess'
    assert find_model(partial, complete=False, limit=LIMIT) == NeedMore()
    assert find_model(partial, complete=True, limit=LIMIT) == Found("gpt-4o", (10, 18))
    assert find_model(partial, complete=False, limit=len(partial)) == Found("gpt-4o", (10, 18))
    assert find_model(partial + b'ages": []}', complete=False, limit=LIMIT) == Found(
        "gpt-4o", (10, 18)
    )


def test_a_repeated_model_member_is_a_duplicate_within_the_limit() -> None:
    assert whole(BODIES[-2]) == Duplicate("a")
    assert whole(BODIES[-1]) == Duplicate("a")  # however it is spelt, whatever its value
    assert whole(b'{"model": "a", "x": {"model": "inner"}}') == Found("a", (10, 13))
    body = b'{"model": "a", "pad": "' + b"x" * 100 + b'", "model": "b"}'
    assert whole(body) == Duplicate("a")
    assert whole(body, limit=50) == Found("a", (10, 13))  # a repeat past the limit is not seen


def test_model_after_a_long_messages_array_is_found_only_within_the_limit() -> None:
    text = 'say "hi" \\ {[ \u00e9 ' * 40
    messages = [{"role": "user", "content": text, "n": [1, {"a": None}]}] * 150
    body = json.dumps({"messages": messages, "model": "deep"}).encode()
    assert len(body) > 100 * 1024
    assert whole(body, limit=len(body)) == Found("deep", (len(body) - 7, len(body) - 1))
    assert find_model(body, complete=False, limit=len(body)) == Found(
        "deep", (len(body) - 7, len(body) - 1)
    )
    limited = whole(body, limit=LIMIT)
    assert isinstance(limited, NotFound) and str(LIMIT) in limited.reason
    # Undecided at the limit with more to come is NotFound too, not NeedMore.
    assert isinstance(find_model(body[: LIMIT + 10], complete=False, limit=LIMIT), NotFound)
    assert find_model(body[: LIMIT - 10], complete=False, limit=LIMIT) == NeedMore()
    # A value that ends exactly at the limit is read; one byte short of it is not.
    end = len(body) - 1
    assert isinstance(find_model(body, complete=False, limit=end), Found)
    assert isinstance(find_model(body, complete=False, limit=end - 1), NotFound)


@given(st.binary(max_size=300), st.booleans(), st.integers(min_value=0, max_value=400))
def test_arbitrary_bytes_never_raise(data: bytes, complete: bool, limit: int) -> None:
    answer = find_model(data, complete=complete, limit=limit)
    assert isinstance(answer, Found | Duplicate | NeedMore | NotFound)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(
    st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=5),
    st.one_of(st.text(), JSON_VALUES),
    st.booleans(),
    st.booleans(),
)
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_answer_of_json_dumps_equals_json_loads(
    fields: dict[str, Any], model: Any, ascii_only: bool, indent: bool
) -> None:
    document = {**fields, "model": model}
    body = json.dumps(document, ensure_ascii=ascii_only, indent=2 if indent else None).encode()
    answer = whole(body)
    expected = json.loads(body)["model"]
    if isinstance(expected, str):
        assert isinstance(answer, Found)
        assert answer.model == expected
        assert json.loads(body[answer.span[0] : answer.span[1]]) == expected
    else:
        assert isinstance(answer, NotFound)


@given(st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=5), st.text(), st.text())
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_rewrite_round_trips_through_json_loads(
    fields: dict[str, Any], model: str, new: str
) -> None:
    document = {**fields, "model": model}
    body = json.dumps(document, ensure_ascii=False).encode()
    answer = whole(body)
    assert isinstance(answer, Found)
    rewritten = rewrite_model(body, answer.span, new)
    assert json.loads(rewritten) == {**document, "model": new}
    start, end = answer.span
    assert rewritten[:start] == body[:start]
    assert rewritten[len(rewritten) - (len(body) - end) :] == body[end:]
    assert whole(rewritten) == Found(new, (start, len(rewritten) - (len(body) - end)))


def test_patterns_are_exact_names_or_case_sensitive_globs() -> None:
    assert matches("gpt-4o", ["gpt-4o"])
    assert matches("llama-3.1-70b-instruct", ["x", "llama-3.1-70b*"])
    assert not matches("llama-3.1-8b", ["llama-3.1-70b*"])
    assert not matches("GPT-4o", ["gpt-4o", "gpt-*"])
    assert matches("m[1]", ["m[1]"])  # an exact name is taken as is before it is a glob
    assert matches("m1", ["m[0-9]"])
    assert not matches("anything", [])


def test_a_session_keeps_its_target_while_weights_stay() -> None:
    targets = [("v1", 9), ("v2", 1)]
    rng = random.Random(1)
    for key in (b"a", b"conversation-7", b"\x00" * 40):
        first = pick_target(targets, key, rng)
        assert first in ("v1", "v2")
        assert all(pick_target(targets, key, rng) == first for _ in range(20))


def test_changing_weights_moves_only_the_sessions_that_must_move() -> None:
    keys = [f"session-{i}".encode() for i in range(200)]
    rng = random.Random(0)
    before = {key: pick_target([("v1", 9), ("v2", 1)], key, rng) for key in keys}
    after = {key: pick_target([("v1", 8), ("v2", 2)], key, rng) for key in keys}
    # v2's weight grew and v1's shrank: a key of v2 stays; only keys of v1 may move, to v2.
    assert all(after[key] == "v2" for key in keys if before[key] == "v2")
    moved = [key for key in keys if before[key] != after[key]]
    assert all(before[key] == "v1" and after[key] == "v2" for key in moved)
    share_before = sum(target == "v2" for target in before.values()) / len(keys)
    share_after = sum(target == "v2" for target in after.values()) / len(keys)
    assert 0.04 <= share_before <= 0.17  # 10 % expected; 200 keys: about +-2 % per sigma
    assert 0.12 <= share_after <= 0.29  # 20 % expected
    assert 0.04 <= len(moved) / len(keys) <= 0.17  # the 10 % that must move, no more


def test_without_a_session_the_pick_is_weighted_random() -> None:
    rng = random.Random(7)
    picks = [pick_target([("a", 3), ("b", 0), ("c", 1)], None, rng) for _ in range(4000)]
    assert "b" not in picks
    assert 0.70 <= picks.count("a") / len(picks) <= 0.80


def test_weight_zero_is_never_chosen_and_all_zero_is_none() -> None:
    rng = random.Random(3)
    for i in range(100):
        key = str(i).encode()
        assert pick_target([("off", 0), ("on", 1)], key, rng) == "on"
    assert pick_target([("a", 0), ("b", 0)], b"k", rng) is None
    assert pick_target([("a", 0), ("b", -1)], None, rng) is None
    assert pick_target([], None, rng) is None
    assert pick_target([], b"k", rng) is None


def test_the_alias_is_part_of_the_hash() -> None:
    keys = [str(i).encode() for i in range(64)]
    targets = [("a", 1), ("b", 1)]
    rng = random.Random(0)
    one = [pick_target(targets, key, rng, alias="x") for key in keys]
    two = [pick_target(targets, key, rng, alias="y") for key in keys]
    assert one != two
