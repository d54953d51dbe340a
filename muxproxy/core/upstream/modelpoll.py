"""Model lists: a periodic ``GET /v1/models`` to every server of a group with
``learn_models``, read as the models the server serves (``routing/modelcatalog.py``), for the
proxy's own answer to ``GET /v1/models`` (``core/apis/modellist.py``).

A ``ModelPoll`` is a probe (``probes.py``) of another kind, as a load poll is
(``loadpoll.py``): the same way to the server (a pooled backend connection, as requests
use), the same timers and states; it reads the body, at most ``BODY_LIMIT`` bytes, and
hands the parsed list to the catalog (``Effects.models``). A failure (no connection, a
timeout, a status other than 200, a body too large or not an OpenAI model list) degrades
this one feature for this one server: its last good list stands, the failure is kept
beside it for ``/status``, and nothing else is touched. The first result is logged
(``event=models_poll``), and after it each change (a failure starting or ending, the list
changing), never every poll: at most one line per server per ``models_refresh``. A model
poll never changes a server's health.
"""

from __future__ import annotations

from muxproxy.config import Upstream
from muxproxy.core.commands import Log
from muxproxy.core.effects import Effects
from muxproxy.core.ports import ProbeHost
from muxproxy.core.upstream.bodypoll import BodyPoll
from muxproxy.routing.modelcatalog import MAX_BODY, ModelInfo, ModelListError, parse_model_list

BODY_LIMIT = MAX_BODY
"""Bytes of a model list read at most, the parser's own bound (``modelcatalog.MAX_BODY``)."""
PATH = b"/v1/models"
"""What an OpenAI-compatible engine (vLLM, SGLang, TGI, llama.cpp's server) lists its
models at, LoRA adapters included."""
TIMEOUT = 5.0
"""Seconds a poll may take (half of ``models_refresh`` when that is shorter): an engine
answers its list from memory, in milliseconds even when busy."""


class ModelPoll(BodyPoll):
    WHAT = "model list"
    USER_AGENT = b"muxproxy-models"

    def __init__(
        self, fx: Effects, host: ProbeHost, group: Upstream, index: int, ident: int
    ) -> None:
        super().__init__(fx, host, group, index, ident, body_limit=BODY_LIMIT)
        self.models: tuple[ModelInfo, ...] = ()

    def _schedule_of(self, group: Upstream) -> tuple[bytes, float, float]:
        return PATH, group.models_refresh, min(TIMEOUT, group.models_refresh / 2)

    def _read(self, body: bytes) -> str | None:
        try:
            self.models = parse_model_list(body)
        except ModelListError as exc:
            return str(exc)
        return None

    def _result(self, ok: bool, detail: str) -> None:
        catalog, server, now = self.fx.models, self.group.servers[self.index].address, self.fx.now
        changed = False
        if ok:
            changed = catalog.learnt(self.group.name, server, self.models, now)
        else:
            catalog.failed(self.group.name, server, detail, now)
        if self.failing is None or ok == self.failing or changed:  # first, or a change
            self.failing = not ok
            fields = {
                "upstream": self.group.name,
                "server": str(self.origin),
                "ok": ok,
                "models": len(self.models),  # those that stand, after a failure too
                "detail": detail,
            }
            self.fx.emit(Log(event="models_poll", fields=fields))
