"""API-key authentication against a file of keys, with a tenant per key for the budgets.

The file (``settings.keys``, relative to the configuration file's directory unless absolute)
holds one ``KEY TENANT`` pair a line (``#`` starts a comment); it is read once, when the
configuration is loaded (``muxproxy check``, the start, each reload), so a request never
touches the disk. A request without ``Authorization: Bearer KEY``, or with a key not in the
file, is answered 401 with the OpenAI error object (on an ``api = "openai"`` route) and never
reaches a backend; a known key's tenant is the one the group's
``rate_limit`` counts, so each key gets its own token budget.

    [[extensions]]
    module = "apikeys:ApiKeys"            # with examples/extensions on PYTHONPATH
    settings = { keys = "/etc/muxproxy/keys.txt" }
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from muxproxy.extensions import Answer, Decision, Extension, Request


def read_keys(path: Path) -> dict[str, str]:
    """``key -> tenant`` from the file at ``path``; raises ``ValueError`` naming a bad line."""
    keys: dict[str, str] = {}
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            parts = text.split()
            if len(parts) != 2:
                raise ValueError(f"{path}, line {number}: expected KEY TENANT")
            keys[parts[0]] = parts[1]
    return keys


class ApiKeys(Extension):
    def __init__(self, settings: Mapping[str, Any]) -> None:
        super().__init__(settings)
        if "keys" not in settings:
            raise ValueError('settings.keys: missing; expected the path of a "KEY TENANT" file')
        self.keys = read_keys(self.settings.path("keys"))  # from the configuration's directory

    def on_request_head(self, request: Request) -> Decision | None:
        value = request.header("authorization") or ""
        scheme, _, key = value.partition(" ")
        tenant = self._tenant(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            answer = Answer(
                status=401,
                message="invalid API key",
                headers=[("www-authenticate", 'Bearer realm="muxproxy"')],
            )
            return Decision(answer=answer)
        # The key itself is not forwarded: the backend sees which tenant it serves.
        return Decision(tenant=tenant, set={"x-tenant": tenant}, remove=["authorization"])

    def _tenant(self, key: str) -> str | None:
        # Compared in constant time, so the answer's timing tells nothing of a key's prefix.
        found = None
        for known, tenant in self.keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        return found
