"""Session keys from cookies, headers, query arguments and JSON bodies; cookies; templates."""

from __future__ import annotations

import json

import pytest

from muxproxy.config import SessionSource, StickyCookie
from muxproxy.routing.sticky import (
    cookie_value,
    expand_header_rule,
    query_arg,
    session_key_from_body,
    session_key_from_head,
    set_cookie_header,
    unknown_variables,
)

COOKIE = SessionSource(kind="cookie", name="sid")
HEADER = SessionSource(kind="header", name="X-Session-Id")
QUERY = SessionSource(kind="query", name="session")
BODY = SessionSource(kind="body", name="metadata.session_id")
USER = SessionSource(kind="body", name="user")


# -- cookies -----------------------------------------------------------------------------------


def test_cookie_value_parses_name_value_pairs() -> None:
    headers = [(b"cookie", b"a=1; sid=abc;b=2")]
    assert cookie_value(headers, "sid") == b"abc"
    assert cookie_value(headers, "a") == b"1"
    assert cookie_value(headers, "b") == b"2"
    assert cookie_value(headers, "missing") is None
    assert cookie_value([], "sid") is None


def test_cookie_value_reads_every_cookie_header() -> None:
    headers = [
        (b"host", b"x"),
        (b"cookie", b"a=1"),
        (b"Cookie", b"theme=dark; sid=xyz"),
        (b"cookie", b"sid=later"),
    ]
    assert cookie_value(headers, "sid") == b"xyz"
    assert cookie_value(iter(headers), "theme") == b"dark"


def test_cookie_value_edge_cases() -> None:
    headers = [(b"cookie", b"novalue; sid=; x=a=b;  spaced = v ")]
    assert cookie_value(headers, "novalue") is None
    assert cookie_value(headers, "sid") == b""
    assert cookie_value(headers, "x") == b"a=b"
    assert cookie_value(headers, "spaced") == b"v"
    assert cookie_value([(b"x-cookie", b"sid=1")], "sid") is None


# -- query -------------------------------------------------------------------------------------


def test_query_arg_percent_decodes() -> None:
    target = b"/v1/chat?x=1&session=a%20b%2Fc%3D&session=second"
    assert query_arg(target, "session") == b"a b/c="
    assert query_arg(target, "x") == b"1"
    assert query_arg(target, "y") is None
    assert query_arg(b"/v1/chat", "session") is None
    assert query_arg(b"/v1/chat?session", "session") == b""
    assert query_arg(b"/?s%65ssion=v", "session") == b"v"  # names are decoded too
    assert query_arg(b"/?session=a+b", "session") == b"a b"
    assert query_arg(b"/?session=%C3%A9%FF", "session") == b"\xc3\xa9\xff"
    assert query_arg(b"/?session=x#frag", "session") == b"x"


# -- session keys from the head ----------------------------------------------------------------


def test_head_sources_in_order() -> None:
    headers = [(b"cookie", b"sid=from-cookie"), (b"x-session-id", b"from-header")]
    target = b"/v1/chat?session=from-query"
    assert session_key_from_head([COOKIE, HEADER, QUERY], headers, target) == (
        b"from-cookie",
        False,
    )
    assert session_key_from_head([HEADER, COOKIE], headers, target) == (b"from-header", False)
    assert session_key_from_head([QUERY, COOKIE], headers, target) == (b"from-query", False)
    assert session_key_from_head([QUERY], headers, b"/v1/chat") == (None, False)
    assert session_key_from_head([], headers, target) == (None, False)


def test_head_skips_empty_values() -> None:
    headers = [(b"cookie", b"sid="), (b"x-session-id", b"")]
    target = b"/?session=&x=1"
    assert session_key_from_head([COOKIE, HEADER, QUERY], headers, target) == (None, False)
    assert session_key_from_head(
        [COOKIE, HEADER, QUERY], [*headers, (b"x-session-id", b"h")], target
    ) == (None, False)  # only the first x-session-id counts, and it is empty


def test_head_header_takes_the_first_value_case_insensitively() -> None:
    headers = [(b"X-Session-ID", b"one"), (b"x-session-id", b"two")]
    assert session_key_from_head([HEADER], headers, b"/") == (b"one", False)


def test_head_needs_the_body_only_when_a_body_source_is_reached() -> None:
    with_header = [(b"x-session-id", b"h")]
    assert session_key_from_head([HEADER, BODY], with_header, b"/") == (b"h", False)
    assert session_key_from_head([HEADER, BODY], [], b"/") == (None, True)
    assert session_key_from_head([BODY, HEADER], with_header, b"/") == (None, True)


def test_head_accepts_a_one_shot_iterable() -> None:
    headers = iter([(b"x-session-id", b""), (b"cookie", b"sid=c")])
    assert session_key_from_head([HEADER, COOKIE], headers, b"/") == (b"c", False)


# -- session keys from the body ----------------------------------------------------------------


def body(document: object) -> bytes:
    return json.dumps(document).encode()


def test_body_nested_path() -> None:
    doc = body({"model": "m", "metadata": {"session_id": "conv-42"}, "user": "alice"})
    assert session_key_from_body([BODY], [], b"/", doc, True) == b"conv-42"
    assert session_key_from_body([USER], [], b"/", doc, True) == b"alice"
    deep = SessionSource(kind="body", name="a.b.c.d")
    doc = body({"a": {"b": {"c": {"d": "deep"}}}})
    assert session_key_from_body([deep], [], b"/", doc, True) == b"deep"


def test_body_value_types() -> None:
    def key(value: object) -> bytes | None:
        return session_key_from_body([USER], [], b"/", body({"user": value}), True)

    assert key("élan") == "élan".encode()
    assert key(42) == b"42"
    assert key(-7) == b"-7"
    assert key(1.5) == b"1.5"
    assert key(True) is None
    assert key(None) is None
    assert key(["a"]) is None
    assert key({"a": 1}) is None
    assert key("") is None


def test_body_missing_paths() -> None:
    for document in ({}, {"metadata": "str"}, {"metadata": {}}, [1, 2], "text", 3):
        assert session_key_from_body([BODY], [], b"/", body(document), True) is None


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b'{"user": "a"',
        b"\xff\xfe\x00",
        b"[" * 100_000,
        b'{"user": 1e999999}',
        b'{"user": NaN}',
        b'{"user": ' + b"1" * 5000 + b"}",  # past Python's int digit limit: a ValueError
    ],
)
def test_body_not_json_gives_no_key(raw: bytes) -> None:
    assert session_key_from_body([USER, BODY], [], b"/", raw, True) is None


def test_body_incomplete_gives_no_body_key() -> None:
    doc = body({"user": "alice"})
    assert session_key_from_body([USER], [], b"/", doc, False) is None
    # Other sources after the body source are still consulted.
    assert session_key_from_body([USER, COOKIE], [(b"cookie", b"sid=c")], b"/", doc, False) == (
        b"c"
    )


def test_body_order_of_sources() -> None:
    doc = body({"user": "from-body"})
    with_header = [(b"x-session-id", b"from-header")]
    # A header source before the body wins when present ...
    assert session_key_from_body([HEADER, USER], with_header, b"/", doc, True) == b"from-header"
    # ... and the body is consulted when it is absent.
    assert session_key_from_body([HEADER, USER], [], b"/", doc, True) == b"from-body"
    # The body before the header wins when it has a key; else the header.
    assert session_key_from_body([USER, HEADER], with_header, b"/", doc, True) == b"from-body"
    assert session_key_from_body([BODY, HEADER], with_header, b"/", doc, True) == b"from-header"
    # Several body paths: the first with a value.
    doc = body({"user": "u", "metadata": {"session_id": "s"}})
    assert session_key_from_body([BODY, USER], [], b"/", doc, True) == b"s"
    assert session_key_from_body([USER, BODY], [], b"/", doc, True) == b"u"


def test_body_and_query_and_cookie() -> None:
    doc = body({})
    headers = [(b"cookie", b"sid=c")]
    assert session_key_from_body([USER, QUERY, COOKIE], headers, b"/?session=q", doc, True) == (
        b"q"
    )
    assert session_key_from_body([USER, QUERY, COOKIE], headers, b"/", doc, True) == b"c"
    assert session_key_from_body([USER, QUERY], [], b"/", doc, True) is None


# -- set-cookie --------------------------------------------------------------------------------


def test_set_cookie_defaults() -> None:
    assert set_cookie_header(StickyCookie(), b"0123456789abcdef") == (
        b"set-cookie",
        b"muxproxy_server=0123456789abcdef; Path=/; HttpOnly; SameSite=Lax",
    )


def test_set_cookie_all_attributes() -> None:
    cookie = StickyCookie(
        name="srv",
        expires=3600.0,
        domain="example.com",
        path="/v1",
        http_only=True,
        secure=True,
        same_site="Strict",
    )
    assert set_cookie_header(cookie, b"v") == (
        b"set-cookie",
        b"srv=v; Path=/v1; Max-Age=3600; Domain=example.com; HttpOnly; Secure; SameSite=Strict",
    )


def test_set_cookie_only_configured_attributes() -> None:
    cookie = StickyCookie(name="srv", path="", http_only=False, same_site=None, expires=0.5)
    assert set_cookie_header(cookie, b"v") == (b"set-cookie", b"srv=v; Max-Age=1")


# -- header templates --------------------------------------------------------------------------


def expand(
    template: str,
    *,
    key: bytes | None = b"conv-1",
    headers: list[tuple[bytes, bytes]] | None = None,
    target: bytes = b"/v1/chat?user=al%20ice&n=2",
) -> bytes | None:
    if headers is None:
        headers = [
            (b"x-user-id", b"u-7"),
            (b"cookie", b"sid=c1; theme=dark"),
            (b"accept", b"text/plain"),
            (b"Accept", b"text/event-stream"),
        ]
    return expand_header_rule(
        template, session_key=key, remote_addr="192.0.2.1", headers=headers, target=target
    )


def test_template_variables() -> None:
    assert expand("$session_key") == b"conv-1"
    assert expand("$remote_addr") == b"192.0.2.1"
    assert expand("$arg_user") == b"al ice"
    assert expand("$cookie_sid") == b"c1"
    assert expand("$http_x_user_id") == b"u-7"
    assert expand("$http_X_USER_ID") == b"u-7"
    assert expand("$http_accept") == b"text/plain, text/event-stream"
    assert expand("$http_cookie") == b"sid=c1; theme=dark"


def test_template_literal_text_and_names_ending() -> None:
    assert expand("user=$http_x_user_id;n=$arg_n") == b"user=u-7;n=2"
    assert expand("$session_key-$remote_addr") == b"conv-1-192.0.2.1"
    assert expand("plain value") == b"plain value"
    assert expand("cost $5 and $") == b"cost $5 and $"  # unknown names stay literal
    assert expand("$session_keyx") == b"$session_keyx"
    assert expand("é $arg_n") == "é 2".encode()


def test_template_missing_variables_expand_to_nothing() -> None:
    assert expand("a$arg_missing.b") == b"a.b"
    assert expand("[$cookie_none]") == b"[]"
    assert expand("$session_key", key=None) is None
    assert expand("$http_x_missing") is None
    assert expand("  $arg_missing  ") is None
    assert expand("") is None
    assert expand(" k=$session_key ", key=None) == b"k="


def test_template_rejects_invalid_field_values() -> None:
    assert expand("$arg_v", target=b"/?v=a%0D%0AX-Evil:%201") is None
    assert expand("$arg_v", target=b"/?v=a%0Ab") is None
    assert expand("$arg_v", target=b"/?v=a%00b") is None
    assert expand("$arg_v", target=b"/?v=a%7Fb") is None
    assert expand("$session_key", key=b"a\rb") is None
    assert expand("x\ny") is None
    assert expand("$arg_v", target=b"/?v=a%09b") == b"a\tb"  # tab is allowed
    assert expand("$arg_v", target=b"/?v=%E2%82%AC") == "€".encode()


def test_unknown_variables() -> None:
    assert unknown_variables("$session_key $remote_addr $arg_a $cookie_b $http_c") == []
    assert unknown_variables("$sesion_key $arg_ $5 $") == ["$sesion_key", "$arg_", "$5"]
