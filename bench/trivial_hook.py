"""The smallest extension that runs on every request: an ``on_request_head`` that decides
nothing. ``bench/icount.py --extension trivial_hook:RequestHeadOnly`` measures what the hook
machinery costs a request (the view made, the call, the ``None`` taken), apart from any work
an extension of its own would do."""

from __future__ import annotations

from muxproxy.extensions import Decision, Extension, Request


class RequestHeadOnly(Extension):
    def on_request_head(self, request: Request) -> Decision | None:
        return None
