"""The shared resume store's driver side (``muxproxy/trio/resumestore.py``) without Redis.

What needs a real ``redis-server`` is in ``tests/e2e/test_resume_redis_e2e.py``.
"""

from __future__ import annotations

import subprocess
import sys

from muxproxy.trio.redis import redacted
from muxproxy.trio.resumestore import events_key, meta_key


def test_a_proxy_without_a_store_does_not_load_coredis() -> None:
    code = (
        "import sys, muxproxy.trio.server, muxproxy.trio.driver;"
        " sys.exit(1 if 'coredis' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_keys_of_a_stream_and_a_store_url_fit_for_logs() -> None:
    # The token in braces: a Redis Cluster hash tag, so a stream's keys share a slot (MULTI).
    assert events_key(b"T" * 22) == b"muxproxy:resume:{" + b"T" * 22 + b"}:events"
    assert meta_key(b"T" * 22) == b"muxproxy:resume:{" + b"T" * 22 + b"}:meta"
    assert redacted("redis://:secret@cache:6379/1") == "redis://cache:6379/1"
    assert redacted("rediss://user:pw@10.0.0.1") == "rediss://10.0.0.1"
    assert redacted("redis://cache:6379/0") == "redis://cache:6379/0"
