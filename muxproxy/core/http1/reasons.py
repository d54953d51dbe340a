"""The reason phrase of an HTTP/1.1 status line the proxy writes to a client.

RFC 9112 §4: the reason-phrase is optional and a client "SHOULD ignore" it, but some do not:
h2load, for one, counts every response with an empty phrase (``HTTP/1.1 200 ``) as failed. So,
as nginx and HAProxy do, a status line carries the standard phrase of its code (RFC 9110 §15,
as ``http.HTTPStatus`` lists them), whatever the backend wrote: a backend's own wording of a
known code is not relayed. For a code with no standard phrase (a 299, a 599) the backend's
phrase is kept (h11 parsed it: it holds only what RFC 9112 §4 allows), or none when there is
none (an HTTP/2 backend's response, RFC 9113 §8.3.2 has no reason phrase).
"""

from __future__ import annotations

from http import HTTPStatus

PHRASES: dict[int, bytes] = {status.value: status.phrase.encode("ascii") for status in HTTPStatus}
"""The standard reason phrase of each status code that has one."""


def reason_phrase(status: int, given: bytes = b"") -> bytes:
    """The phrase to write after ``status``: the standard one, else ``given`` (the backend's)."""
    return PHRASES.get(status, given)
