"""Fixtures of the end-to-end tests built on their own peers (``peers``, ``stepped``); the
proxies and fake LLM backends the whole suite shares are in ``tests/conftest.py``."""

from __future__ import annotations

import pytest
from peers import serve_raw
from stepped import RecordingBackend


@pytest.fixture
async def recorded(start_proxy, nursery):
    """``backend, proxy = recorded``: a proxy in front of one ``RecordingBackend``, which
    answers every request head 200 ``ok`` and keeps every byte it got."""
    backend = RecordingBackend()
    port = await serve_raw(nursery, backend.handle)
    return backend, await start_proxy([port])
