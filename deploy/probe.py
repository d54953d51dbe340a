"""A health probe for muxproxy's admin API: ``python3 probe.py URL`` exits 0 when ``GET URL``
answers 200 within 2 seconds, 1 otherwise (refused, timed out, any other status). The pod's
liveness probe and the image's ``HEALTHCHECK`` run it on ``/status``, which answers until the
process exits, a graceful stop included; readiness needs no script (an ``httpGet`` on
``/ready``, which takes no token).

It sends ``Authorization: Bearer $MUXPROXY_ADMIN_TOKEN`` when that variable is set: off a
loopback address the admin API answers reads only with the token (``muxproxy/trio/admin.py``),
and a Kubernetes ``httpGet`` probe cannot take a header from a Secret. Only the standard
library, and not muxproxy itself: ``muxproxy admin status`` would do the same, but importing
the proxy costs about 0.35 s of CPU on every probe, and this script under 0.1 s.
"""

from __future__ import annotations

import http.client
import os
import sys
from urllib.parse import urlsplit

TIMEOUT = 2.0
"""Seconds for the connect and the answer: below the probes' ``timeoutSeconds`` (3), so the
probe reports a slow proxy itself rather than being killed."""


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: probe.py http://HOST:PORT/PATH", file=sys.stderr)
        return 2
    url = urlsplit(argv[0])
    if url.scheme != "http" or url.hostname is None:
        print(f"probe.py: expected an http:// URL, got {argv[0]!r}", file=sys.stderr)
        return 2
    headers = {}
    token = os.environ.get("MUXPROXY_ADMIN_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    connection = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=TIMEOUT)
    try:
        connection.request("GET", url.path or "/", headers=headers)
        response = connection.getresponse()
        response.read()
    except (OSError, http.client.HTTPException) as exc:
        print(f"probe.py: {argv[0]}: {exc}", file=sys.stderr)
        return 1
    finally:
        connection.close()
    if response.status != 200:
        print(f"probe.py: {argv[0]}: {response.status} {response.reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
