"""A header-based canary: some requests go to the ``canary`` group instead of the route's.

``x-canary: always`` sends a request there, ``x-canary: never`` keeps it off; otherwise a
stable hash of one header (``settings.header``, e.g. a user id) decides, so ``percent`` of the
users, always the same ones, get the canary (and a user's conversation stays on one side).

    [[extensions]]
    module = "header_canary:HeaderCanary"   # with examples/extensions on PYTHONPATH
    settings = { group = "canary", header = "x-user", percent = 10 }
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from muxproxy.extensions import Decision, Extension, Request


class HeaderCanary(Extension):
    def __init__(self, settings: Mapping[str, Any]) -> None:
        super().__init__(settings)
        self.group = str(settings.get("group", "canary"))
        self.header = str(settings.get("header", "x-user"))
        percent = settings.get("percent", 0)
        if not isinstance(percent, int | float) or not 0 <= percent <= 100:
            raise ValueError(f"settings.percent: expected 0..100, got {percent!r}")
        self.percent = float(percent)

    def on_request_head(self, request: Request) -> Decision | None:
        forced = (request.header("x-canary") or "").lower()
        if forced == "always":
            return Decision(group=self.group)
        if forced == "never":
            return None
        value = request.header(self.header)
        if value is None or not self.percent:
            return None
        bucket = int.from_bytes(hashlib.sha256(value.encode()).digest()[:8]) % 10_000
        return Decision(group=self.group) if bucket < self.percent * 100 else None
