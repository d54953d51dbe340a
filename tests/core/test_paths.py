"""Request-path normalisation (``muxproxy.core.http.paths``): RFC 3986 §5.2.4 and §6.2.2."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from muxproxy.core.http.intake import MalformedRequest
from muxproxy.core.http.paths import normalise_target, remove_dot_segments


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        # RFC 3986 §5.2.4 and the §5.4 examples, as absolute paths.
        (b"/a/b/c/./../../g", b"/a/g"),
        (b"/b/c/./g", b"/b/c/g"),
        (b"/b/c/../g", b"/b/g"),
        (b"/b/c/.", b"/b/c/"),
        (b"/b/c/..", b"/b/"),
        (b"/b/c/../..", b"/"),
        (b"/../g", b"/g"),
        (b"/../../g", b"/g"),
        (b"/g.", b"/g."),
        (b"/.g", b"/.g"),
        (b"/g..", b"/g.."),
        (b"/..g", b"/..g"),
        (b"/a//../b", b"/a/b"),
        (b"/..", b"/"),
        (b"/.", b"/"),
        (b"/", b"/"),
    ],
)
def test_remove_dot_segments(path: bytes, expected: bytes) -> None:
    assert remove_dot_segments(path) == expected


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (b"/v1/chat/completions", b"/v1/chat/completions"),
        (b"/v1/../flag", b"/flag"),
        (b"/v1/%2e%2e/flag", b"/flag"),
        (b"/v1/%2E%2e/flag", b"/flag"),
        (b"/v1/.%2e/flag", b"/flag"),
        (b"/v1/./models", b"/v1/models"),
        # RFC 3986 §6.2.2.2: encoded unreserved characters are the characters.
        (b"/%76%31/models", b"/v1/models"),
        (b"/v1/a%7Eb", b"/v1/a~b"),
        # Other encodings are kept as sent.
        (b"/v1/a%20b/./c", b"/v1/a%20b/c"),
        (b"/v1/%C3%A9", b"/v1/%C3%A9"),
        # An encoded slash is data in its segment while no dot-segment hides behind it.
        (b"/v1/models/org%2Fmodel", b"/v1/models/org%2Fmodel"),
        (b"/v1/models/a%2f..b/./c", b"/v1/models/a%2f..b/c"),
        (b"/v1/x%5Cy", b"/v1/x%5Cy"),
        # The query is never touched.
        (b"/v1/models?next=/../x&q=%2f%2e%2e", b"/v1/models?next=/../x&q=%2f%2e%2e"),
        (b"/v1/../models?a=%2e", b"/models?a=%2e"),
        (b"/.well-known/x", b"/.well-known/x"),
        # A path parameter is kept; only a dot-segment behind one is refused.
        (b"/v1/models;v=1/x", b"/v1/models;v=1/x"),
        (b"*", b"*"),
        (b"", b""),
    ],
)
def test_normalise_target(target: bytes, expected: bytes) -> None:
    assert normalise_target(target) == expected


@pytest.mark.parametrize(
    "target",
    [
        b"/v1/..%2fflag",
        b"/v1/..%2Fflag",
        b"/v1/%2e%2e%2fflag",
        b"/v1/x%2f..%2fflag",
        b"/v1/x%2F.%2Fy",
        b"/v1/..%5cflag",
        b"/v1/..\\flag",
        # A dot-segment behind a path parameter (";"), which servers that strip parameters
        # before resolving read as one.
        b"/v1/..;/flag",
        b"/v1/..;",
        b"/v1/.;x/flag",
        b"/v1/%2e%2e;x/flag",
        b"/v1/.%2e;/flag",
        b"/v1/..%3b/flag",
        b"/v1/..%3Bx/flag",
        b"/v1/%zz",
        b"/v1/x%",
        b"/v1/x%4",
    ],
)
def test_paths_that_cannot_be_normalised_safely_are_refused(target: bytes) -> None:
    with pytest.raises(MalformedRequest) as info:
        normalise_target(target)
    assert info.value.status == 400


_segment = st.sampled_from([b"", b".", b"..", b"%2e", b"%2E%2e", b"a", b"b.c", b"%41", b"%20"])


@given(st.lists(_segment, min_size=1, max_size=10), st.sampled_from([b"", b"?q=/../x"]))
def test_normalised_paths_are_a_fixed_point_without_dot_segments(
    segments: list[bytes], query: bytes
) -> None:
    target = b"/" + b"/".join(segments) + query
    normal = normalise_target(target)
    path, _, rest = normal.partition(b"?")
    assert normal.endswith(query) and rest == query[1:]
    assert b"." not in path.split(b"/") and b".." not in path.split(b"/")
    assert b"%2e" not in path.lower()
    assert normalise_target(normal) == normal
